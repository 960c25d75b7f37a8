// torch ops prefixcache::{supported, kinds, quant_rows, linear, rows, rms_norm, silu_mul, gelu_mul, clamp_glu,
// logit_stats, rope_store, attend, layers}:
// argument checks, threads, and the ISA build each call names. Threads split panels, rows or attention units, never a
// reduction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

struct Isa {
  const char* name;
  decltype(&avx2::rope_store) rope_store;
  decltype(&avx2::gemm) gemm;
  decltype(&avx2::gemm_scratch) gemm_scratch;
  decltype(&avx2::panel) panel;
  decltype(&avx2::quant_rows) quant_rows;
  decltype(&avx2::rms_norm) rms_norm;
  decltype(&avx2::silu_mul) silu_mul;
  decltype(&avx2::gelu_mul) gelu_mul;
  decltype(&avx2::clamp_glu) clamp_glu;
  decltype(&avx2::logit_stats) logit_stats;
  decltype(&avx2::attend) attend;
  decltype(&avx2::attend_spans) attend_spans;
  decltype(&avx2::attend_merge) attend_merge;
};
const Isa AVX512{"avx512", avx512::rope_store, avx512::gemm, avx512::gemm_scratch, avx512::panel,
                 avx512::quant_rows, avx512::rms_norm, avx512::silu_mul, avx512::gelu_mul, avx512::clamp_glu,
                 avx512::logit_stats,
                 avx512::attend, avx512::attend_spans, avx512::attend_merge};
const Isa AVX2{"avx2", avx2::rope_store, avx2::gemm, avx2::gemm_scratch, avx2::panel, avx2::quant_rows,
               avx2::rms_norm, avx2::silu_mul, avx2::gelu_mul, avx2::clamp_glu, avx2::logit_stats, avx2::attend,
               avx2::attend_spans, avx2::attend_merge};
bool supports(const char* name) {
  __builtin_cpu_init();
  if (std::string(name) == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// the builds this CPU can run, best first; an op's isa argument indexes {avx512, avx2}
std::vector<std::string> supported() {
  std::vector<std::string> names;
  for (const Isa* isa : {&AVX512, &AVX2})
    if (supports(isa->name)) names.push_back(isa->name);
  return names;
}

const Isa& pick(int64_t isa) {
  TORCH_CHECK(isa == 0 || isa == 1, "prefixcache kernels: isa 0 (avx512) or 1 (avx2)");
  const Isa& chosen = isa == 0 ? AVX512 : AVX2;
  TORCH_CHECK(supports(chosen.name), "prefixcache kernels: this CPU cannot run the ", chosen.name, " build");
  return chosen;
}

// a tensor the kernels read through its raw pointer: in this process's memory, of the type and layout they assume
void check_tensor(const at::Tensor& t, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_f32(const at::Tensor& t, const char* name) { check_tensor(t, at::kFloat, name); }

// one index per token, as a 1-D tensor
void check_per_token(const at::Tensor& t, at::ScalarType type, const char* name, int64_t tokens) {
  check_tensor(t, type, name);
  TORCH_CHECK(t.dim() == 1 && t.numel() == tokens, "attend: ", name, " must hold one entry per token of q (", tokens,
              "), got ", t.sizes());
}

void check_head_size(int64_t d, const char* op) {
  TORCH_CHECK(d > 0 && d % 16 == 0, op, ": head size must be a positive multiple of 16, got ", d);
}

void check_rms_norm(const at::Tensor& x, const at::Tensor& w) {
  check_f32(x, "x");
  check_f32(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.numel() == x.size(1), "rms_norm: x [rows, k] and weight [k] "
              "expected, got ", x.sizes(), " and ", w.sizes());
}

void check_gated(const at::Tensor& gate_up) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul, gelu_mul, clamp_glu: [rows, 2 * inter] expected, got ",
              gate_up.sizes());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t isa) {
  check_rms_norm(x, w);
  const Isa& k = pick(isa);
  at::Tensor y = at::empty_like(x);
  const int64_t cols = x.size(1);
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    k.rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), cols, (float)eps, r0, r1);
  });
  return y;
}

