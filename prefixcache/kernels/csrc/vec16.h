// Sixteen fp32 lanes: one AVX-512 register, or two AVX2 registers. Every operation is lane-wise IEEE arithmetic
// (or an exact select, max or shuffle), and the few that cross lanes (hsum) add in one fixed tree, so the AVX2 and
// AVX-512 builds of a kernel give the same bits.
#pragma once
#include <immintrin.h>


// every definition here is per ISA: the two builds must not share an inline function the linker could merge
namespace PC_NS {

#if defined(PC_AVX512)
struct V16 {
  static constexpr int LANES = 16, OFFSET = 0;  // lanes, and the panel's first lane they hold
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 set1(float x) { return {_mm512_set1_ps(x)}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V16 load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_n(float* p, int n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
  // lanes below n keep their value, the others get `fill`
  V16 first_n(int n, float fill) const { return {_mm512_mask_blend_ps(mask(n), _mm512_set1_ps(fill), v)}; }
  V16 lt_select(V16 limit, V16 a, V16 b) const {  // lanes where this < limit take a, the others b
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, limit.v, _CMP_LT_OQ), b.v, a.v)};
  }
  V16 round() const { return {_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  V16 pow2i() const {  // 2^v for integral v in [-126, 127]
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
  }
  float first() const { return _mm512_cvtss_f32(v); }
  float hmax() const { return _mm512_reduce_max_ps(v); }  // max is exact in any order
  bool any_nan() const { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
  int first_eq(float x) const {  // the first lane equal to x, or -1
    const unsigned m = _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_EQ_OQ);
    return m ? __builtin_ctz(m) : -1;
  }
  float hsum() const {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return hsum8(s8);
  }
  static V16 load_f16(const void* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
  static V16 load_bf16(const void* p) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(h, 16))};
  }
  // 16 bytes, each unsigned or signed, as floats (exact)
  static V16 from_u8(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
  static V16 from_i8(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))}; }
  // 16 E8M0 bytes e as 2^(e - 128), a bit pattern each (exact): gguf's MXFP4.e8m0_to_fp32_half, llama.cpp's
  // ggml_e8m0_to_fp32_half, whose e = 0 and 1 give subnormals
  static V16 from_e8m0_half(__m128i b) {
    const __m512i e = _mm512_cvtepu8_epi32(b);
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 is_normal = _mm512_cmpge_epu32_mask(e, _mm512_set1_epi32(2));
    return {_mm512_castsi512_ps(_mm512_mask_blend_epi32(is_normal, sub, normal))};
  }
  // the low nibbles of 16 bytes at p less `minus`, and 16 times their high nibbles less `minus`, as floats (exact):
  // the bytes widened once as they load, then masked (a mask, not a shift: on AVX2 a shift takes a port the fmas
  // need, a mask any of three)
  static void nibbles(const uint8_t* p, int minus, V16& lo, V16& hi16) {
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    lo = {_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(w, _mm512_set1_epi32(15)), _mm512_set1_epi32(minus)))};
    hi16 = {_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(w, _mm512_set1_epi32(240)), _mm512_set1_epi32(16 * minus)))};
  }
  static __mmask16 mask(int n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }
  static float hsum8(__m256 s8) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
  }
};
inline V16 operator+(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 operator/(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 fms(V16 a, V16 b, V16 c) { return {_mm512_fmsub_ps(a.v, b.v, c.v)}; }  // a * b - c, rounded once
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 vmin(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }

#elif defined(PC_AVX2)
struct V16 {
  static constexpr int LANES = 16, OFFSET = 0;
  __m256 lo, hi;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V16 load_n(const float* p, int n) {
    return {_mm256_maskload_ps(p, mask8(n)), _mm256_maskload_ps(p + 8, mask8(n - 8))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  void store_n(float* p, int n) const { _mm256_maskstore_ps(p, mask8(n), lo); _mm256_maskstore_ps(p + 8, mask8(n - 8), hi); }
  V16 first_n(int n, float fill) const {
    __m256 f = _mm256_set1_ps(fill);
    return {_mm256_blendv_ps(f, lo, _mm256_castsi256_ps(mask8(n))),
            _mm256_blendv_ps(f, hi, _mm256_castsi256_ps(mask8(n - 8)))};
  }
  V16 lt_select(V16 limit, V16 a, V16 b) const {
    return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(lo, limit.lo, _CMP_LT_OQ)),
            _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(hi, limit.hi, _CMP_LT_OQ))};
  }
  V16 round() const {
    const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(lo, r), _mm256_round_ps(hi, r)};
  }
  V16 pow2i() const {
    __m256i b = _mm256_set1_epi32(127);
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(lo), b), 23)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(hi), b), 23))};
  }
  float first() const { return _mm256_cvtss_f32(lo); }
  bool any_nan() const {
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(lo, lo, _CMP_UNORD_Q), _mm256_cmp_ps(hi, hi, _CMP_UNORD_Q)));
  }
  int first_eq(float x) const {  // the first lane equal to x, or -1
    const __m256 b = _mm256_set1_ps(x);
    const unsigned m = _mm256_movemask_ps(_mm256_cmp_ps(lo, b, _CMP_EQ_OQ)) |
                       _mm256_movemask_ps(_mm256_cmp_ps(hi, b, _CMP_EQ_OQ)) << 8;
    return m ? __builtin_ctz(m) : -1;
  }
  float hmax() const {
    __m256 m8 = _mm256_max_ps(lo, hi);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
  }
  float hsum() const {
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
  }
  static V16 load_f16(const void* p) {
    const __m128i* h = (const __m128i*)p;
    return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
  }
  static V16 load_bf16(const void* p) {
    const __m128i* h = (const __m128i*)p;
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h)), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h + 1)), 16))};
  }
  static V16 from_u8(__m128i b) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
  }
  static V16 from_i8(__m128i b) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
  }
  static V16 from_e8m0_half(__m128i b) { return {e8m0_half(b), e8m0_half(_mm_srli_si128(b, 8))}; }
  static __m256 e8m0_half(__m128i b) {  // the first 8 bytes, as AVX-512's from_e8m0_half
    const __m256i e = _mm256_cvtepu8_epi32(b);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  }
  static void nibbles(const uint8_t* p, int minus, V16& lo, V16& hi16) {
    const __m256i w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i w1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
    const __m256i f = _mm256_set1_epi32(15), m = _mm256_set1_epi32(minus);
    const __m256i f16 = _mm256_set1_epi32(240), m16 = _mm256_set1_epi32(16 * minus);
    lo = {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w0, f), m)),
          _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w1, f), m))};
    hi16 = {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w0, f16), m16)),
            _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w1, f16), m16))};
  }
  static __m256i mask8(int n) {  // lanes below n all ones
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
};
inline V16 operator+(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 operator/(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 fms(V16 a, V16 b, V16 c) { return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vmin(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }

// Half of a panel's 16 lanes, H = 0 (lanes 0-7) or 1 (8-15), in one AVX2 register: a register tile of the weights'
// blocks on AVX2 is 8 lanes wide, so that 8 rows' sums fit in the 16 registers with the weights and scales. Each
// operation is lane-wise V16's on its lanes, so the same bits.
template <int H>
struct V8 {
  static constexpr int LANES = 8, OFFSET = 8 * H;
  __m256 v;
  static V8 zero() { return {_mm256_setzero_ps()}; }
  static V8 set1(float x) { return {_mm256_set1_ps(x)}; }
  static V8 load_n(const float* p, int n) { return {_mm256_maskload_ps(p, V16::mask8(n))}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store_n(float* p, int n) const { _mm256_maskstore_ps(p, V16::mask8(n), v); }
  static V8 load_f16(const void* p) { return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p + H))}; }
  static V8 load_bf16(const void* p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p + H));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(h, 16))};
  }
  static __m128i half(__m128i b) { return H ? _mm_srli_si128(b, 8) : b; }
  static V8 from_u8(__m128i b) { return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half(b)))}; }
  static V8 from_i8(__m128i b) { return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half(b)))}; }
  static V8 from_e8m0_half(__m128i b) { return {V16::e8m0_half(half(b))}; }
  static void nibbles(const uint8_t* p, int minus, V8& lo, V8& hi16) {
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * H)));
    lo = {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w, _mm256_set1_epi32(15)), _mm256_set1_epi32(minus)))};
    hi16 = {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w, _mm256_set1_epi32(240)), _mm256_set1_epi32(16 * minus)))};
  }
};
template <int H> inline V8<H> operator+(V8<H> a, V8<H> b) { return {_mm256_add_ps(a.v, b.v)}; }
template <int H> inline V8<H> operator*(V8<H> a, V8<H> b) { return {_mm256_mul_ps(a.v, b.v)}; }
template <int H> inline V8<H> fma(V8<H> a, V8<H> b, V8<H> c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
template <int H> inline V8<H> fms(V8<H> a, V8<H> b, V8<H> c) { return {_mm256_fmsub_ps(a.v, b.v, c.v)}; }
#else
#error "build with -DPC_AVX512 or -DPC_AVX2"
#endif

// e^x from the same fma, round and exponent-shift steps on every lane (about 2 ulp); 0 below -87.3
inline V16 vexp(V16 x) {
  const V16 lo = V16::set1(-87.3f);
  V16 c = vmin(vmax(x, lo), V16::set1(88.3f));
  V16 n = (c * V16::set1(1.44269504088896341f)).round();
  V16 r = fma(n, V16::set1(-0.693145751953125f), c);
  r = fma(n, V16::set1(-1.428606765330187045e-06f), r);
  V16 p = V16::set1(1.9875691500e-4f);
  p = fma(p, r, V16::set1(1.3981999507e-3f));
  p = fma(p, r, V16::set1(8.3334519073e-3f));
  p = fma(p, r, V16::set1(4.1665795894e-2f));
  p = fma(p, r, V16::set1(1.6666665459e-1f));
  p = fma(p, r, V16::set1(5.0000001201e-1f));
  p = fma(p * r, r, r) + V16::set1(1.0f);
  return x.lt_select(lo, V16::zero(), p * n.pow2i());
}

}  // namespace PC_NS
