// The kernels each ISA build provides, over a range of independent work (panels, rows or attention units) that
// ops.cpp hands to threads. Each output's arithmetic is fixed by the problem's own sizes: no range, thread or ISA
// changes a bit of it.
#pragma once
#include <cstdint>

struct AttnArgs {
  const float* q;          // [tokens, heads, d]
  const float* k;          // [slots / 16, kv_heads, d, 16], one layer of the pool (models/paged.py store)
  const float* v;          // [slots / 16, kv_heads, 16, d]
  float* out;              // [tokens, heads, d]
  const int64_t* pos;      // [tokens] a token attends keys 0..pos of its sequence
  const int32_t* tables;   // [seqs, max_blocks] pool block of each block of keys
  const int32_t* row_seq;  // [tokens] the token's row in tables
  const int32_t* order;    // token indices, item after item
  const int32_t* items;    // [num_items + 1] offsets into order
  int64_t heads, kv_heads, d, max_blocks, block_size;
  float scale;
  int64_t window;          // a token attends its last `window` keys, its own included; 0: keys 0..pos
  const float* sinks;      // [heads] a logit per head in each row's softmax denominator (gpt-oss), or null
};

struct RopeArgs {
  const float* qkv;        // [rows, (heads + 2 kv_heads) * d]
  const float* cos;        // [rows, d]
  const float* sin;
  float* q;                // [rows, heads, d]
  float* k;                // one layer of the pool, as AttnArgs
  float* v;
  const int64_t* slots;    // [stored] the pool slot of each of the first `stored` rows
  int64_t stored, heads, kv_heads, d;
};

constexpr int KEY_BLOCK = 64;    // keys per step of a row's online softmax, aligned to absolute positions
constexpr int SPAN = 256;        // keys per span: a row's softmax restarts at each and folds the spans in order
constexpr int ITEM_TOKENS = 16;  // most tokens in one attention item
constexpr int MAX_ROWS = 6;      // most attention rows a build computes in one register tile

// floats of one unit's online-softmax state (rows of an item, each d + 2), and the scratch a unit needs
inline int64_t attn_partial(const AttnArgs& a) { return ITEM_TOKENS * (a.heads / a.kv_heads) * (a.d + 2); }
inline int64_t attn_scratch(const AttnArgs& a) { return 2 * attn_partial(a) + MAX_ROWS * KEY_BLOCK; }

// The formats a GEMM reads a weight in (models/layouts.py lays each out): fp32 panels, or a GGUF type's blocks,
// both by panels of 16 rows. One block of a panel holds `k` weights along k of its 16 rows, in `bytes` bytes.
struct Kind {
  const char* name;
  int64_t k, bytes;
};
constexpr Kind KINDS[] = {{"F32", 1, 64},       {"F16", 2, 64},       {"BF16", 2, 64},      {"Q4_0", 32, 288},
                          {"Q4_1", 32, 320},    {"Q5_0", 32, 352},    {"Q5_1", 32, 384},    {"Q8_0", 32, 544},
                          {"Q2_K", 256, 1344},  {"Q3_K", 256, 1824},  {"Q4_K", 256, 2368},  {"Q5_K", 256, 2880},
                          {"Q6_K", 256, 3360},  {"IQ4_NL", 32, 288},  {"IQ4_XS", 256, 2208},
                          {"MXFP4", 32, 272}};
constexpr int NUM_KINDS = sizeof(KINDS) / sizeof(KINDS[0]);

// One part of a GEMM's weight, rows stacked by parts: y[:, its columns] = x @ part.T (+ bias) (+ residual)
struct GemmArgs {
  const float* x;     // [m, k]
  int64_t m, k;
  const void* w;      // the part's n rows: [ceil(n / 16), k / kind's k, kind's bytes]
  int64_t n;
  const float* bias;  // [n], or null
  const float* res;   // [m, ldy] from the part's first column, or null
  float* y;           // [m, ldy] from the part's first column
  int64_t ldy;
};

#define PC_DECLARE(ns)                                                                                         \
  namespace ns {                                                                                               \
  int64_t gemm_scratch(int kind, int64_t m);                                                                   \
  void gemm(int kind, const GemmArgs& a, float* scratch, int64_t p0, int64_t p1);                              \
  void panel(int kind, const void* w, int64_t k, int64_t p, float* out);                                       \
  int64_t quant_rows();                                                                                        \
  void rms_norm(const float* x, const float* w, float* y, int64_t k, float eps, int64_t r0, int64_t r1);       \
  void silu_mul(const float* gate_up, float* y, int64_t i, int64_t r0, int64_t r1);                            \
  void gelu_mul(const float* gate_up, float* y, int64_t i, int64_t r0, int64_t r1);                            \
  void clamp_glu(const float* gate_up, float* y, int64_t i, float alpha, float limit, int64_t r0, int64_t r1);   \
  void logit_stats(const float* x, int64_t v, float* stats, int64_t* argmax, int64_t r0, int64_t r1);          \
  void attend(const AttnArgs& a, float* scratch, int64_t u0, int64_t u1);                                      \
  void attend_spans(const AttnArgs& a, const int32_t* spans, float* partials, float* scratch, int64_t u0,        \
                    int64_t u1);                                                                               \
  void attend_merge(const AttnArgs& a, const int32_t* first, float* partials, float* scratch, int64_t u0,        \
                    int64_t u1);                                                                               \
  void rope_store(const RopeArgs& a, float* scratch, int64_t r0, int64_t r1);                                  \
  }
PC_DECLARE(avx512)
PC_DECLARE(avx2)