// gate_up [m, 2 i] -> act(gate) * up [m, i]
template <typename Act>
at::Tensor gated(const at::Tensor& gate_up, Act act) {
  check_gated(gate_up);
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor y = at::empty({gate_up.size(0), inter}, gate_up.options());
  at::parallel_for(0, gate_up.size(0), 16, [&](int64_t r0, int64_t r1) {
    act(gate_up.data_ptr<float>(), y.data_ptr<float>(), inter, r0, r1);
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t isa) { return gated(gate_up, pick(isa).silu_mul); }

at::Tensor gelu_mul(const at::Tensor& gate_up, int64_t isa) { return gated(gate_up, pick(isa).gelu_mul); }

at::Tensor clamp_glu(const at::Tensor& gate_up, double alpha, double limit, int64_t isa) {
  const Isa& k = pick(isa);
  return gated(gate_up, [&](const float* gu, float* y, int64_t inter, int64_t r0, int64_t r1) {
    k.clamp_glu(gu, y, inter, (float)alpha, (float)limit, r0, r1);
  });
}

// logits [rows, vocab] -> (stats [rows, 2]: each row's max and log(sum(e^(x - max))), argmax [rows]: the first index
// of its max), a row a thread (kernels.inc logit_stats says what a row of NaN or of -inf gives)
std::tuple<at::Tensor, at::Tensor> logit_stats(const at::Tensor& logits, int64_t isa) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logit_stats: logits must be [rows, vocab], got ",
              logits.sizes());
  const Isa& kern = pick(isa);
  const int64_t rows = logits.size(0), v = logits.size(1);
  at::Tensor stats = at::empty({rows, 2}, at::kFloat), argmax = at::empty({rows}, at::kLong);
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    kern.logit_stats(logits.data_ptr<float>(), v, stats.data_ptr<float>(), argmax.data_ptr<int64_t>(), r0, r1);
  });
  return {stats, argmax};
}

// the weight formats (kernels.h KINDS), by the index the linear op takes
std::vector<std::string> kinds() {
  std::vector<std::string> names;
  for (const Kind& kind : KINDS) names.push_back(kind.name);
  return names;
}

// rows from which a call dequantizes into scratch rather than in registers (the same bits either way)
int64_t quant_rows(int64_t isa) { return pick(isa).quant_rows(); }

// x' @ w.T (+ bias) (+ residual [m, n]) where x' is x, rms_norm(x, norm) or (swiglu) silu_mul(x): one op with the bits
// of the separate ones, each result rounded as they round it (the residual added after the bias, as torch adds it
// to the op's result). w is stacked by rows from parts, each rows[i] rows in the format kinds[i] (kernels.h KINDS):
// fp32 panels [ceil(rows / 16), k, 16], or a GGUF type's blocks as models/layouts.py lays them out, read as shipped
// and dequantized to the fp32 weights' values, bit for bit. Every part's rows but the last are a multiple of 16.
at::Tensor linear(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kind_ids, at::IntArrayRef rows,
                  const c10::optional<at::Tensor>& bias, int64_t isa, const c10::optional<at::Tensor>& norm, double eps,
                  bool swiglu, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(!(norm.has_value() && swiglu), "linear: rms_norm or swiglu, not both");
  TORCH_CHECK(!parts.empty() && kind_ids.size() == parts.size() && rows.size() == parts.size(),
              "linear: one kind and one row count per part");
  if (norm.has_value()) check_rms_norm(x, *norm);
  if (swiglu) check_gated(x);
  // the input through its RMSNorm or SwiGLU: computed below, in the GEMM's own threads
  const at::Tensor in = norm.has_value() ? at::empty_like(x) : swiglu ? at::empty({x.size(0), x.size(1) / 2},
                                                                                  x.options()) : x;
  check_f32(in, "x");
  TORCH_CHECK(in.dim() == 2, "linear: x must be [rows, k]");
  const int64_t m = in.size(0), kk = in.size(1);
  std::vector<int64_t> first_panel{0};  // each part's first panel of the stacked weight, then the total
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); i++) {
    const int64_t kind = kind_ids[i], r = rows[i];
    TORCH_CHECK(kind >= 0 && kind < NUM_KINDS, "linear: unknown weight kind ", kind);
    TORCH_CHECK(r > 0 && (r % 16 == 0 || i + 1 == parts.size()), "linear: a part's rows must be a multiple of 16 "
                "but the last's");
    const at::Tensor& w = parts[i];
    const Kind& f = KINDS[kind];
    check_tensor(w, kind == 0 ? at::kFloat : at::kByte, (std::string("linear: a ") + f.name + " part").c_str());
    TORCH_CHECK(w.dim() == 3 && w.size(0) == (r + 15) / 16 && kk % f.k == 0 && w.size(1) == kk / f.k &&
                    w.size(2) * w.element_size() == f.bytes,
                "linear: a ", f.name, " part must be [ceil(rows / 16), k / ", f.k, ", ", f.bytes, " bytes] for k = ", kk,
                ", got ", w.sizes());
    n += r;
    first_panel.push_back(first_panel.back() + w.size(0));
  }
  const float *b = nullptr, *res = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "linear: bias size");
    b = bias->data_ptr<float>();
  }
  if (residual.has_value()) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == m && residual->size(1) == n, "linear: residual shape");
    res = residual->data_ptr<float>();
  }
  const Isa& k = pick(isa);
  at::Tensor y = at::empty({m, n}, in.options());
  const float* xp = in.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  int64_t scratch = 0;
  for (size_t i = 0; i < parts.size(); i++) scratch = std::max(scratch, k.gemm_scratch((int)kind_ids[i], m));
  // One parallel region: threads split the rows of the RMSNorm or SwiGLU, wait for each other, then split the
  // stacked weight's panels (each part computes its columns of y over its share of them). A region's start wakes the
  // threads if they slept (after a brief spin: prefixcache/__init__.py), tens of us each on a KVM guest, so a fused
  // call runs one region, not two. Threads split rows and panels, never a sum: the bits are the separate ops'.
  const int64_t panels = first_panel.back();
  const int threads = omp_in_parallel() ? 1 : (int)std::min<int64_t>(at::get_num_threads(), panels);
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r_step = (m + nt - 1) / nt, r0 = std::min(m, t * r_step), r1 = std::min(m, r0 + r_step);
    if (norm.has_value())
      k.rms_norm(x.data_ptr<float>(), norm->data_ptr<float>(), in.data_ptr<float>(), kk, (float)eps, r0, r1);
    else if (swiglu)
      k.silu_mul(x.data_ptr<float>(), in.data_ptr<float>(), kk, r0, r1);
