"""The Llama forward pass over the engine's block KV pool (RMSNorm, RoPE, GQA attention, SwiGLU).

A token's result is a function of its own inputs and its keys only, so chunking, batching and cache hits give
bit-identical results. On our kernels (models/rowwise.py KernelOps, models/paged.py) that holds by construction,
and the startup probe confirms it. On torch's, every row-wise op (the GEMMs, RMSNorm, SwiGLU) runs in calls whose
row counts the probe verified on this CPU (models/exactness.py), and attention in calls whose query rows and keys
it verified (models/attention.py).
"""
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from prefixcache.cache.pool import KVPool
from prefixcache.models import attention, moe, paged, quant, rope
from prefixcache.models.attention import Queries
from prefixcache.models.exactness import Exactness, RowOp, in_calls, rows_plan
from prefixcache.models.loader import Weights
from prefixcache.models.lora import Adapter
from prefixcache.models.rowwise import KernelOps, Packed, TorchOps

LINEARS = ("qkv", "o", "gate_up", "down")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slots: list[torch.Tensor]  # [N] flat pool slot each token's K/V is written to, by part of a block (KVPool.place)
    queries: list[list[Queries]]  # each sequence's tokens in the batch, by part of a block: its table of that part
    adapters: list[tuple[Adapter, torch.Tensor]] = field(default_factory=list)  # each LoRA adapter's rows


