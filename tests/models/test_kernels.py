"""Our CPU kernels (prefixcache/kernels) against float64, bit for bit against themselves whatever the rows, threads,
ISA build, batch, chunking and block placement, and the engine's fallback to the torch path."""
import dataclasses
import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
from conftest import GREEDY, generate_with_logits, warm_and_cold
from family_models import family_model

from prefixcache import LLM, kernels
from prefixcache.models import paged, rope
from prefixcache.models.attention import Queries
from prefixcache.models.exactness import row_counts
from prefixcache.models.kernel_check import attention64
from prefixcache.models.llama import Llama
from prefixcache.models.loader import load
from prefixcache.models.probe import _confirm, probe
from prefixcache.models.rowwise import KernelOps, Packed

AVAILABLE = kernels.choose("auto").isa
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"kernels: {kernels.choose('auto').status}")
BUILDS = [KernelOps(isa) for isa in kernels.ISAS
          if isa in kernels.supported()]
# every GEMM shape of SmolLM2-135M (qkv, o, gate_up, down, lm_head), and odd ones
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (37, 53), (16, 1), (1, 17), (100, 513)]


def _rel_err(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    return ((y.double() - ref).abs() / scale).max().item()


@pytest.mark.parametrize("n, k", SHAPES)
def test_linear_is_within_fp32_rounding_of_float64(n, k):
    """An fp32 fma chain over K, then + bias: at most K + 1 roundings of 2^-24, relative to sum |x w| + |b|."""
    g = torch.Generator().manual_seed(n * k)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(17, k, generator=g)
    ref = x.double() @ w.double().T + b.double()
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    for ops in BUILDS:
        assert _rel_err(ops.linear(x, ops.prepare(w), b), ref, scale) < (k + 1) * 2 ** -24


def test_linear_rows_equal_the_one_row_call_for_1_to_64_rows_threads_and_builds():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(960, 576, generator=g), torch.randn(960, generator=g), torch.randn(64 + 3, 576, generator=g)
    ops0 = BUILDS[0]
    packed = ops0.prepare(w)
    single = torch.cat([ops0.linear(x[i:i + 1], packed, b) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, 3, threads}):
            torch.set_num_threads(t)
            for ops in BUILDS:
                for m in range(1, 65):
                    for start in (0, 3):
                        assert torch.equal(ops.linear(x[start:start + m], packed, b), single[start:start + m]), \
                            (ops.name, t, m, start)
    finally:
        torch.set_num_threads(threads)



@pytest.mark.parametrize("m", [1, 7, 8, 17, 512])
def test_the_fused_linears_give_the_bits_of_the_separate_ops(m):
    """RMSNorm or SwiGLU before the GEMM, and the residual after it, in one op: the same bits as the ops apart, on
    every build, at decode and prefill row counts (512 rows walk k in ranges)."""
    g = torch.Generator().manual_seed(m)
    x, norm, res = torch.randn(m, 576, generator=g), torch.randn(576, generator=g), torch.randn(m, 576, generator=g)
    gu, down = 4 * torch.randn(m, 2 * 1536, generator=g), torch.randn(576, 1536, generator=g)
    w, b = torch.randn(576, 576, generator=g), torch.randn(576, generator=g)
    for ops in BUILDS:
        pw, pd = ops.prepare(w), ops.prepare(down)
        assert torch.equal(ops.norm_linear(x, norm, 1e-5, pw, b), ops.linear(ops.rms_norm(x, norm, 1e-5), pw, b))
        assert torch.equal(ops.linear(x, pw, b, residual=res), res + ops.linear(x, pw, b))
        assert torch.equal(ops.swiglu_linear(gu, pd, residual=res), res + ops.linear(ops.swiglu(gu), pd))
        assert torch.equal(ops.swiglu_linear(gu, pd, residual=res), BUILDS[0].swiglu_linear(gu, pd, residual=res))


def test_the_linear_op_refuses_what_it_cannot_compute():
    ops = BUILDS[0]
    pw, x = ops.prepare(torch.randn(32, 16)), torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="residual shape"):
        ops.linear(x, pw, residual=torch.zeros(3, 31))
    with pytest.raises(RuntimeError, match="rms_norm or swiglu"):
        torch.ops.prefixcache.linear(x, pw.data, pw.ids, pw.rows, None, ops.isa, torch.ones(16), 1e-5, True)