#pragma omp barrier
    const int64_t p_step = (panels + nt - 1) / nt, p0 = std::min(panels, t * p_step),
                  p1 = std::min(panels, p0 + p_step);
    std::vector<float> buffer(scratch);
    for (size_t i = 0; i < parts.size() && p0 < p1; i++) {
      const int64_t lo = std::max(p0, first_panel[i]), hi = std::min(p1, first_panel[i + 1]);
      if (lo >= hi) continue;
      const int64_t col = first_panel[i] * 16;
      GemmArgs a{xp, m, kk, parts[i].data_ptr(), rows[i], b ? b + col : nullptr, res ? res + col : nullptr,
                 yp + col, n};
      k.gemm((int)kind_ids[i], a, buffer.data(), lo - first_panel[i], hi - first_panel[i]);
    }
  }
  return y;
}

// rows `ids` of a weight of n rows in the format `kind` (one part, as linear takes it) as fp32 [len(ids), k]: the
// values the GEMM reads, bit for bit (a tied embedding's rows, read from the LM head's panels)
at::Tensor rows(const at::Tensor& w, int64_t kind, int64_t n, const at::Tensor& ids, int64_t isa) {
  TORCH_CHECK(kind >= 0 && kind < NUM_KINDS, "rows: unknown weight kind ", kind);
  const Kind& f = KINDS[kind];
  check_tensor(w, kind == 0 ? at::kFloat : at::kByte, "rows: the weight");
  TORCH_CHECK(w.dim() == 3 && n > 0 && w.size(0) == (n + 15) / 16 && w.size(2) * w.element_size() == f.bytes,
              "rows: a ", f.name, " weight of ", n, " rows must be [ceil(rows / 16), k / ", f.k, ", ", f.bytes,
              " bytes], got ", w.sizes());
  check_tensor(ids, at::kLong, "ids");
  TORCH_CHECK(ids.dim() == 1, "rows: ids must be 1-D, got ", ids.sizes());
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); i++)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "rows: id ", ip[i], " is outside the weight's ", n, " rows");
  const Isa& kern = pick(isa);
  const int64_t k = w.size(1) * f.k;
  at::Tensor out = at::empty({ids.numel(), k}, at::kFloat);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, ids.numel(), 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> panel(k * 16);
    for (int64_t i = i0; i < i1; i++) {
      kern.panel((int)kind, w.data_ptr(), k, ip[i] / 16, panel.data());
      for (int64_t c = 0; c < k; c++) op[i * k + c] = panel[c * 16 + ip[i] % 16];
    }
  });
  return out;
}