class Llama:
    def __init__(self, weights: Weights, tile: int, ops: TorchOps | KernelOps, max_len: int = 0):
        """`max_len`: the positions a sequence may reach (the engine's max_model_len; 0: the model's context)."""
        c = self.config = weights.config
        w = weights.tensors  # a quantized weight as the file ships it (Blocks)
        self.tile = tile
        self.ops = ops

        def linear(*names: str):  # weights stacked by rows; the file's pages read for them dropped once laid out
            packed = ops.prepare([w[n] for n in names])
            weights.release()
            return packed
        self.lm_head = linear("model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight")
        # a tied table is kept once: the embedding reads its rows from the LM head's panels
        tied = c.tie_embeddings and isinstance(self.lm_head, Packed)
        self.embed = self.lm_head if tied else w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(c.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            bias = torch.cat([w[a + n + "_proj.bias"] for n in "qkv"]) if c.attention_bias else None
            self.layers.append(dict(
                ln1=w[p + "input_layernorm.weight"], ln2=w[p + "post_attention_layernorm.weight"],
                qkv=linear(*(a + n + "_proj.weight" for n in "qkv")), qkv_bias=bias, o=linear(a + "o_proj.weight"),
                q_norm=w.get(a + "q_norm.weight"), k_norm=w.get(a + "k_norm.weight"), o_bias=w.get(a + "o_proj.bias"),
                sinks=w.get(a + "sinks")))
            if i in c.sparse_layers:
                assert not c.sandwich_norms, "a mixture of experts is Qwen3-MoE's or gpt-oss's block"
                self.layers[-1]["experts"] = moe.load(p + "mlp.", c.experts, linear, w, c.expert_glu, c.topk_softmax)
            else:
                self.layers[-1].update(gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                                       down=linear(p + "mlp.down_proj.weight"))
            if c.sandwich_norms:  # Gemma: the norm before the MLP has its own name; two more after each block
                self.layers[-1].update(ln2=w[p + "pre_feedforward_layernorm.weight"],
                                       post_attn=w[p + "post_attention_layernorm.weight"],
                                       post_ffn=w[p + "post_feedforward_layernorm.weight"])
        positions = max_len or c.max_position
        # by whether a layer is local: True only where local layers have their own base (Gemma 3's)
        self.rope = {False: rope.Table(c.rope, c.head_dim, positions, self.norm.dtype)}
        if c.local_rope:
            self.rope[True] = rope.Table(c.local_rope, c.head_dim, positions, self.norm.dtype)
        self.local_layers = frozenset(c.local_layers)
        self.attn_scale = c.attn_scale or c.head_dim ** -0.5
        self.exact: Exactness = rows_plan("", "until the engine sets the probed plan")
        # every layer of the form paged.layers computes (on our kernels, one op for a run of layers)
        self.one_op = c.activation == "silu" and not (c.qk_norm or c.sandwich_norms or c.sparse_layers or c.biases
                                                      or c.sinks)

    @property
    def paged(self) -> bool:
        """On our kernels: row-wise calls of any size, and paged attention."""
        return isinstance(self.ops, KernelOps)

    @property
    def windows(self) -> dict[bool, int]:
        """The keys a token attends to, by whether its layer is local (0: all); a model without local layers has no
        True."""
        return {False: 0, True: self.config.sliding_window} if self.config.local_layers else {False: 0}

    def gemm_weights(self) -> dict[str, torch.Tensor | Packed]:
        """Every GEMM's weight, by a name for people ("down of layer 3")."""
        named = {f"{name} of layer {i}": w for i, L in enumerate(self.layers) for name, w in _gemms(L).items()}
        return {**named, "lm_head": self.lm_head}

    def drop_shipped(self, names: list[str]) -> None:
        """Read these weights (gemm_weights' names) as fp32 panels from now on: the startup check found their blocks
        as shipped do not give their dequantized values' bits."""
        if "lm_head" in names:
            tied = self.embed is self.lm_head
            self.lm_head = self.ops.dequantized(self.lm_head)
            if tied:  # its rows come from the head's panels: those it now reads
                self.embed = self.lm_head
        for i, L in enumerate(self.layers):
            L.update({name: self.ops.dequantized(L[name]) for name in LINEARS if f"{name} of layer {i}" in names})
            if "experts" in L:
                L["experts"] = L["experts"].map(
                    lambda name, w: self.ops.dequantized(w) if f"{name} of layer {i}" in names else w)

    def use(self, ops: TorchOps | KernelOps) -> None:
        """Run on other ops from now on (the torch path, when the kernels fail their startup check)."""
        self.ops = ops
        self.lm_head = ops.prepare(self.embed if self.config.tie_embeddings else self.lm_head)
        if self.config.tie_embeddings:  # the table as these ops hold it, not the panels of the kernels' LM head
            self.embed = self.lm_head
        for L in self.layers:
            L.update({name: ops.prepare(L[name]) for name in LINEARS if name in L})
            if "experts" in L:
                L["experts"] = L["experts"].map(lambda _, w: ops.prepare(w))

    @torch.inference_mode()
    def forward(self, batch: Batch, pool: KVPool, between: Callable[[], None] | None = None) -> torch.Tensor:
        """Hidden states [N, hidden] after the final norm; writes every token's K/V into the pool. `between` is
        called before each layer: it may run another forward (on other KV slots) before this one goes on."""
        c, eps = self.config, self.config.rms_norm_eps
        # padded once to the plan's row count: every row-wise call below then runs unpadded
        n, pad = len(batch.input_ids), self.exact.padded_rows(len(batch.input_ids)) - len(batch.input_ids)
        ids = F.pad(batch.input_ids, (0, pad))
        x = self.embed.take(ids, self.ops.isa) if isinstance(self.embed, Packed) else quant.embedding(self.embed, ids)
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        positions = F.pad(batch.positions, (0, pad))
        tables = {local: t.rows(positions) for local, t in self.rope.items()}
        tables.setdefault(True, tables[False])  # local layers without a base of their own: the same rows
        windows = self.windows  # a plan per kind of layer and part of a block
        kinds = {i: (i in self.local_layers, pool.place(i)[1]) for i in range(len(self.layers))}
        pool_rows = [pool.place(i)[0] for i in range(len(self.layers))]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self.paged:
            plans = {(local, part): paged.plan(batch.queries[part], n, pool.block_size, windows[local])
                     for local, part in set(kinds.values())}
        else:  # padding attends nothing
            plans = {(local, part): self.attn_plan(batch.queries[part], n + pad, pool.block_size, pool.k.shape[1],
                                                   window=windows[local]) for local, part in set(kinds.values())}
            results = {kind: attention.empty_results(p, n + pad, c.num_heads, c.head_dim, x.dtype)
                       for kind, p in plans.items()}  # a plan's own: a tile one leaves out, the other may write
        glu_linear = self.ops.swiglu_linear if c.activation == "silu" else self.ops.geglu_linear
        glu = self.ops.swiglu if c.activation == "silu" else self.ops.geglu
        # plain layers (no QK-norm, no sandwich norms, SwiGLU) with no adapter in the batch, on our kernels: a run of
        # layers under one plan in one op; else, or when `between` runs before each layer, a layer at a time
        one_op = self.paged and self.one_op and not batch.adapters
        for run in paged.runs(list(kinds.values()), alone=between is not None or not one_op):
            if between:
                with torch.inference_mode(False):  # as outside any forward: it may create requests' own tensors
                    between()
            i, L = run[0], self.layers[run[0]]
            kind = local, part = kinds[i]
            if one_op:
                x = paged.layers(x, [self.layers[j] for j in run], eps, *tables[local], pool.k, pool.v,
                                 [pool_rows[j] for j in run], batch.slots[part], c.num_heads, plans[kind],
                                 self.attn_scale, self.ops.isa)
                continue
            cos, sin = tables[local]
            k_pool, v_pool, slots = pool.k[pool_rows[i]], pool.v[pool_rows[i]], batch.slots[part]
            qkv = self._rows(self.ops.norm_linear, x, L["ln1"], eps, L["qkv"], L["qkv_bias"])
            self._lora(batch, i, "qkv", qkv, lambda rows: self._rows(self.ops.rms_norm, x[rows], L["ln1"], eps))
            if c.qk_norm:
                qkv = self._qk_norm(qkv, L)
            if self.paged:
                q = paged.rope_store(qkv, cos, sin, k_pool, v_pool, slots, c.num_heads, c.num_kv_heads, self.ops.isa)
                o = paged.attend(q, k_pool, v_pool, plans[kind], self.ops.isa, self.attn_scale, L["sinks"])
            else:
                q, k, v = (t.view(-1, h, c.head_dim) for t, h in zip(qkv.split([nq, nkv, nkv], dim=1),
                                                                     (c.num_heads, c.num_kv_heads, c.num_kv_heads)))
                q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
                k_pool.index_copy_(0, slots, k[:n].to(pool.k.dtype))
                v_pool.index_copy_(0, slots, v[:n].to(pool.v.dtype))
                o = attention.attend(q, k_pool, v_pool, plans[kind], *results[kind], self.attn_scale, L["sinks"])
            o = o.view(-1, nq)
            if c.sandwich_norms:  # x + norm(o W), x + norm(MLP(norm(x)))
                y = self._rows(self.ops.linear, o, L["o"], L["o_bias"])
                self._lora(batch, i, "o", y, lambda rows: o[rows])
                x = x + self._rows(self.ops.rms_norm, y, L["post_attn"], eps)
            else:
                x = self._rows(self.ops.linear, o, L["o"], L["o_bias"], residual=x)
                self._lora(batch, i, "o", x, lambda rows: o[rows])
            if "experts" in L:
                h = self._rows(self.ops.rms_norm, x, L["ln2"], eps)
                x = x + moe.forward(self.ops, self._rows, h, L["experts"], c.experts_used, c.norm_topk)
                continue
            gate_up = self._rows(self.ops.norm_linear, x, L["ln2"], eps, L["gate_up"])
            self._lora(batch, i, "gate_up", gate_up, lambda rows: self._rows(self.ops.rms_norm, x[rows], L["ln2"], eps))
            if c.sandwich_norms:
                y = self._rows(glu_linear, gate_up, L["down"])
                self._lora(batch, i, "down", y, lambda rows: self._rows(glu, gate_up[rows]))
                x = x + self._rows(self.ops.rms_norm, y, L["post_ffn"], eps)
            else:
                x = self._rows(glu_linear, gate_up, L["down"], residual=x)
                self._lora(batch, i, "down", x, lambda rows: self._rows(glu, gate_up[rows]))
        return self._rows(self.ops.rms_norm, x, self.norm, eps)[:n]

    def _lora(self, batch: Batch, layer: int, gemm: str, y: torch.Tensor,
              inputs: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Add each adapter's delta of this GEMM to its rows of the GEMM's result y, in place; `inputs(rows)` is
        the GEMM's input on those rows (models/lora.py)."""
        for adapter, rows in batch.adapters:
            if (d := adapter.deltas.get((layer, gemm))) is not None:
                t = self._rows(self.ops.linear, inputs(rows), d.a)
                y[rows] += self._rows(self.ops.linear, t, d.b) * d.scale

    def _qk_norm(self, qkv: torch.Tensor, L: dict) -> torch.Tensor:
        """q and k with each head through its RMSNorm (a head is a row of the norm), v as it was."""
        c, rows = self.config, qkv.shape[0]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=1)
        q = self._rows(self.ops.rms_norm, q.reshape(-1, c.head_dim), L["q_norm"], c.rms_norm_eps)
        k = self._rows(self.ops.rms_norm, k.reshape(-1, c.head_dim), L["k_norm"], c.rms_norm_eps)
        return torch.cat([q.view(rows, nq), k.view(rows, nkv), v], dim=1)

    def attn_plan(self, queries: list[Queries], num_tokens: int, block_size: int, pool_slots: int,
                  exact: Exactness | None = None, window: int = 0) -> attention.AttnPlan:
        """The step's attention calls, under this model's exactness plan (or another, for the probe)."""
        c = self.config
        return attention.plan(queries, num_tokens, self.tile, block_size, pool_slots, exact or self.exact,
                              c.num_kv_heads, c.num_heads // c.num_kv_heads, self.norm.dtype, window)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._rows(self.ops.linear, hidden, self.lm_head)

    def row_ops(self, layer: int | None = None) -> list[RowOp]:
        """What the exactness probe checks: every GEMM shape (on the real weights), RMSNorm (and over a head, with
        QK-norm) and the MLP's activation, of `layer` (None: of the first layer of each kind of MLP, dense or not)."""
        if layer is None:
            return self._of_firsts(self.row_ops)
        c, L, ops = self.config, self.layers[layer], self.ops
        glu = ops.swiglu if c.activation == "silu" else ops.geglu
        mlp = moe.row_ops(ops, L["experts"], c.hidden_size, c.expert_size) if "experts" in L else [
            RowOp("gate_up", ops.linear, (L["gate_up"],), c.hidden_size),
            RowOp("down", ops.linear, (L["down"],), c.intermediate_size),
            RowOp(glu.__name__, glu, (), 2 * c.intermediate_size)]
        return [RowOp("qkv", ops.linear, (L["qkv"], L["qkv_bias"]), c.hidden_size),
                RowOp("o", ops.linear, (L["o"], L["o_bias"]), c.num_heads * c.head_dim), *mlp[:-1],
                RowOp("lm_head", ops.linear, (self.lm_head,), c.hidden_size, head=True),
                RowOp("rms_norm", ops.rms_norm, (L["ln1"], c.rms_norm_eps), c.hidden_size), mlp[-1]] + (
                [RowOp("qk_norm", ops.rms_norm, (L["q_norm"], c.rms_norm_eps), c.head_dim)] if c.qk_norm else [])

    def kernel_row_ops(self, layer: int | None = None) -> list[RowOp]:
        """The row-wise calls the forward makes on our kernels, each as it makes it (a norm or the MLP's activation
        fused before a GEMM, a residual added after one): what the probe confirms there at every row count. On the
        torch path such a call is row_ops() in turn, which the probe checks one by one."""
        if layer is None:
            return self._of_firsts(self.kernel_row_ops)
        c, L, ops, eps = self.config, self.layers[layer], self.ops, self.config.rms_norm_eps
        glu_linear = ops.swiglu_linear if c.activation == "silu" else ops.geglu_linear
        glu = glu_linear.__name__.removesuffix("_linear")
        residual, plus = (0, "") if c.sandwich_norms else (c.hidden_size, "+residual")
        mlp = moe.kernel_row_ops(ops, L["experts"], c.hidden_size, c.expert_size) if "experts" in L else [
            RowOp("rms_norm+gate_up", ops.norm_linear, (L["ln2"], eps, L["gate_up"]), c.hidden_size),
            RowOp(f"{glu}+down{plus}", glu_linear, (L["down"],), 2 * c.intermediate_size, residual=residual)]
        return [RowOp("rms_norm+qkv", ops.norm_linear, (L["ln1"], eps, L["qkv"], L["qkv_bias"]), c.hidden_size),
                RowOp("o" + plus, ops.linear, (L["o"], L["o_bias"]), c.num_heads * c.head_dim, residual=residual), *mlp,
                RowOp("lm_head", ops.linear, (self.lm_head,), c.hidden_size, head=True),
                RowOp("rms_norm", ops.rms_norm, (self.norm, eps), c.hidden_size)] + (
                [RowOp("qk_norm", ops.rms_norm, (L["q_norm"], eps), c.head_dim)] if c.qk_norm else [])

    def _of_firsts(self, layer_ops: Callable[[int], list[RowOp]]) -> list[RowOp]:
        """The ops of the first layer of each kind of MLP the model has (dense, a mixture of experts), one of a name."""
        sparse = ["experts" in L for L in self.layers]
        named: dict[str, RowOp] = {}
        for op in (op for i in sorted({sparse.index(kind) for kind in set(sparse)}) for op in layer_ops(i)):
            named.setdefault(op.name, op)
        return list(named.values())

    def _rows(self, fn, x: torch.Tensor, *args, residual: torch.Tensor | None = None) -> torch.Tensor:
        """A row-wise fn(x, *args) (+ residual), in calls of the row counts the exactness plan verified."""
        return in_calls(fn, x, self.exact.call_rows(x.shape[0]), *args, residual=residual)


def _gemms(L: dict) -> dict[str, torch.Tensor | Packed]:
    """A layer's GEMM weights, by a name for people within the layer ("down", "down of expert 3")."""
    return {name: L[name] for name in LINEARS if name in L} | (L["experts"].gemms() if "experts" in L else {})