def test_rms_norm_and_swiglu_match_float64_and_every_row_count():
    g = torch.Generator().manual_seed(1)
    x, w, gu = (torch.randn(33, 576, generator=g), torch.randn(576, generator=g),
                4 * torch.randn(33, 2 * 1536, generator=g))
    x64 = x.double()
    norm64 = w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    gate, up = gu.double().chunk(2, dim=-1)
    swiglu64 = F.silu(gate) * up
    for ops in BUILDS:
        norm, act = ops.rms_norm(x, w, 1e-5), ops.swiglu(gu)
        assert _rel_err(norm, norm64, norm64.abs() + 1e-3) < 1e-6
        assert _rel_err(act, swiglu64, swiglu64.abs() + 1e-3) < 1e-6
        for m in (1, 2, 17):
            assert torch.equal(ops.rms_norm(x[3:3 + m], w, 1e-5), norm[3:3 + m])
            assert torch.equal(ops.swiglu(gu[3:3 + m]), act[3:3 + m])
        assert torch.equal(norm, BUILDS[0].rms_norm(x, w, 1e-5)) and torch.equal(act, BUILDS[0].swiglu(gu))


def test_gpt_oss_clamped_swiglu_matches_float64_every_row_count_and_build():
    """(clamp(up, -7, 7) + 1) * g sigmoid(1.702 g), g = min(gate, 7), as HF's GptOssExperts._apply_gate; gates and
    ups of 4 sigma reach the clamp."""
    gu = 4 * torch.randn(33, 2 * 80, generator=torch.Generator().manual_seed(2))
    gate, up = gu.double().chunk(2, dim=-1)
    assert (gate > 7).any() and (up.abs() > 7).any()
    gate = gate.clamp(max=7.0)
    ref = (up.clamp(-7.0, 7.0) + 1) * gate * torch.sigmoid(1.702 * gate)
    for ops in BUILDS:
        act = ops.clamp_glu(gu, 1.702, 7.0)
        assert _rel_err(act, ref, ref.abs() + 1e-3) < 1e-6
        assert all(torch.equal(ops.clamp_glu(gu[3:3 + m], 1.702, 7.0), act[3:3 + m]) for m in (1, 2, 17))
        assert torch.equal(act, BUILDS[0].clamp_glu(gu, 1.702, 7.0))


