"""The finish step: a sampled token joins its sequence, the text grows, and a stop token, a stop string, the
output limit or the context window decides whether the sequence is done."""
from prefixcache.engine.sequence import Sequence, TokenLogprob


def append(seq: Sequence, token: int, logprob: TokenLogprob, eos_ids: tuple[int, ...], max_model_len: int
           ) -> bool:
    """Append the token; True if it finished the sequence (its finish_reason set, its text final)."""
    seq.tokens.append(token)
    seq.cumulative_logprob += logprob.logprob
    if seq.logprobs is not None:
        seq.logprobs.append(logprob)
    p = seq.params
    # a stop token's text is not part of the output (unless asked); the sampler masks them until min_tokens
    eos = token in eos_ids
    # a finished grammar accepted its stop token: nothing may follow it, ignore_eos or not
    stop_token = token in p.stop_token_ids or (eos and not p.ignore_eos) or bool(seq.matcher and seq.matcher.done)
    new = "" if stop_token and not p.include_stop_str_in_output else seq.detok.add(token)
    text = seq.detok.text
    stops = p.stop if len(seq.output_ids) >= p.min_tokens else []
    since = len(text) - len(new) - max(map(len, stops), default=0) + 1  # only new text can complete a stop
    # the earliest stop string in the text, the longest of those that start there
    stop_at, stop = min(((i, s) for s in stops if (i := text.find(s, max(since, 0))) >= 0),
                        key=lambda f: (f[0], -len(f[1])), default=(-1, ""))
    keep = len(stop) if p.include_stop_str_in_output else 0
    seq.text = text[:stop_at + keep] if stop_at >= 0 else text
    if stop_token or stop_at >= 0:
        seq.finish_reason = "stop"
    elif len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= max_model_len:
        seq.finish_reason = "length"
    else:
        return False
    if stop_at < 0:
        seq.text += seq.detok.flush()
    return True
