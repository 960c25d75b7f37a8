"""Every kernel op refuses (a RuntimeError naming the problem) an index, shape, dtype, device or layout it cannot
follow safely: never a crash, a read of another request's KV or a write out of bounds. One valid call per op, then
each case breaks one thing of it, in every build this CPU runs."""
import pytest
import torch

from prefixcache import kernels
from prefixcache.models import paged
from prefixcache.models.attention import Queries
from prefixcache.models.rowwise import KernelOps

AVAILABLE = kernels.choose("auto").isa
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"kernels: {kernels.choose('auto').status}")
ISAS = [KernelOps(isa).isa for isa in kernels.ISAS if isa in kernels.supported()]
ops = torch.ops.prefixcache
META = torch.device("meta")


def _attend_args(isa: int) -> dict:
    """A step of 4 heads over 2 kv heads of 16 dims, a pool of 8 blocks of 16 slots: 5 prompt tokens (pos 20..24,
    table [3, 5], padded to the width of the other) and one decode token (pos 40, table [1, 2, 6])."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(128, 2, 16, generator=g), torch.randn(128, 2, 16, generator=g)
    groups = [Queries(0, list(range(20, 25)), 25, [3, 5]), Queries(5, [40], 41, [1, 2, 6])]
    p = paged.plan(groups, 6, 16)
    return dict(q=torch.randn(6, 4, 16, generator=g), k=k, v=v, pos=p.pos, tables=p.tables, row_seq=p.row_seq,
                order=p.order, items=p.items, block_size=16, scale=0.25, isa=isa, window=0)


def _set(name, index, value):
    def change(a):
        a[name][index] = value
    return change


def _replace(name, make):
    def change(a):
        a[name] = make(a[name])
    return change


def _head_size_8(a):
    a["q"], a["k"], a["v"] = a["q"][..., :8].contiguous(), a["k"][..., :8].contiguous(), a["v"][..., :8].contiguous()


ATTEND = {
    "table entry past the pool": (_set("tables", (1, 2), 8), "table 1 entry 2 is block 8, outside the pool's 8 blocks"),
    "negative table entry": (_set("tables", (0, 1), -5), "table 0 entry 1 is block -5"),
    "pos past its sequence's blocks (a padded entry)": (_set("pos", 4, 32), "table 0 entry 2 is block -1"),
    "pos beyond the table": (_set("pos", 0, 48), "token 0's pos 48 is outside its table's 48 keys"),
    "negative pos": (_set("pos", 0, -1), "token 0's pos -1"),
    "row_seq past the tables": (_set("row_seq", 0, 2), "token 0's row_seq 2 is outside the 2 tables"),
    "negative row_seq": (_set("row_seq", 5, -1), "token 5's row_seq -1"),
    "order entry past the tokens": (_set("order", 0, 6), "order entry 6 is outside the 6 tokens"),
    "negative order entry": (_set("order", 3, -1), "order entry -1"),
    "a token twice in order": (_set("order", 1, 0), "token 0 appears twice in order"),
    "items decreasing": (_replace("items", lambda t: torch.tensor([0, 5, 3, 6], dtype=torch.int32)),
                         "items must not decrease"),
    "items past the end of order": (_set("items", -1, 7), "items must run from 0 to the 6 tokens"),
    "items not from 0": (_set("items", 0, 1), "items must run from 0"),
    "no items": (_replace("items", lambda t: t[:0]), "items must be \\[items \\+ 1\\]"),
    "block_size 0": (_replace("block_size", lambda b: 0), "block_size must be a positive multiple of 16, got 0"),
    "block_size 8": (_replace("block_size", lambda b: 8), "block_size must be a positive multiple of 16, got 8"),
    "head size 8": (_head_size_8, "head size must be a positive multiple of 16, got 8"),
    "no kv heads": (lambda a: a.update(k=a["k"][:, :0], v=a["v"][:, :0]), "kv heads \\(dividing heads\\)"),
    "q float64": (_replace("q", lambda t: t.double()), "q must be Float, got Double"),
    "pos int32": (_replace("pos", lambda t: t.int()), "pos must be Long, got Int"),
    "tables int64": (_replace("tables", lambda t: t.long()), "tables must be Int, got Long"),
    "q not contiguous": (_replace("q", lambda t: torch.cat([t, t], -1)[..., ::2]), "q must be contiguous"),
    "tables not contiguous": (_replace("tables", lambda t: t.t().contiguous().t()), "tables must be contiguous"),
    "q not on the CPU": (_replace("q", lambda t: t.to(META)), "q must be on the CPU"),
    "pos one short": (_replace("pos", lambda t: t[:-1]), "pos must hold one entry per token of q \\(6\\)"),
    "row_seq one short": (_replace("row_seq", lambda t: t[:-1]), "row_seq must hold one entry per token"),
    "order one short": (_replace("order", lambda t: t[:-1]), "order must hold one entry per token"),
    "q one token more": (_replace("q", lambda t: torch.cat([t, t[:1]])), "pos must hold one entry per token of q \\(7"),
}


@pytest.mark.parametrize("isa", ISAS)
def test_attend_reads_a_valid_plan_with_padded_tables(isa):
    """The base of the cases below runs (the prompt's table is padded with -1 past its blocks, which it never
    reads), with one decode token alone (fewer units than threads: spans apart) and with every token."""
    a = _attend_args(isa)
    assert a["tables"][0, 2] == -1
    out = ops.attend(**a)
    one = ops.attend(**{**a, "q": a["q"][5:], "pos": a["pos"][5:], "row_seq": a["row_seq"][5:],
                        "order": torch.zeros(1, dtype=torch.int32), "items": torch.tensor([0, 1], dtype=torch.int32)})
    assert torch.equal(out[5:], one)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", ATTEND)
def test_attend_refuses(case, isa):
    a = _attend_args(isa)
    change, message = ATTEND[case]
    change(a)
    with pytest.raises(RuntimeError, match=message):
        ops.attend(**a)


def _rope_args(isa: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(qkv=torch.randn(5, (4 + 2 * 2) * 16, generator=g), cos=torch.randn(5, 16, generator=g),
                sin=torch.randn(5, 16, generator=g), k_pool=torch.zeros(64, 2, 16), v_pool=torch.zeros(64, 2, 16),
                slots=torch.tensor([3, 40, 63, 0]), heads=4, kv_heads=2, isa=isa)


ROPE_STORE = {
    "slot past the pool": (_set("slots", 1, 64), "slot 64 of row 1 is outside the pool's 64 slots"),
    "negative slot": (_set("slots", 2, -1), "slot -1 of row 2"),
    "more slots than rows": (_replace("slots", lambda t: torch.arange(6)), "slots must be 1-D, one per stored row"),
    "slots int32": (_replace("slots", lambda t: t.int()), "slots must be Long, got Int"),
    "slots not on the CPU": (_replace("slots", lambda t: t.to(META)), "slots must be on the CPU"),
    "head size 8": (lambda a: a.update(qkv=a["qkv"][:, :64].contiguous(), cos=a["cos"][:, :8].contiguous(),
                                       sin=a["sin"][:, :8].contiguous(), k_pool=torch.zeros(64, 2, 8),
                                       v_pool=torch.zeros(64, 2, 8)),
                    "head size must be a positive multiple of 16, got 8"),
    "a 2-D pool": (_replace("k_pool", lambda t: t.view(64, 32)), "k_pool, v_pool must be \\[slots"),
    "negative heads": (lambda a: a.update(heads=-1, qkv=a["qkv"][:, :48].contiguous()), "-1 heads"),
    "qkv for other heads": (_replace("heads", lambda h: 3), "qkv must be \\[rows, 112\\]"),
    "cos for other rows": (_replace("cos", lambda t: t[:4]), "cos, sin must be \\[rows, d\\]"),
    "qkv float64": (_replace("qkv", lambda t: t.double()), "qkv must be Float, got Double"),
    "qkv not contiguous": (_replace("qkv", lambda t: torch.cat([t, t], -1)[:, ::2]), "qkv must be contiguous"),
    "qkv not on the CPU": (_replace("qkv", lambda t: t.to(META)), "qkv must be on the CPU"),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", ROPE_STORE)
def test_rope_store_refuses(case, isa):
    a = _rope_args(isa)
    ops.rope_store(**a)
    change, message = ROPE_STORE[case]
    change(a)
    with pytest.raises(RuntimeError, match=message):
        ops.rope_store(**a)


ROWWISE = {  # (op, its input, the problem, the message)
    "rms_norm x 1-D": ("rms_norm", torch.randn(32), "x \\[rows, k\\] and weight \\[k\\] expected"),
    "rms_norm x float64": ("rms_norm", torch.randn(3, 32).double(), "x must be Float, got Double"),
    "rms_norm x not contiguous": ("rms_norm", torch.randn(32, 3).t(), "x must be contiguous"),
    "rms_norm x not on the CPU": ("rms_norm", torch.randn(3, 32, device=META), "x must be on the CPU"),
    "silu_mul odd width": ("silu_mul", torch.randn(3, 31), "\\[rows, 2 \\* inter\\] expected, got \\[3, 31\\]"),
    "gelu_mul float64": ("gelu_mul", torch.randn(3, 32).double(), "gate_up must be Float, got Double"),
    "silu_mul not contiguous": ("silu_mul", torch.randn(32, 3).t(), "gate_up must be contiguous"),
    "gelu_mul not on the CPU": ("gelu_mul", torch.randn(3, 32, device=META), "gate_up must be on the CPU"),
    "logit_stats 1-D": ("logit_stats", torch.randn(32), "logits must be \\[rows, vocab\\], got \\[32\\]"),
    "logit_stats no vocabulary": ("logit_stats", torch.randn(3, 0), "logits must be \\[rows, vocab\\], got \\[3, 0\\]"),
    "logit_stats float64": ("logit_stats", torch.randn(3, 32).double(), "logits must be Float, got Double"),
    "logit_stats not contiguous": ("logit_stats", torch.randn(32, 3).t(), "logits must be contiguous"),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", ROWWISE)
def test_the_rowwise_ops_refuse(case, isa):
    op, x, message = ROWWISE[case]
    with pytest.raises(RuntimeError, match=message):
        getattr(ops, op)(x, isa) if op != "rms_norm" else ops.rms_norm(x, torch.ones(32), 1e-5, isa)


def _f32_part(w: torch.Tensor) -> torch.Tensor:
    return w.view(-1, 16, w.shape[1]).transpose(1, 2).contiguous()  # [rows / 16, k, 16] panels


LINEAR = {  # the parts and kinds given for a weight of 32 rows, k = 32
    "F32 part as uint8": (lambda w: [w.view(torch.uint8)], [0], "linear: a F32 part must be Float, got Byte"),
    "Q8_0 part as float": (lambda w: [w], [7], "linear: a Q8_0 part must be Byte, got Float"),
    "part not contiguous": (lambda w: [torch.cat([w, w], -1)[..., ::2]], [0], "F32 part must be contiguous"),
    "part not on the CPU": (lambda w: [w.to(META)], [0], "F32 part must be on the CPU"),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", LINEAR)
def test_linear_refuses(case, isa):
    x, w = torch.randn(3, 32), _f32_part(torch.randn(32, 32))
    assert torch.allclose(ops.linear(x, [w], [0], [32], None, isa), x @ w.transpose(1, 2).reshape(32, 32).T, atol=1e-5)
    parts, kinds, message = LINEAR[case]
    with pytest.raises(RuntimeError, match=message):
        ops.linear(x, parts(w), kinds, [32], None, isa)


def _first_parts(n: int):
    def change(a):
        a["parts"], a["kinds"], a["rows"] = a["parts"][:n], a["kinds"][:n], a["rows"][:n]
    return change


def _layer_args(isa: int) -> dict:
    """Two plain layers (hidden 32, 4 heads over 2 kv heads of 16 dims, MLP 32) on _attend_args' step, fp32 weights,
    their keys and values in rows 1 and 0 of a pool of two."""
    a, g = _attend_args(isa), torch.Generator().manual_seed(1)
    parts = [_f32_part(torch.randn(n, k, generator=g)) for _ in range(2)
             for n, k in ((128, 32), (32, 64), (64, 32), (32, 32))]
    return dict(x=torch.randn(6, 32, generator=g), ln1=[torch.ones(32)] * 2, ln2=[torch.ones(32)] * 2, eps=1e-5,
                parts=parts, kinds=[0] * 8, rows=[128, 32, 64, 32] * 2, counts=[1] * 8, qkv_bias=[None] * 2,
                cos=torch.ones(6, 16), sin=torch.zeros(6, 16), k=torch.stack([a["k"]] * 2),
                v=torch.stack([a["v"]] * 2), pool_rows=[1, 0], slots=torch.tensor([84, 85, 86, 87, 88, 104]), heads=4,
                **{n: a[n] for n in ("pos", "tables", "row_seq", "order", "items", "block_size", "scale")}, window=0,
                isa=isa)


LAYERS = {
    "counts not adding up to the parts": (_replace("counts", lambda c: [1] * 7 + [2]), "counts must add up"),
    "counts past the parts": (_first_parts(7), "counts must add up to the parts"),
    "a kind missing": (_replace("kinds", lambda k: k[:7]), "one kind and one row count per part"),
    "a weight of no parts": (_replace("counts", lambda c: [0, 2] + c[2:]), "each weight has at least one part"),
    "fewer than four weights a layer": (_replace("counts", lambda c: [2, 1, 1, 2, 1, 1, 1]), "four weights' part"),
    "a layer's norm missing": (_replace("ln2", lambda n: n[:1]), "per layer two norms"),
    "pool row past the pool": (_set("pool_rows", 1, 2), "layer 1's pool row 2 is outside k's 2 rows"),
    "a pool of three dimensions": (_replace("k", lambda k: k[0]), "k and v must be \\[rows, slots, kv heads, d\\]"),
    "table entry past the pool": (_set("tables", (1, 2), 8), "table 1 entry 2 is block 8, outside the pool's 8"),
    "slot past the pool": (_set("slots", 5, 128), "slot 128 of row 5 is outside the pool's 128 slots"),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", LAYERS)
def test_the_layers_op_refuses(case, isa):
    assert ops.layers(**_layer_args(isa)).shape == (6, 32)
    change, message = LAYERS[case]
    args = _layer_args(isa)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.layers(**args)