// qkv [rows, (heads + 2 kv_heads) * d] -> its queries after RoPE [rows, heads, d]; the keys (after RoPE) and values
// of the first slots.numel() rows written at those slots of one layer's pool k, v [slots, kv heads, d], in the
// layout attend reads (models/paged.py store)
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool,
                      at::Tensor v_pool, const at::Tensor& slots, int64_t heads, int64_t kv_heads, int64_t isa) {
  check_f32(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  check_f32(k_pool, "k_pool");
  check_f32(v_pool, "v_pool");
  check_tensor(slots, at::kLong, "slots");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() && k_pool.size(0) % 16 == 0 &&
                  heads > 0 && kv_heads > 0 && k_pool.size(1) == kv_heads,
              "rope_store: k_pool, v_pool must be [slots (a multiple of 16), kv_heads, d], got ", k_pool.sizes(), ", ",
              v_pool.sizes(), " for ", heads, " heads, ", kv_heads, " kv heads");
  const int64_t d = k_pool.size(2);
  check_head_size(d, "rope_store");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * d, "rope_store: qkv must be [rows, ",
              (heads + 2 * kv_heads) * d, "], got ", qkv.sizes());
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && cos.size(1) == d && cos.sizes() == sin.sizes(),
              "rope_store: cos, sin must be [rows, d] = [", rows, ", ", d, "], got ", cos.sizes(), ", ", sin.sizes());
  TORCH_CHECK(slots.dim() == 1 && slots.numel() <= rows, "rope_store: slots must be 1-D, one per stored row, got ",
              slots.sizes(), " for ", rows, " rows");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); i++)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < k_pool.size(0), "rope_store: slot ", sp[i], " of row ", i,
                " is outside the pool's ", k_pool.size(0), " slots");
  const Isa& kern = pick(isa);
  at::Tensor q = at::empty({rows, heads, d}, qkv.options());
  RopeArgs a{qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
             k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), sp, slots.numel(), heads, kv_heads, d};
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> key(d);
    kern.rope_store(a, key.data(), r0, r1);
  });
  return q;
}

// fn(i, scratch) for i = 0..units - 1, handed out one at a time to the threads, each with scratch of its own
template <class Fn>
void each_unit(int64_t units, int64_t scratch_floats, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), units), 1, [&](int64_t, int64_t) {
    const std::unique_ptr<float[]> scratch(new float[scratch_floats]);  // not zeroed: each unit resets what it uses
    for (int64_t i = next++; i < units; i = next++) fn(i, scratch.get());
  });
}

constexpr int64_t SERIAL_KEY_DIMS = 2048 * 64;  // attention over at most this many keys x head size: one thread

// Every index attend follows, checked once before any thread runs: order lists each token once, items cut order
// into runs of at most ITEM_TOKENS, a token's row_seq names a table and its pos lies inside that table, and each
// table entry a token reads (those up to its pos) is a block of the pool. Entries past every token's pos are not
// read, and not checked: models/paged.py pads tables with -1, so a pos past its sequence's blocks is refused.
void check_plan(const AttnArgs& a, int64_t tokens, int64_t seqs, int64_t num_items, int64_t pool_blocks) {
  std::vector<char> seen(tokens);
  for (int64_t i = 0; i < tokens; i++) {
    const int32_t t = a.order[i];
    TORCH_CHECK(t >= 0 && t < tokens, "attend: order entry ", t, " is outside the ", tokens, " tokens");
    TORCH_CHECK(!seen[t], "attend: token ", t, " appears twice in order");
    seen[t] = 1;
  }
  TORCH_CHECK(a.items[0] == 0 && a.items[num_items] == tokens,
              "attend: items must run from 0 to the ", tokens, " tokens of order");
  for (int64_t i = 0; i < num_items; i++)
    TORCH_CHECK(a.items[i + 1] >= a.items[i] && a.items[i + 1] - a.items[i] <= ITEM_TOKENS, "attend: items must not ",
                "decrease, and an item holds at most ", ITEM_TOKENS, " tokens; item ", i, " holds ",
                a.items[i + 1] - a.items[i]);
  std::vector<int64_t> reach(seqs);  // each table's entries that tokens read
  for (int64_t t = 0; t < tokens; t++) {
    const int64_t p = a.pos[t], s = a.row_seq[t];
    TORCH_CHECK(s >= 0 && s < seqs, "attend: token ", t, "'s row_seq ", s, " is outside the ", seqs, " tables");
    TORCH_CHECK(p >= 0 && p / a.block_size < a.max_blocks, "attend: token ", t, "'s pos ", p,
                " is outside its table's ", a.max_blocks * a.block_size, " keys");
    reach[s] = std::max(reach[s], p / a.block_size + 1);
  }
  for (int64_t s = 0; s < seqs; s++)
    for (int64_t j = 0; j < reach[s]; j++) {
      const int32_t block = a.tables[s * a.max_blocks + j];
      TORCH_CHECK(block >= 0 && block < pool_blocks, "attend: table ", s, " entry ", j, " is block ", block,
                  ", outside the pool's ", pool_blocks, " blocks");
    }
}

