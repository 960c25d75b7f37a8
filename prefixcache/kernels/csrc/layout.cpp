// torch op prefixcache::lay_out: a GGUF weight's blocks, as the file ships them, rearranged into panels of 16 rows
// as the GEMMs read them (models/layouts.py describes the layout and holds its inverse, `blocks`). One pass over the
// file's bytes: each block's fields are unpacked as gguf unpacks them to dequantize, then packed again field by
// field, each value of a panel's 16 rows side by side.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "kernels.h"

namespace {

constexpr int HALF = 16;  // a field of fp16 (or bf16) values, kept as their bits
constexpr int MAX_FIELDS = 6, MAX_VALUES = 256;

// per kind (as KINDS numbers them): weights per block, a block's bytes in the file, and its fields in their order
// in a panel's block, as (bits, values); models/layouts.py FIELDS
struct Spec {
  int k, file_bytes, fields;
  int bits[MAX_FIELDS], values[MAX_FIELDS];
};
constexpr Spec SPECS[NUM_KINDS] = {
    {1, 0, 0, {}, {}},                                               // F32: panels, not blocks
    {2, 4, 1, {HALF}, {2}},                                          // F16
    {2, 4, 1, {HALF}, {2}},                                          // BF16
    {32, 18, 2, {HALF, 4}, {1, 32}},                                 // Q4_0
    {32, 20, 3, {HALF, HALF, 4}, {1, 1, 32}},                        // Q4_1
    {32, 22, 2, {HALF, 5}, {1, 32}},                                 // Q5_0
    {32, 24, 3, {HALF, HALF, 5}, {1, 1, 32}},                        // Q5_1
    {32, 34, 2, {HALF, 8}, {1, 32}},                                 // Q8_0
    {256, 84, 4, {HALF, HALF, 8, 2}, {1, 1, 16, 256}},               // Q2_K
    {256, 110, 3, {HALF, 8, 3}, {1, 16, 256}},                       // Q3_K
    {256, 144, 5, {HALF, HALF, 8, 8, 4}, {1, 1, 8, 8, 256}},         // Q4_K
    {256, 176, 5, {HALF, HALF, 8, 8, 5}, {1, 1, 8, 8, 256}},         // Q5_K
    {256, 210, 3, {HALF, 8, 6}, {1, 16, 256}},                       // Q6_K
    {32, 18, 2, {HALF, 4}, {1, 32}},                                 // IQ4_NL
    {256, 136, 3, {HALF, 8, 4}, {1, 8, 256}},                        // IQ4_XS
    {32, 17, 2, {8, 4}, {1, 32}},                                    // MXFP4
};

constexpr int laid_bytes(const Spec& s) {
  int total = 0;
  for (int f = 0; f < s.fields; f++) total += 16 * (s.bits[f] == HALF ? 2 * s.values[f] : s.values[f] * s.bits[f] / 8);
  return total;
}
constexpr bool specs_match_kinds() {
  for (int i = 1; i < NUM_KINDS; i++)
    if (SPECS[i].k != KINDS[i].k || laid_bytes(SPECS[i]) != KINDS[i].bytes) return false;
  return true;
}
static_assert(specs_match_kinds(), "kernels.h KINDS: a block of a panel's weights and bytes");

using Values = uint16_t[MAX_FIELDS][MAX_VALUES];

uint16_t half(const uint8_t* p) { return (uint16_t)(p[0] | p[1] << 8); }

// values packed `bits` wide in `bytes` bytes, as gguf unpacks them: value (a, t, l) of [bytes / run, 8 / bits, run]
// is bits t * bits of byte a * run + l
void planes(const uint8_t* p, int bytes, int run, int bits, uint16_t* out) {
  const int per = 8 / bits, mask = (1 << bits) - 1;
  for (int a = 0; a < bytes / run; a++)
    for (int t = 0; t < per; t++)
      for (int l = 0; l < run; l++) out[(a * per + t) * run + l] = (p[a * run + l] >> (t * bits)) & mask;
}

// Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins, 8 of each
void scales_mins(const uint8_t* s, uint16_t* sc, uint16_t* m) {
  for (int j = 0; j < 4; j++) {
    sc[j] = s[j] & 63;
    m[j] = s[4 + j] & 63;
    sc[4 + j] = (s[8 + j] & 15) | ((s[j] >> 2) & 48);
    m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 48);
  }
}

