"""Whether the engine takes a request: its prompt, breakpoints and token ids valid for this model, and prompt and
output able to fit the KV pool (with a draft) even alone. Refusals are ValueErrors, which the server answers 400."""
from prefixcache.cache.policy import Breakpoint
from prefixcache.engine.blocks import BlockManager
from prefixcache.engine.sequence import SamplingParams


def check(prompt: list[int], params: SamplingParams, breakpoints: list[Breakpoint], vocab: int, max_model_len: int,
          blocks: BlockManager, drafts: int, max_num_seqs: int) -> None:
    """`params` with its max_tokens resolved; `drafts`: the longest draft a decode step may add."""
    if not prompt:
        raise ValueError("prompt is empty")
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt has {len(prompt)} tokens; the context window is {max_model_len}")
    if any(t < 0 or t >= vocab for t in prompt):
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
    for b in breakpoints:
        if not 0 < b.position <= len(prompt):
            raise ValueError(f"breakpoint at {b.position} is outside the prompt (1..{len(prompt)})")
    # alone in the pool it must still fit, prompt and output (and a draft): else it would be preempted and
    # restarted forever, its steps starving everyone else's
    longest = min(len(prompt) + params.max_tokens, max_model_len) + drafts  # output stops at the window
    if not blocks.fits(longest):
        raise ValueError(f"the prompt ({len(prompt)} tokens) and max_tokens ({params.max_tokens}) need "
                         f"{blocks.pages_for(longest)} KV blocks; the cache holds {blocks.room()} "
                         "(pinned entries excluded)")
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                      ("allowed_token_ids", params.allowed_token_ids or []),
                      ("bad_words", [t for word in params.bad_words for t in word])):
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"{name}: token ids must be in the vocabulary [0, {vocab})")
    if params.num_samples > max_num_seqs:
        raise ValueError(f"n and best_of must be at most {max_num_seqs} (max_num_seqs)")