// Paged causal attention for every token of the step in one call: q [tokens, heads, d] over a layer's pool
// k, v [slots, kv heads, d]; token t attends keys 0..pos[t] of sequence row_seq[t], found through tables.
// Items (offsets into order) group tokens that read the same blocks; they change loads, never a token's bits.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                  const at::Tensor& tables, const at::Tensor& row_seq, const at::Tensor& order,
                  const at::Tensor& items, int64_t block_size, double scale, int64_t isa, int64_t window,
                  const c10::optional<at::Tensor>& sinks) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && q.size(2) == k.size(2) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              "attend: q [tokens, heads, d] and k, v [slots, kv heads (dividing heads), d] expected, got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  check_head_size(q.size(2), "attend");
  TORCH_CHECK(block_size > 0 && block_size % 16 == 0, "attend: block_size must be a positive multiple of 16, got ",
              block_size);
  TORCH_CHECK(window >= 0, "attend: window must be 0 (none) or positive");
  if (sinks) {
    check_f32(*sinks, "sinks");
    TORCH_CHECK(sinks->dim() == 1 && sinks->numel() == q.size(1), "attend: sinks must be [heads], got ",
                sinks->sizes());
  }
  const int64_t tokens = q.size(0);
  check_per_token(pos, at::kLong, "pos", tokens);
  check_per_token(row_seq, at::kInt, "row_seq", tokens);
  check_per_token(order, at::kInt, "order", tokens);
  check_tensor(tables, at::kInt, "tables");
  check_tensor(items, at::kInt, "items");
  TORCH_CHECK(tables.dim() == 2, "attend: tables must be [sequences, max blocks], got ", tables.sizes());
  TORCH_CHECK(items.dim() == 1 && items.numel() >= 1, "attend: items must be [items + 1], got ", items.sizes());
  const Isa& kern = pick(isa);
  at::Tensor out = at::empty_like(q);  // every row of every token is written: order holds each token once
  AttnArgs a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
             pos.data_ptr<int64_t>(), tables.data_ptr<int32_t>(), row_seq.data_ptr<int32_t>(),
             order.data_ptr<int32_t>(), items.data_ptr<int32_t>(), q.size(1), k.size(1), q.size(2),
             tables.size(1), block_size, (float)scale, window, sinks ? sinks->data_ptr<float>() : nullptr};
  const int64_t num_items = items.numel() - 1, units = num_items * a.kv_heads;
  check_plan(a, tokens, tables.size(0), num_items, k.size(0) / block_size);
  const int32_t* it = items.data_ptr<int32_t>();
  if (units >= 2 * at::get_num_threads()) {
    // units differ in cost (a causal chunk's later tokens read more keys): the last (the costliest of a prefill)
    // first. Halves in order left one of two threads a quarter of a 512-token chunk's work (SmolLM2, Intel Xeon, 2
    // threads: keys 0-511 2.10 -> 1.63 ms a layer, 512-1023 4.70 -> 4.33 ms)
    each_unit(units, attn_scratch(a), [&](int64_t i, float* scratch) {
      kern.attend(a, scratch, units - 1 - i, units - i);
    });
    return out;
  }
  // too few units to keep the threads busy (a decode step of one or two sequences): each span its own unit, then
  // the spans folded per item, in the same order as attend folds them
  std::vector<int32_t> spans, first;  // (item, span) pairs; each item's first pair
  for (int64_t i = 0; i < num_items; i++) {
    int64_t last = 0;
    for (int32_t t = it[i]; t < it[i + 1]; t++) last = std::max(last, a.pos[a.order[t]]);
    first.push_back((int32_t)spans.size() / 2);
    for (int64_t s = 0; s <= last / SPAN; s++) spans.insert(spans.end(), {(int32_t)i, (int32_t)s});
  }
  const int64_t span_units = (int64_t)spans.size() / 2 * a.kv_heads;
  // not zeroed (190 KB a layer at b = 1 for SmolLM2): each span resets the state it uses
  const std::unique_ptr<float[]> partials(new float[span_units * attn_partial(a)]), scratch(new float[attn_scratch(a)]);
  // too little to wake another thread for (one sequence of 320 keys, SmolLM2's heads: 16 us a call on one thread, 25
  // on two; even at 1-4k keys two threads gained nothing measurable): one thread, the same arithmetic. Else the
  // spans in order, a full one before the last's few keys (halves in order gave one of two threads 8 of 1,056 keys'
  // 12 full spans: SmolLM2 decode at b = 1, Intel Xeon, 30 layers out of cache 3.25 -> 2.78 ms)
  if (span_units * SPAN * a.d <= SERIAL_KEY_DIMS)
    kern.attend_spans(a, spans.data(), partials.get(), scratch.get(), 0, span_units);
  else
    each_unit(span_units, attn_scratch(a), [&](int64_t u, float* unit_scratch) {
      kern.attend_spans(a, spans.data(), partials.get(), unit_scratch, u, u + 1);
    });
  kern.attend_merge(a, first.data(), partials.get(), scratch.get(), 0, units);  // a few states a unit: one thread
  return out;
}