// the fields of one block as the file has it (models/quant.py KINDS), in the order of SPECS
void split(int kind, const uint8_t* b, Values& v) {
  switch (kind) {
    case 1: case 2:  // F16, BF16
      v[0][0] = half(b), v[0][1] = half(b + 2);
      return;
    case 3: case 4: case 5: case 6: {  // Q4_0, Q4_1, Q5_0, Q5_1: d (m) (fifth bits) nibbles
      int f = 0, at = 0;
      v[f++][0] = half(b), at = 2;
      if (kind == 4 || kind == 6) v[f++][0] = half(b + 2), at = 4;
      uint16_t fifth[32] = {};
      if (kind >= 5) planes(b + at, 4, 1, 1, fifth), at += 4;
      planes(b + at, 16, 16, 4, v[f]);
      for (int i = 0; i < 32; i++) v[f][i] |= fifth[i] << 4;
      return;
    }
    case 7:  // Q8_0
      v[0][0] = half(b);
      for (int i = 0; i < 32; i++) v[1][i] = b[2 + i];
      return;
    case 8:  // Q2_K: scales[16] qs[64] d dmin
      v[0][0] = half(b + 80), v[1][0] = half(b + 82);
      for (int i = 0; i < 16; i++) v[2][i] = b[i];
      planes(b + 16, 64, 32, 2, v[3]);
      return;
    case 9: {  // Q3_K: hmask[32] qs[64] scales[12] d; scales 4 + 2 bits, less 32
      uint16_t lo[16], hi[16];
      planes(b + 96, 8, 8, 4, lo);
      planes(b + 104, 4, 4, 2, hi);
      uint16_t third[256];
      v[0][0] = half(b + 108);
      for (int i = 0; i < 16; i++) v[1][i] = (uint8_t)((lo[i] | hi[i] << 4) - 32);
      planes(b + 32, 64, 32, 2, v[2]);
      planes(b, 32, 32, 1, third);
      for (int i = 0; i < 256; i++) v[2][i] |= third[i] << 2;
      return;
    }
    case 10: case 11: {  // Q4_K, Q5_K: d dmin scales[12] (qh[32]) qs[128]
      v[0][0] = half(b), v[1][0] = half(b + 2);
      scales_mins(b + 4, v[2], v[3]);
      uint16_t fifth[256] = {};
      if (kind == 11) planes(b + 16, 32, 32, 1, fifth);
      planes(b + (kind == 11 ? 48 : 16), 128, 32, 4, v[4]);
      for (int i = 0; i < 256; i++) v[4][i] |= fifth[i] << 4;
      return;
    }
    case 12: {  // Q6_K: ql[128] qh[64] scales[16] d; each q its low nibble | its high 2 bits << 4
      uint16_t high[256];
      v[0][0] = half(b + 208);
      for (int i = 0; i < 16; i++) v[1][i] = b[192 + i];
      planes(b + 128, 64, 32, 2, high);
      planes(b, 128, 64, 4, v[2]);
      for (int i = 0; i < 256; i++) v[2][i] |= high[i] << 4;
      return;
    }
    case 13:  // IQ4_NL: d qs[16], as Q4_0
      v[0][0] = half(b);
      planes(b + 2, 16, 16, 4, v[1]);
      return;
    case 14: {  // IQ4_XS: d scales_h (2 bits each, 16 bits) scales_l[4] (4 bits each) qs[128]; scales less 32
      uint16_t lo[8], hi[8];
      planes(b + 4, 4, 1, 4, lo);
      planes(b + 2, 2, 1, 2, hi);
      v[0][0] = half(b);
      for (int i = 0; i < 8; i++) v[1][i] = (uint8_t)((lo[i] | hi[i] << 4) - 32);
      planes(b + 8, 128, 16, 4, v[2]);
      return;
    }
    case 15:  // MXFP4: e (E8M0) qs[16], the nibbles as Q4_0's
      v[0][0] = b[0];
      planes(b + 1, 16, 16, 4, v[1]);
      return;
  }
}

