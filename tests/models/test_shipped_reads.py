"""The whole engine reading the default model's weights as shipped (its GGUF's Q4_1 and Q8_0 blocks) against the
same engine reading them dequantized to fp32 (`quantized_reads=False`): long chats, batched past the rows the
kernels dequantize in registers, cold and then from the prefix cache, give the same tokens and logits, bit for bit."""
import torch
from conftest import generate_with_logits

from prefixcache import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TOPICS = ["caches", "rivers", "compilers", "bread", "glaciers", "chess", "bridges", "tea", "orbits", "maps", "clocks",
          "honey", "volcanoes", "violins", "lighthouses", "paper", "salt"]


def _chats(llm: LLM, turns: int) -> list[list[int]]:
    """Seventeen chats sharing a system prompt: one of about 700 tokens (two attention tiles), the others of 140 to
    330."""
    system = {"role": "system", "content": "You answer briefly and precisely. " * 8}
    chats = []
    for i, topic in enumerate(TOPICS):
        history = [system]
        for t in range(turns + (8 if i == 0 else i % 4)):
            history += [{"role": "user", "content": f"Tell me fact {t} about {topic}, with its history."},
                        {"role": "assistant", "content": f"Fact {t} about {topic}: " + "it has a long story. " * 6}]
        chats.append(llm.encode_chat(history + [{"role": "user", "content": f"Now sum up {topic} in a line."}]))
    return chats


def test_weights_read_as_shipped_give_the_fp32_engines_tokens_and_logits():
    shipped, fp32 = (LLM(quantized_reads=q, max_num_seqs=len(TOPICS)) for q in (True, False))
    model = shipped.engine.runner.model
    assert model.paged, f"the kernels do not run: {shipped.exactness.kernels}"
    # every GEMM, the stacked ones included, reads blocks; the other engine reads fp32 panels alone
    for name, w in model.gemm_weights().items():
        assert all(p.kind != "F32" for p in w.parts), f"{name} is not read as shipped: {[p.kind for p in w.parts]}"
    assert not any(w.kinds for w in fp32.engine.runner.model.gemm_weights().values())
    assert model.ops.quant_rows < len(TOPICS), "decode steps must dequantize into scratch too"
    chats = _chats(shipped, 1)
    assert min(map(len, chats)) >= 100 and max(map(len, chats)) >= 600, [len(c) for c in chats]
    for _ in ("cold", "from the prefix cache"):
        a_out, a = generate_with_logits(shipped, chats, PARAMS)
        b_out, b = generate_with_logits(fp32, chats, PARAMS)
        assert [o.token_ids for o in a_out] == [o.token_ids for o in b_out]
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert shipped.cache_stats()["hit_tokens"] > 0 and fp32.cache_stats()["hit_tokens"] > 0