// One decoder layer of the plain form (RMSNorm before attention and before a SwiGLU MLP, each result added to the
// residual stream): the six calls models/llama.py makes for it on our kernels, in its order, as these same functions,
// so the same bits. The four weights (qkv, o, gate_up, down) are parts first[i] to first[i + 1] in turn, as linear
// takes them; the plan's arguments as attend takes them.
at::Tensor layer(const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, double eps, at::TensorList parts,
                 at::IntArrayRef kind_ids, at::IntArrayRef rows, const int64_t (&first)[5],
                 const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots, int64_t heads, const at::Tensor& pos,
                 const at::Tensor& tables, const at::Tensor& row_seq, const at::Tensor& order, const at::Tensor& items,
                 int64_t block_size, double scale, int64_t window, int64_t isa) {
  const auto weight = [&](int i) {
    const int64_t n = first[i + 1] - first[i];
    return std::make_tuple(parts.slice(first[i], n), kind_ids.slice(first[i], n), rows.slice(first[i], n));
  };
  const auto [qkv_w, qkv_k, qkv_r] = weight(0);
  const at::Tensor qkv = linear(x, qkv_w, qkv_k, qkv_r, qkv_bias, isa, ln1, eps, false, c10::nullopt);
  const at::Tensor q = rope_store(qkv, cos, sin, k_pool, v_pool, slots, heads, k_pool.size(1), isa);
  const at::Tensor o = attend(q, k_pool, v_pool, pos, tables, row_seq, order, items, block_size, scale, isa, window,
                              c10::nullopt);
  const auto [o_w, o_k, o_r] = weight(1);
  const at::Tensor h = linear(o.view({o.size(0), -1}), o_w, o_k, o_r, c10::nullopt, isa, c10::nullopt, 0., false, x);
  const auto [gu_w, gu_k, gu_r] = weight(2);
  const at::Tensor gate_up = linear(h, gu_w, gu_k, gu_r, c10::nullopt, isa, ln2, eps, false, c10::nullopt);
  const auto [down_w, down_k, down_r] = weight(3);
  return linear(gate_up, down_w, down_k, down_r, c10::nullopt, isa, c10::nullopt, 0., true, h);
}