def test_logit_stats_match_float64_every_row_count_and_build():
    """A row's max, the first index of it and log(sum(e^(x - max))), over vocabularies of 49,152 (SmolLM2) and 37
    (a partial vector): within fp32 rounding of float64, the same bits alone as in any batch and in both builds; a
    row holding NaN gives NaN and -1, a row of -inf only -inf and 0, a tie the first index."""
    g = torch.Generator().manual_seed(2)
    for vocab in (49152, 37):
        x = 8 * torch.randn(9, vocab, generator=g)
        x[1, vocab // 2] = float("nan")
        x[2] = float("-inf")
        x[3, 5] = x[3, vocab - 1] = 1e3
        x[4, :vocab - 1] = float("-inf")
        x64 = x.double()
        for ops in BUILDS:
            stats, argmax = ops.logit_stats(x)
            assert argmax[[1, 2, 3, 4]].tolist() == [-1, 0, 5, vocab - 1]
            assert stats[1].isnan().all() and stats[2].tolist() == [float("-inf")] * 2
            assert stats[4].tolist() == [x[4, -1].item(), 0.0]
            good = [0, 3, 5, 6, 7, 8]
            assert torch.equal(stats[good, 0], x[good].max(1).values) and torch.equal(argmax[good], x[good].argmax(1))
            logsum64 = torch.logsumexp(x64[good] - x64[good].max(1, keepdim=True).values, 1)
            assert _rel_err(stats[good, 1], logsum64, logsum64 + 1) < 1e-6
            for lo, hi in ((0, 1), (5, 6), (3, 9)):
                alone = ops.logit_stats(x[lo:hi])
                assert torch.equal(alone[0].nan_to_num(), stats[lo:hi].nan_to_num()) and torch.equal(alone[1],
                                                                                                    argmax[lo:hi])
            assert torch.equal(stats.nan_to_num(), BUILDS[0].logit_stats(x)[0].nan_to_num())


def _pool(keys: int, kv_heads: int, d: int, g: torch.Generator, bs: int = 16):
    blocks = -(-keys // bs)
    k, v = (torch.randn((blocks + 1) * bs, kv_heads, d, generator=g) for _ in range(2))
    return k, v, (1 + torch.randperm(blocks, generator=g)).tolist()


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("heads, kv_heads, d, keys", [(9, 3, 64, 513), (4, 2, 16, 40), (32, 8, 128, 1100)])
def test_paged_attention_matches_float64(heads, kv_heads, d, keys, sinks):
    """With gpt-oss's sinks too: a logit per head in the softmax's denominator (HF's eager_attention_forward)."""
    g = torch.Generator().manual_seed(keys)
    k, v, table = _pool(keys, kv_heads, d, g)
    pos = [0, 1, 15, 16, 17, keys // 2, keys - 2, keys - 1]
    q = torch.randn(len(pos), heads, d, generator=g)
    s = 2 * torch.randn(heads, generator=g) if sinks else None
    p = paged.plan([Queries(0, pos, keys, table)], len(pos), 16)
    for ops in BUILDS:
        out = paged.attend(q, *paged.laid_out(k, v), p, ops.isa, None, s)
        for i, n in enumerate(pos):
            slots = torch.tensor([table[j // 16] * 16 + j % 16 for j in range(n + 1)])
            ref = attention64(q[i], k[slots], v[slots], s)
            assert ((out[i].double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (ops.name, n)


@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 2, 16), (32, 8, 128)])
def test_rope_store_is_rope_then_store(heads, kv_heads, d):
    """The fused op, in every build: the queries RoPE gives, and the pool paged.store writes, bit for bit; rows
    past the slots (padding) are roped but not stored."""
    g = torch.Generator().manual_seed(d)
    rows, slots_in_pool = 37, 64 * 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
    slots = torch.randperm(slots_in_pool, generator=g)[:rows - 2]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q, k, v = q.reshape(rows, heads, d), k.reshape(rows, kv_heads, d), v.reshape(rows, kv_heads, d)
    k_ref, v_ref = torch.zeros(slots_in_pool, kv_heads, d), torch.zeros(slots_in_pool, kv_heads, d)
    paged.store(k_ref, v_ref, rope.apply(k, cos, sin)[:rows - 2], v[:rows - 2], slots)
    for ops in BUILDS:
        kp, vp = torch.zeros_like(k_ref), torch.zeros_like(v_ref)
        out = paged.rope_store(qkv, cos, sin, kp, vp, slots, heads, kv_heads, ops.isa)
        assert torch.equal(out, rope.apply(q, cos, sin)) and torch.equal(kp, k_ref) and torch.equal(vp, v_ref), ops.name


@pytest.mark.parametrize("sinks", [False, True])
def test_paged_attention_rows_do_not_depend_on_batch_chunking_placement_threads_or_build(sinks):
    """40 prompt tokens of one sequence and the decode tokens of 3 sequences sharing its blocks: each row's bits
    equal its own call's (whose 3 units are fewer than 2 a thread: its spans run apart, then fold), with the blocks
    moved, in chunks, in any build; with gpt-oss's sinks too."""
    g = torch.Generator().manual_seed(7)
    heads, kvh, d, keys = 9, 3, 64, 700
    k, v, table = _pool(keys, kvh, d, g)
    pos = list(range(keys - 40, keys))
    q = torch.randn(43, heads, d, generator=g)
    s = torch.randn(heads, generator=g) if sinks else None
    groups = [Queries(0, pos, keys, table)] + [Queries(40 + i, [keys - 1 - i], keys - i, table) for i in range(3)]
    kp, vp = paged.laid_out(k, v)
    ref = paged.attend(q, kp, vp, paged.plan(groups, 43, 16), BUILDS[0].isa, None, s)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            alone = torch.cat([paged.attend(q[i:i + 1], kp, vp, paged.plan([Queries(0, [p], p + 1, table)], 1, 16),
                                            BUILDS[0].isa, None, s)
                               for i, p in enumerate(pos + [keys - 1, keys - 2, keys - 3])])
            assert torch.equal(ref, alone), t
    finally:
        torch.set_num_threads(threads)
    k2, v2, moved = paged.moved(k, v, table, g)
    chunks = [Queries(0, pos[:7], keys - 33, moved), Queries(7, pos[7:], keys, moved)]
    out = paged.attend(q[:40], *paged.laid_out(k2, v2), paged.plan(chunks, 40, 16), BUILDS[-1].isa, None, s)
    assert torch.equal(out, ref[:40])


def test_the_engine_confirms_the_kernels_and_runs_unpadded(tiny_model):
    llm = LLM(model=tiny_model, enable_prefix_cache=False)
    plan = llm.exactness
    assert plan.mode == "kernel" and plan.kernels.startswith(AVAILABLE) and all(not c.differ for c in plan.ops)
    assert plan.call_rows(1) == 1 and plan.padded_rows(3) == 3
    assert llm.engine.runner.model.paged


def test_warm_chunked_batched_equal_cold_on_both_paths(tiny_model):
    """The same greedy logits with the kernels and with the torch path forced (each against its own cold run)."""
    prompts = [list(range(4000, 4300)), list(range(4000, 4200)) + [5, 6], [7, 8, 9]]
    for kernels_choice in ("auto", "off"):
        outs, singles, together, paged = warm_and_cold(tiny_model, prompts, kernels_choice)
        assert paged == (kernels_choice == "auto")
        assert outs[1].cached_tokens == 200 and all(torch.equal(a, b) for a, b in zip(singles, together))


@pytest.mark.parametrize("op", ["rms_norm+qkv", "layers"])
def test_a_kernel_that_fails_the_startup_check_falls_back_to_torch(op, tiny_model, monkeypatch, caplog, tmp_path):
    """A kernel giving other bits for one row count (a fused GEMM, or the one op of a layer): the probe drops the
    kernels, and the torch path is probed."""
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path))  # not the cached confirmation of the real kernels
    owner, name = (KernelOps, "norm_linear") if op == "rms_norm+qkv" else (paged, "layers")
    real = getattr(owner, name)

    @functools.wraps(real)  # the probe's float64 check finds the reference by the op's name
    def broken(*args):
        y = real(*args)
        x = args[1] if owner is KernelOps else args[0]
        return y + 1e-3 if x.shape[0] == 311 else y  # a row count of the spread past those probed densely
    monkeypatch.setattr(owner, name, broken)
    llm = LLM(model=tiny_model, enable_prefix_cache=False)
    plan = llm.exactness
    assert plan.mode == "pad"
    assert plan.kernels.startswith(f"off: failed the startup check ({op} differs at [311] rows")
    assert not llm.engine.runner.model.paged and "running the torch path" in caplog.text
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids


@pytest.fixture(scope="module")
def tiny_qwen_window(tmp_path_factory) -> str:
    return family_model(str(tmp_path_factory.mktemp("tiny_qwen_window")), "qwen2-window", seed=4)


@pytest.mark.parametrize("family", ["tiny_model", "tiny_qwen_window"])
def test_a_plain_layer_in_one_op_gives_the_bits_of_its_ops_one_by_one(family, request):
    """The forward's one op for its layers (paged.layers; with local layers between global ones, an op for each run
    of one kind) against the same layers' ops one by one, on batched, chunked and cached requests: the same tokens
    and logits. (A batch with a LoRA adapter runs its ops one by one: test_lora.)"""
    prompts = [list(range(4000, 4300)), list(range(4000, 4200)) + [5, 6], [7, 8, 9]]
    runs = []
    for one_op in (True, False):
        llm = LLM(model=request.getfixturevalue(family), max_batch_tokens=96)
        model = llm.engine.runner.model
        assert model.one_op and model.paged and (family == "tiny_model") == (not model.local_layers)
        llm.engine.runner.model.one_op = one_op
        llm.generate(prompts[:1], GREEDY)
        runs.append(generate_with_logits(llm, prompts, GREEDY))
    (outs, logits), (apart, apart_logits) = runs
    assert outs[1].cached_tokens == 200 and [o.token_ids for o in outs] == [o.token_ids for o in apart]
    assert all(torch.equal(a, b) for a, b in zip(logits, apart_logits))


def _recording(monkeypatch) -> dict[tuple, set[int]]:
    """Every call of KernelOps' methods and of paged's kernel ops from now on: (op, its arguments but the rows'
    own tensor, each as what it is: a weight by its shape, a tensor, None, a window) -> its calls' row counts."""
    calls: dict[tuple, set[int]] = {}

    def what(v):
        return ("weight", tuple(v.shape)) if isinstance(v, Packed) else "tensor" if isinstance(v, torch.Tensor) else v

    def record(name, fn, variant):
        @functools.wraps(fn)  # the probe's float64 check finds the reference by the op's name
        def recorded(*args, **kwargs):
            key, rows = variant(*args, **kwargs)
            calls.setdefault((name, key), set()).add(rows)
            return fn(*args, **kwargs)
        return recorded

    def method_variant(fn):
        def variant(*args, **kwargs):
            bound = inspect.signature(fn).bind(*args, **kwargs)
            bound.apply_defaults()
            _, x, *rest = bound.arguments.items()
            return tuple((k, what(v)) for k, v in rest), x[1].shape[0]
        return variant
    for name, fn in vars(KernelOps).items():
        if callable(fn) and not name.startswith("_"):
            monkeypatch.setattr(KernelOps, name, record(name, fn, method_variant(fn)))
    monkeypatch.setattr(paged, "rope_store", record("rope_store", paged.rope_store, lambda qkv, *a: ((), len(qkv))))
    monkeypatch.setattr(paged, "attend", record("attend", paged.attend, lambda q, k, v, p, isa, scale=None, sinks=None:
                                                ((("window", p.window), ("sinks", sinks is not None)), len(q))))
    monkeypatch.setattr(paged, "layers", record("layers", paged.layers,
                                                lambda x, Ls, *a: ((("window", a[8].window),), len(x))))
    return calls


@pytest.mark.parametrize("family", ["tiny_model", "tiny_gemma", "tiny_qwen_window", "tiny_moe", "tiny_gpt_oss"])
def test_the_probe_checks_every_call_the_forward_makes_at_every_row_count(family, request, monkeypatch):
    """Whatever the forward calls on our kernels (found by running it, not listed here: a fused GEMM with its norm,
    activation or residual, a GEMM with a bias, a norm, RoPE with the KV store, attention with and without a window
    or sinks, a mixture of experts' router and experts (gpt-oss's clamped SwiGLU), the sampler's logit_stats), the
    startup probe calls too, with the same kinds of
    arguments, at every row count of row_counts(the batch limit) (the LM head's: each up to max_head_rows; the
    sampler's: one row, as it calls)."""
    llm = LLM(model=request.getfixturevalue(family), enable_prefix_cache=False, max_batch_tokens=80, max_num_seqs=4)
    model = llm.engine.runner.model
    assert model.paged
    forward = _recording(monkeypatch)
    llm.generate([list(range(5, 200)), [7] * 30, [9, 8, 7]], GREEDY)
    monkeypatch.undo()
    windows = (0, 128) if family in ("tiny_gemma", "tiny_qwen_window", "tiny_gpt_oss") else (0,)  # global, local
    if family in ("tiny_gemma", "tiny_moe", "tiny_gpt_oss"):  # layers of another form than paged.layers computes
        sinks = family == "tiny_gpt_oss"
        assert {("attend", (("window", w), ("sinks", sinks))) for w in windows} <= set(forward)
    else:  # plain layers: one op a run
        assert {("layers", (("window", w),)) for w in windows} <= set(forward)
        assert not any(op == "attend" for op, _ in forward)
    probed = _recording(monkeypatch)
    plan = _confirm(model, "kernel", 80, 4, "")
    assert plan.mode == "kernel", plan.note
    head = ("weight", tuple(model.lm_head.shape))
    for call in forward:
        rows = {1} if call[0] == "logit_stats" else set(range(1, 5)) if head in dict(call[1]).values() else \
            set(row_counts(80))
        assert call in probed and rows <= probed[call], call


def test_a_probe_cached_for_one_library_is_not_reused_for_another(tiny_model, monkeypatch, tmp_path):
    """The probe's cache is keyed by the built library's bytes: a library rebuilt from the same sources (another
    compiler, other flags) is confirmed again."""
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path))
    model = Llama(load(tiny_model), 512, BUILDS[0])
    first, again = probe(model, "auto", 64, 4), probe(model, "auto", 64, 4)
    assert first.mode == "kernel" and not first.cached and again.cached
    real = kernels.loaded()
    monkeypatch.setattr(kernels, "loaded", lambda: dataclasses.replace(real, sha256="0" * 64))
    assert not probe(model, "auto", 64, 4).cached
