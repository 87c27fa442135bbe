// kiln runtime: the float32 / bfloat16 helpers the native CPU kernels share.
//
// `widen` reads a stored value as float32 (bfloat16 is the upper half of a float32);
// `narrow<T>` stores a float32 as T, rounding to nearest even as torch does; `exp_poly` is
// exp in vectorisable float arithmetic. With
// AVX-512: `load16` widens 16 values (a mask reads a tail), `store16` / `round16` narrow 16
// lanes as `narrow` does, `exp16` is exp in 16 lanes, and `sum_each` reduces 16 vectors to
// one vector of their sums. With AVX2 and FMA: `load8`, `store8`, `round8` and `exp8`, the
// same in 8 lanes, for the kernels' paths without AVX-512.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace kiln_simd {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet = (bits >> 16) | 0x40;  // NaN stays NaN
  c10::BFloat16 out;  // a select, not a branch: loops over it vectorise
  out.x = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  return out;
}

// exp's constants, shared by its scalar, 8- and 16-lane forms: the clamp, log2(e), ln 2 split
// in a part exact in float32 and the rest, and the Taylor coefficients after the leading
// 1/720 in Horner order (p = p * r + c for each).
constexpr float EXP_LOW = -87.f, EXP_HIGH = 88.f, LOG2E = 1.4426950408889634f;
constexpr float LN2_HIGH = 0.693145751953125f, LN2_LOW = 1.4286068203094172e-06f;
constexpr float EXP_FIRST = 1.f / 720.f;
constexpr float EXP_TAYLOR[] = {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

// exp(x) in plain float arithmetic that the compiler vectorises (`#pragma omp simd` loops):
// 2^k * p(r) with r = x - k ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor polynomial
// (relative error < 2e-7, about one float ulp); x is clamped to [-87, 88], where float32
// neither under- nor overflows.
inline float exp_poly(float x) {
  x = std::min(std::max(x, EXP_LOW), EXP_HIGH);
  // Round to nearest even by adding and removing 1.5 * 2^23 (|x * log2 e| < 2^22): unlike
  // nearbyint, plain arithmetic that every vectoriser takes.
  const float k = (x * LOG2E + 12582912.f) - 12582912.f;
  const float r = x - k * LN2_HIGH - k * LN2_LOW;
  float p = EXP_FIRST;
#pragma GCC unroll 6
  for (const float c : EXP_TAYLOR) p = p * r + c;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
inline __m512 widen16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p, __mmask16 live) { return _mm512_maskz_loadu_ps(live, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 live) {
  return widen16(_mm256_maskz_loadu_epi16(live, p));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// What kiln's 16-lane rows need beside AVX512F: its 16-bit masked loads and stores (every
// AVX-512 CPU but the Xeon Phi); without them the kernels keep their scalar loops.
#define KILN_AVX512 1
// narrow<BFloat16> in 16 lanes, as 16 bf16 in a 256-bit vector: with AVX512-BF16 the CPU's
// conversion (one instruction; round to nearest even, NaN kept quiet, but subnormals flushed
// to zero, which torch keeps: |x| < 1.2e-38, never an activation of a working model),
// otherwise narrow's integer rounding exactly (9 instructions: on the elementwise kernels'
// hot loops, 15-25% slower; checking each vector for subnormals costs as much).
inline __m256i narrow16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                        _mm512_and_si512(high, _mm512_set1_epi32(1)));
  __m512i out = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  out = _mm512_mask_or_epi32(out, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), high,
                             _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(out);
#endif
}
// Store v as T (narrow<T>) and return what was stored, as float32.
inline __m512 store16(float* p, __mmask16 live, __m512 v) {
  _mm512_mask_storeu_ps(p, live, v);
  return v;
}
inline __m512 store16(c10::BFloat16* p, __mmask16 live, __m512 v) {
  const __m256i stored = narrow16(v);
  _mm256_mask_storeu_epi16(p, live, stored);
  return widen16(stored);
}
// A float32 vector rounded to T's precision (narrow<T>) and widened back.
inline __m512 round16(float*, __m512 v) { return v; }
inline __m512 round16(c10::BFloat16*, __m512 v) { return widen16(narrow16(v)); }
// The lanes of a row's last, possibly partial, 16 elements from `left` remaining.
inline __mmask16 live16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The 8-lane forms of the helpers above, for CPUs with AVX2 and FMA but no AVX-512 (a Zen 3
// EPYC): `load8` widens 8 values, `store8` / `round8` narrow 8 lanes exactly as `narrow`
// does (integer rounding, NaN kept quiet, subnormals kept), `exp8` is exp_poly in 8 lanes.
#define KILN_AVX2 1
inline __m256 widen8(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m128i narrow8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                        _mm256_and_si256(high, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  // eight 32-bit values below 2^16 to 16 bits: packed within each 128-bit half, whose first
  // 64 bits then join
  const __m256i both = _mm256_blendv_epi8(rounded, quiet, nan);
  const __m256i packed = _mm256_packus_epi32(both, both);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
inline __m256 store8(float* p, __m256 v) {
  _mm256_storeu_ps(p, v);
  return v;
}
inline __m256 store8(c10::BFloat16* p, __m256 v) {
  const __m128i stored = narrow8(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), stored);
  return widen8(stored);
}
inline __m256 round8(float*, __m256 v) { return v; }
inline __m256 round8(c10::BFloat16*, __m256 v) { return widen8(narrow8(v)); }
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LOW)), _mm256_set1_ps(EXP_HIGH));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_LOW),
                                    _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_HIGH), x));
  __m256 p = _mm256_set1_ps(EXP_FIRST);
#pragma GCC unroll 6
  for (const float c : EXP_TAYLOR) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  // 2^k for k in [-126, 127] (x is clamped), exact: its exponent bits
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)

// exp(x), 16 lanes: 2^k * p(r) with r = x - k ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor
// polynomial (relative error < 2e-7, about one float ulp); x is clamped to [-87, 88], where
// float32 neither under- nor overflows.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LOW)), _mm512_set1_ps(EXP_HIGH));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_LOW),
                                    _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_HIGH), x));
  __m512 p = _mm512_set1_ps(EXP_FIRST);
#pragma GCC unroll 6
  for (const float c : EXP_TAYLOR) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);
}

// Lane j of the result is the sum of v[j]'s 16 lanes.
inline __m512 sum_each(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = v[2 * i], y = v[2 * i + 1];
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 x = a[2 * i], y = a[2 * i + 1];
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    const __m512 x = b[2 * i], y = b[2 * i + 1];
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
  }
  const __m512 mixed =
      _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // The shuffles leave v[j]'s sum in lane 4 * (j % 4) + j / 4.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, mixed);
}
#endif

}  // namespace kiln_simd