// A run of plain layers that share one attention plan, each layer in turn, from one call: what goes is Python and the
// dispatcher between the calls (a decode step of SmolLM2, Intel Xeon: six calls a layer in one op, at b = 1 11.2-11.5
// -> 10.3-10.8 ms; then a run of 30 layers in one op, at b = 1 6.87-7.21 -> 6.51-6.56, at b = 8 27.35-27.40 ->
// 25.61-25.85). Layer i has norms ln1[i], ln2[i], the four weights' parts counts[4 i .. 4 i + 3], and its keys and
// values at row pool_rows[i] of k and v [rows, slots, kv heads, d].
at::Tensor layers(const at::Tensor& x, at::TensorList ln1, at::TensorList ln2, double eps, at::TensorList parts,
                  at::IntArrayRef kind_ids, at::IntArrayRef rows, at::IntArrayRef counts,
                  const c10::List<c10::optional<at::Tensor>>& qkv_bias, const at::Tensor& cos, const at::Tensor& sin,
                  at::Tensor k, at::Tensor v, at::IntArrayRef pool_rows, const at::Tensor& slots, int64_t heads,
                  const at::Tensor& pos, const at::Tensor& tables, const at::Tensor& row_seq, const at::Tensor& order,
                  const at::Tensor& items, int64_t block_size, double scale, int64_t window, int64_t isa) {
  const int64_t n = (int64_t)ln1.size();
  TORCH_CHECK(n > 0 && (int64_t)ln2.size() == n && (int64_t)qkv_bias.size() == n && (int64_t)pool_rows.size() == n &&
                  (int64_t)counts.size() == 4 * n,
              "layers: per layer two norms, a bias (or None), a pool row and four weights' part counts");
  TORCH_CHECK(parts.size() == kind_ids.size() && parts.size() == rows.size(),
              "layers: one kind and one row count per part");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "layers: k and v must be [rows, slots, kv heads, d], got ",
              k.sizes(), ", ", v.sizes());
  at::Tensor h = x;
  int64_t first[5] = {0};
  for (int64_t i = 0; i < n; i++) {
    TORCH_CHECK(pool_rows[i] >= 0 && pool_rows[i] < k.size(0), "layers: layer ", i, "'s pool row ", pool_rows[i],
                " is outside k's ", k.size(0), " rows");
    first[0] = first[4];
    for (int j = 0; j < 4; j++) {
      TORCH_CHECK(counts[4 * i + j] > 0, "layers: each weight has at least one part");
      first[j + 1] = first[j] + counts[4 * i + j];
    }
    TORCH_CHECK(first[4] <= (int64_t)parts.size(), "layers: counts must add up to the parts");
    h = layer(h, ln1[i], ln2[i], eps, parts, kind_ids, rows, first, qkv_bias[i], cos, sin, k.select(0, pool_rows[i]),
              v.select(0, pool_rows[i]), slots, heads, pos, tables, row_seq, order, items, block_size, scale, window,
              isa);
  }
  TORCH_CHECK(first[4] == (int64_t)parts.size(), "layers: counts must add up to the parts");
  return h;
}

}  // namespace

TORCH_LIBRARY(prefixcache, m) {
  m.def("supported() -> str[]", &supported);
  m.def("kinds() -> str[]", &kinds);
  m.def("quant_rows(int isa) -> int", &quant_rows);
  m.def("linear(Tensor x, Tensor[] parts, int[] kinds, int[] rows, Tensor? bias, int isa, Tensor? norm=None, "
        "float eps=0., bool swiglu=False, Tensor? residual=None) -> Tensor", &linear);
  m.def("rows(Tensor w, int kind, int n, Tensor ids, int isa) -> Tensor", &rows);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int isa) -> Tensor", &rms_norm);
  m.def("silu_mul(Tensor gate_up, int isa) -> Tensor", &silu_mul);
  m.def("gelu_mul(Tensor gate_up, int isa) -> Tensor", &gelu_mul);
  m.def("clamp_glu(Tensor gate_up, float alpha, float limit, int isa) -> Tensor", &clamp_glu);
  m.def("logit_stats(Tensor logits, int isa) -> (Tensor, Tensor)", &logit_stats);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, "
        "int heads, int kv_heads, int isa) -> Tensor", &rope_store);
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor pos, Tensor tables, Tensor row_seq, Tensor order, "
        "Tensor items, int block_size, float scale, int isa, int window=0, Tensor? sinks=None) -> Tensor", &attend);
  m.def("layers(Tensor x, Tensor[] ln1, Tensor[] ln2, float eps, Tensor[] parts, int[] kinds, int[] rows, "
        "int[] counts, Tensor?[] qkv_bias, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, int[] pool_rows, "
        "Tensor slots, int heads, Tensor pos, Tensor tables, Tensor row_seq, Tensor order, Tensor items, "
        "int block_size, float scale, int window, int isa) -> Tensor", &layers);
}