// the fields of lane l's block into a panel's block: a half's value e at bytes 2 (16 e + l); a packed field's byte e
// (its values e * 8 / bits.., the first in the low bits) at 16 e + l; 3-, 5- or 6-bit values eight in `bits` bytes: of
// values 8e.. 8e + 7, byte bits e + j holds value 8e + j in its top bits and, in its low 8 - bits, bits (8 - bits) j..
// of the others, values 8e + bits.. one after the other from bit 0
void pack(const Spec& s, const Values& v, int l, uint8_t* out) {
  for (int f = 0; f < s.fields; f++) {
    const int bits = s.bits[f], n = s.values[f];
    if (bits == HALF) {
      for (int e = 0; e < n; e++) std::memcpy(out + 2 * (16 * e + l), &v[f][e], 2);
      out += 32 * n;
      continue;
    }
    if (bits == 3 || bits == 5 || bits == 6) {
      const int spare = 8 - bits;
      for (int e = 0; e < n / 8; e++) {
        uint32_t rest = 0;
        for (int i = 0; i < spare; i++) rest |= (uint32_t)v[f][8 * e + bits + i] << bits * i;
        for (int j = 0; j < bits; j++)
          out[16 * (bits * e + j) + l] = (uint8_t)(v[f][8 * e + j] << spare | (rest >> spare * j & ((1 << spare) - 1)));
      }
      out += 16 * n * bits / 8;
      continue;
    }
    const int per = 8 / bits;
    for (int e = 0; e < n / per; e++) {
      int byte = 0;
      for (int t = 0; t < per; t++) byte |= v[f][e * per + t] << (t * bits);
      out[16 * e + l] = (uint8_t)byte;
    }
    out += 16 * n / per;
  }
}

// rows [n, blocks * file bytes] of a GGUF kind -> [ceil(n / 16), blocks, KINDS bytes]; the last panel's missing rows
// are blocks of zero bytes, laid out as any
at::Tensor lay_out(const at::Tensor& rows, int64_t kind) {
  TORCH_CHECK(kind >= 1 && kind < NUM_KINDS, "lay_out: kind ", kind, " is not a GGUF kind the kernels read");
  const Spec& s = SPECS[kind];
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.is_contiguous() && rows.dim() == 2 &&
                  rows.size(1) % s.file_bytes == 0,
              "lay_out: rows must be contiguous uint8 [rows, blocks * ", s.file_bytes, "] on the CPU, got ",
              rows.sizes());
  const int64_t n = rows.size(0), blocks = rows.size(1) / s.file_bytes, panels = (n + 15) / 16;
  const int64_t laid = KINDS[kind].bytes;
  at::Tensor out = at::empty({panels, blocks, laid}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    static const uint8_t zeros[256] = {};
    Values v{};
    for (int64_t p = p0; p < p1; p++)
      for (int64_t b = 0; b < blocks; b++)
        for (int l = 0; l < 16; l++) {
          const int64_t r = p * 16 + l;
          split((int)kind, r < n ? src + (r * blocks + b) * s.file_bytes : zeros, v);
          pack(s, v, l, dst + (p * blocks + b) * laid);
        }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, m) { m.def("lay_out(Tensor rows, int kind) -> Tensor", &lay_out); }
