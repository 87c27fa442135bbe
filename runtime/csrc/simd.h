// kiln runtime: the float32 / bfloat16 helpers the native CPU kernels share.
//
// `widen` reads a stored value as float32 (bfloat16 is the upper half of a float32);
// `narrow<T>` stores a float32 as T, rounding to nearest even as torch does; `exp_poly` is
// exp in vectorisable float arithmetic. With
// AVX-512: `load16` widens 16 values (a mask reads a tail), `store16` / `round16` narrow 16
// lanes as `narrow` does, `exp16` is exp in 16 lanes, and `sum_each` reduces 16 vectors to
// one vector of their sums.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
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

// exp(x) in plain float arithmetic that the compiler vectorises (`#pragma omp simd` loops):
// 2^k * p(r) with r = x - k ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor polynomial
// (relative error < 2e-7, about one float ulp); x is clamped to [-87, 88], where float32
// neither under- nor overflows.
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  // Round to nearest even by adding and removing 1.5 * 2^23 (|x * log2 e| < 2^22): unlike
  // nearbyint, plain arithmetic that every vectoriser takes.
  const float k = (x * 1.4426950408889634f + 12582912.f) - 12582912.f;
  const float r = x - k * 0.693145751953125f - k * 1.4286068203094172e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
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

#if defined(__AVX512F__)

// exp(x), 16 lanes: 2^k * p(r) with r = x - k ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor
// polynomial (relative error < 2e-7, about one float ulp); x is clamped to [-87, 88], where
// float32 neither under- nor overflows.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.4286068203094172e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
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
