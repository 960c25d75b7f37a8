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

#define PC_DECLARE(ns)                                                                                         \
  namespace ns {                                                                                               \
  void linear(const float* x, int64_t m, int64_t k, const float* packed, const float* bias, const float* res,  \
              float* y, int64_t n, int64_t p0, int64_t p1);                                                    \
  void linear_q4_1(const float* x, int64_t m, int64_t k, const uint8_t* q, const float* bias, const float* res,  \
                   float* y, int64_t n, int64_t p0, int64_t p1);                                               \
  void linear_q8_0(const float* x, int64_t m, int64_t k, const uint8_t* q, const float* bias, const float* res,  \
                   float* y, int64_t n, int64_t p0, int64_t p1);                                               \
  void rms_norm(const float* x, const float* w, float* y, int64_t k, float eps, int64_t r0, int64_t r1);       \
  void silu_mul(const float* gate_up, float* y, int64_t i, int64_t r0, int64_t r1);                            \
  void attend(const AttnArgs& a, float* scratch, int64_t u0, int64_t u1);                                      \
  void attend_spans(const AttnArgs& a, const int32_t* spans, float* partials, float* scratch, int64_t u0,        \
                    int64_t u1);                                                                               \
  void attend_merge(const AttnArgs& a, const int32_t* first, float* partials, float* scratch, int64_t u0,        \
                    int64_t u1);                                                                               \
  void rope_store(const RopeArgs& a, float* scratch, int64_t r0, int64_t r1);                                  \
  }
PC_DECLARE(avx512)
PC_DECLARE(avx2)
