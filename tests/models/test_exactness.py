"""The exactness probe and its plans (models/exactness.py), the config checks around them, `prefixcache doctor`.
The plans' end-to-end effect (bit-identical logits in every mode) is tested in test_model.py and
test_cache_engine.py."""
import pytest
import torch
from conftest import GREEDY, generate_with_logits

from prefixcache import LLM, Config
from prefixcache.cli import main
from prefixcache.models.exactness import ATTN_SIZES, in_calls
from prefixcache.models.llama import Llama
from prefixcache.models.loader import load
from prefixcache.models.probe import probe
from prefixcache.models.rowwise import TorchOps


@pytest.fixture(scope="module")
def tiny(tiny_model) -> LLM:
    """On the torch path, whose row counts the probe searches (our kernels' confirmation: test_kernels.py)."""
    return LLM(model=tiny_model, enable_prefix_cache=False, kernels="off")


def test_probe_reports_m0_and_classes(tiny):
    plan = tiny.exactness
    assert plan is tiny.engine.exactness and plan.cpu and plan.mode in ("pad", "fixed")
    assert [c.name for c in plan.ops] == ["qkv", "o", "gate_up", "down", "rms_norm", "swiglu", "lm_head", "attention"]
    assert plan.ops[0].shape == "128x64"  # the fused q, k, v weight of the tiny model
    assert all(set(range(1, 17)) <= set(c.agree + c.differ) for c in plan.ops)  # every small count is probed
    if plan.mode == "pad":  # the row-wise ops: every probed count from m0 on agrees, and so do the padded-to ones
        for c in plan.ops[:-1]:
            assert set(c.agree) >= {s for s in c.agree + c.differ if s >= plan.m0} | set(plan.row_sizes)
        assert plan.row_sizes[-1] == plan.m0 and plan.call_rows(plan.m0 + 5) == plan.m0 + 5
    assert set(plan.attn_sizes) <= set(plan.ops[-1].agree) or plan.attn_sizes == [plan.m0]
    assert plan.call_rows(1) == plan.row_sizes[0] and plan.attn_rows(1) in plan.attn_sizes


def test_the_plan_holds_for_the_model_ops(tiny):
    """Independently of the probe's own comparisons: computed as the plan says, a row gets the same bits
    whatever the number of rows computed with it and wherever it sits."""
    model, plan = tiny.engine.runner.model, tiny.exactness
    for op in model.row_ops():
        x = torch.randn(70, op.width)
        ref = in_calls(op.fn, x, plan.call_rows(len(x)), *op.args)
        for m in range(1, 17):  # the head sees at most max_num_seqs rows
            for start in (0, 3):
                assert torch.equal(in_calls(op.fn, x[start:start + m], plan.call_rows(m), *op.args),
                                   ref[start:start + m]), (op.name, m, start)


@pytest.mark.parametrize("mode", ["fixed", "rows"])
def test_the_fallback_can_be_forced(tiny_model, mode):
    plan = LLM(model=tiny_model, exactness=mode).exactness
    assert plan.mode == mode and plan.row_sizes == plan.attn_sizes == [plan.m0]
    assert plan.call_rows(1) == plan.call_rows(100) == plan.m0 == (1 if mode == "rows" else 16)
    assert plan.note.startswith("forced")


def test_a_failing_probe_falls_back_to_rows(tiny_model):
    plan = probe(Llama(load(tiny_model), 0, TorchOps()), "auto", 64, 16)  # no keys to attend to: the probe raises
    assert plan.mode == "rows" and plan.note.startswith("probe failed: RuntimeError")


def test_the_probe_is_cached(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path))
    model = Llama(load(tiny_model), 512, TorchOps())
    first, again = probe(model, "auto", 96, 8), probe(model, "auto", 96, 8)
    assert not first.cached and again.cached and again.summary() | {"cached": False} == first.summary()
    assert len(list((tmp_path / "exactness").iterdir())) == 1


@pytest.mark.parametrize("option, value, choices", [
    ("exactness", "strict", "auto, pad, fixed, rows"),
    ("kernels", "sse2", "auto, avx512, avx2, off"),
    ("kv_dtype", "int4", "auto, float32, bfloat16"),
    ("dtype", "float16", "float32, bfloat16"),
])
def test_bad_options_name_the_choices(tiny_model, option, value, choices):
    with pytest.raises(ValueError, match=f"{option}='{value}': choose one of {choices}"):
        LLM(model=tiny_model, **{option: value})


def test_kv_dtype_defaults_to_the_activation_dtype(tiny, tiny_model):
    assert tiny.engine.config.kv_storage_dtype == "float32" and tiny.engine.pool.k.dtype == torch.float32
    half = LLM(model=tiny_model, kv_dtype="bfloat16").engine.pool
    assert half.block_bytes * 2 == tiny.engine.pool.block_bytes


def test_bfloat16_weights_need_a_cpu_with_native_bf16_and_stay_exact(tiny_model):
    """On a CPU with native bf16: the probe plans bf16 (no fallback), and warm, chunked and batched runs give the
    bits of a cold single run. Elsewhere: a clear error."""
    from prefixcache.models.cpu import cpu_info

    if not cpu_info().has_bf16:
        with pytest.raises(ValueError, match="avx512_bf16 or AMX"):
            LLM(model=tiny_model, dtype="bfloat16")
        return
    assert Config(model=tiny_model, dtype="bfloat16").kv_storage_dtype == "bfloat16"
    cold = LLM(model=tiny_model, dtype="bfloat16", enable_prefix_cache=False, attn_tile=64)
    warm = LLM(model=tiny_model, dtype="bfloat16", max_batch_tokens=96, attn_tile=64)
    assert "failed" not in cold.exactness.note and "failed" not in warm.exactness.note
    prompts = [list(range(4000, 4300)), list(range(4000, 4200)) + [5, 6], [7, 8, 9]]
    warm.generate(prompts[:1], GREEDY)
    singles = [generate_with_logits(cold, [p], GREEDY)[1][0] for p in prompts]
    outs, together = generate_with_logits(warm, prompts, GREEDY)
    assert outs[1].cached_tokens == 200 and all(torch.equal(a, b) for a, b in zip(singles, together))


def test_doctor_prints_the_cpu_the_classes_the_mode_and_its_cost(tiny_model, capsys):
    main(["doctor", "--model", tiny_model, "--kernels", "off"])
    out = capsys.readouterr().out
    for line in ("cpu ", "simd ", "threads ", "openmp   waiting threads ", "probe ", "  qkv ", "  attention ",
                 "mode     pad: ", "cost     b=1: ", "kernels  off: kernels=off"):
        assert line in out, line
    assert str(ATTN_SIZES[-1]) in out
