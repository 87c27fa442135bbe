// kiln runtime: the decoder's elementwise steps fused into one pass each, CPU.
//
// Hand-written because torch runs them as chains of separate operators, each reading and
// writing the whole activation (rms_norm in bfloat16 is an upcast, a square, a mean, two
// multiplies and a downcast; silu(gate) * up is two passes over [tokens, 2 x intermediate]):
// at prefill sizes every pass streams megabytes, at one token every operator pays its
// dispatch. Each function here reads its inputs once and writes its output once, computing
// in float32 and rounding to the storage dtype where torch rounds:
//   rms_norm:     y = x * rsqrt(mean(x^2) + eps) * w, rounded once (as torch does);
//   add_rms_norm: residual += delta (rounded, as torch's add), then rms_norm of it;
//   silu_mul:     silu(gate) rounded, times up, rounded (torch's two operators);
//   rope_:        x * cos rounded, plus rotate_half(x) * sin rounded, in place on the query
//                 and key heads of the fused qkv output, cos and sin picked by position; over
//                 the first cos.size(1) channels of each head (all of them, or the rotary
//                 share of partial rotary: Phi-4-mini's 96 of 128), the rest left as they are;
//   argmax_rows:  each row's first maximum, or its first NaN (torch's max(dim=-1).indices),
//                 read straight from bf16 logits: torch's max over 32 rows of a 49k
//                 vocabulary takes 1.1-1.4 ms of a greedy decode step, this pass ~0.2.
// Results match torch's up to float32 summation order (the mean) and exp's last bit; with
// AVX-512 the rows run 16 lanes at a time, and where the build has AVX512-BF16 its rounding
// to bf16 flushes subnormals (|x| < 1.2e-38) that torch keeps (simd.h, `narrow16`; the
// residual add's stored sum included). `bf16_flushes_subnormals` says which this build does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

using namespace kiln_simd;

// One row: y = x * rsqrt(mean(x^2) + eps) * w; `wide` holds the row in float32.
template <typename T>
inline void norm_row(const float* wide, const T* w, T* y, int64_t H, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < H; ++i) sum += wide[i] * wide[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) y[i] = narrow<T>(wide[i] * r * widen(w[i]));
}

void check_norm(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.is_contiguous() &&
                  w.size(0) == x.size(1),
              name, ": contiguous x [M, H] and weight [H]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, ": float32 or bfloat16 x and weight of the same dtype");
}

#if defined(KILN_AVX512)
// One row in 16 lanes: the add (rounded and stored), the sum of squares and y in two passes,
// the row's float32 values kept in `wide` between them. The compiler's vectorisation of the
// scalar rows above ran at ~0.7 ns an element (0.9 ms for 2048 x 576 bf16, 55 ms of a
// 2048-token prefill); these run at a fraction of that.
template <typename T>
inline void norm_row16(T* row, const T* d, const T* w, T* y, float* wide, int64_t H, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 live = live16(H - i);
    __m512 v = load16(row + i, live);
    if (d != nullptr) v = store16(row + i, live, _mm512_add_ps(v, load16(d + i, live)));
    _mm512_storeu_ps(wide + i, v);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 r = _mm512_set1_ps(
      1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(H) + eps));
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 live = live16(H - i);
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(wide + i), r);
    store16(y + i, live, _mm512_mul_ps(v, load16(w + i, live)));
  }
}
#endif

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, at::Tensor& y,
               double eps) {
  const int64_t M = x.size(0), H = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wide((H + 15) / 16 * 16);
    for (int64_t m = begin; m < end; ++m) {
      T* row = xp + m * H;
#if defined(KILN_AVX512)
      norm_row16<T>(row, dp ? dp + m * H : nullptr, wp, yp + m * H, wide.data(), H,
                    static_cast<float>(eps));
#else
      if (dp) {
        const T* d = dp + m * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) row[i] = narrow<T>(widen(row[i]) + widen(d[i]));
      }
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) wide[i] = widen(row[i]);
      norm_row<T>(wide.data(), wp, yp + m * H, H, static_cast<float>(eps));
#endif
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w, "rms_norm");
  at::Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    norm_rows<c10::BFloat16>(x, nullptr, w, y, eps);
  } else {
    norm_rows<float>(x, nullptr, w, y, eps);
  }
  return y;
}

at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& w,
                         double eps) {
  check_norm(residual, w, "add_rms_norm_");
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: delta must match the residual's shape and dtype");
  const at::Tensor d = delta.contiguous();
  at::Tensor y = at::empty_like(residual);
  if (residual.scalar_type() == at::kBFloat16) {
    norm_rows<c10::BFloat16>(residual, &d, w, y, eps);
  } else {
    norm_rows<float>(residual, &d, w, y, eps);
  }
  return y;
}

#if defined(KILN_AVX512)
inline __m512 silu16(__m512 g) {
  const __m512 decay = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), decay));
}

template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* o, int64_t I) {
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 live = live16(I - i);
    const __m512 s = round16(static_cast<T*>(nullptr), silu16(load16(gate + i, live)));
    store16(o + i, live, _mm512_mul_ps(s, load16(up + i, live)));
  }
}
#else
// Elements [begin, end) of a row, one at a time.
template <typename T>
inline void silu_mul_tail(const T* gate, const T* up, T* o, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = widen(gate[i]);
    const float s = widen(narrow<T>(g / (1.f + exp_poly(-g))));
    o[i] = narrow<T>(s * widen(up[i]));
  }
}
#if defined(KILN_AVX2)
// With AVX2 alone, 8 lanes at a time. silu_mul_tail's loop over whole rows, which GCC
// vectorises under `omp simd`, still ran at ~6 ns an element: 2.4 ms for 256 rows of
// SmolLM2's 1,536 in either dtype (x86-64-v3 build, one thread, a Xeon), 5x torch's own AVX2
// kernel and 10-15% of a prefill; these lanes take 0.18 ms in float32, 0.43 in bf16
// (tests/benchmarks/elementwise_cpu.py).
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* o, int64_t I) {
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 decay = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = round8(static_cast<T*>(nullptr),
                            _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), decay)));
    store8(o + i, _mm256_mul_ps(s, load8(up + i)));
  }
  silu_mul_tail(gate, up, o, i, I);
}
#else
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* o, int64_t I) {
  silu_mul_tail(gate, up, o, 0, I);
}
#endif
#endif

template <typename T>
void silu_mul_rows(const at::Tensor& gu, at::Tensor& out) {
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      silu_mul_row<T>(gp + m * 2 * I, gp + m * 2 * I + I, op + m * I, I);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: a contiguous CPU [M, 2 * I] gate and up side by side");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_rows<c10::BFloat16>(gate_up, out);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "silu_mul: float32 or bfloat16 only");
    silu_mul_rows<float>(gate_up, out);
  }
  return out;
}

#if defined(KILN_AVX512)
// One head in 16 lanes, each half against the other (rotate_half's sign is in `s`); both
// halves are read before either is written. The compiler's scalar loop in rope_rows, with its
// lane-crossing select, took 0.8 ms for 2048 tokens of 12 heads of 64.
template <typename T>
inline void rope_head16(T* row, const T* c, const T* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 live = live16(half - i);
    const __m512 lo = load16(row + i, live), hi = load16(row + half + i, live);
    const __m512 lo_c = round16(row, _mm512_mul_ps(lo, load16(c + i, live)));
    const __m512 hi_c = round16(row, _mm512_mul_ps(hi, load16(c + half + i, live)));
    store16(row + i, live, _mm512_fmadd_ps(hi, load16(s + i, live), lo_c));
    store16(row + half + i, live, _mm512_fmadd_ps(lo, load16(s + half + i, live), hi_c));
  }
}
#endif

// `heads` heads of `dim` channels each, side by side in every row of qkv; the first `rotary`
// channels of each rotate (rotary == dim but under partial rotary).
template <typename T>
void rope_rows(at::Tensor& qkv, const int64_t* pos, const at::Tensor& cos, const at::Tensor& sin,
               int64_t heads, int64_t dim, int64_t rotary) {
  const int64_t tokens = qkv.size(0), stride = qkv.stride(0), half = rotary / 2;
  T* base = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
#if !defined(KILN_AVX512)
    std::vector<float> x(rotary);  // the scalar loop's copy of a head's rotated channels
#endif
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + pos[t] * rotary;
      const T* s = sp + pos[t] * rotary;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = base + t * stride + h * dim;
#if defined(KILN_AVX512)
        rope_head16<T>(row, c, s, half);
#else
        for (int64_t i = 0; i < rotary; ++i) x[i] = widen(row[i]);
#pragma omp simd
        for (int64_t i = 0; i < rotary; ++i) {
          const float swapped = i < half ? x[i + half] : x[i - half];
          const float scaled = widen(narrow<T>(x[i] * widen(c[i])));
          row[i] = narrow<T>(scaled + swapped * widen(s[i]));
        }
#endif
      }
    }
  });
}

void rope_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin, int64_t heads, int64_t dim) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) >= heads * dim && dim % 2 == 0,
              "rope_: a CPU qkv [T, >= heads * dim] with unit column stride and an even dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(1) >= 2 && cos.size(1) <= dim &&
                  cos.size(1) % 2 == 0 && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "rope_: cos and sin tables [positions, rotary dim] in qkv's dtype, the rotary dim "
              "even and at most dim");
  const int64_t rotary = cos.size(1);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == qkv.size(0),
              "rope_: one int64 position per token");
  const at::Tensor pc = positions.contiguous();
  const int64_t* pos = pc.data_ptr<int64_t>();
  for (int64_t t = 0; t < pc.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_: position past the tables");
  }
  if (qkv.scalar_type() == at::kBFloat16) {
    rope_rows<c10::BFloat16>(qkv, pos, cos, sin, heads, dim, rotary);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kFloat, "rope_: float32 or bfloat16 only");
    rope_rows<float>(qkv, pos, cos, sin, heads, dim, rotary);
  }
}

// Row m's argmax: a vectorised pass for the maximum (and whether a NaN is there), then a scan
// for the first element that is it (or the first NaN), a vector or a block at a time.
template <typename T>
int64_t argmax_row(const T* row, int64_t N) {
  float best = -INFINITY;
  int nan = 0;
  int64_t n = 0;
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; n + 16 <= N; n += 16) {
    const __m512 v = load16(row + n);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);  // a NaN lane may win here: the flag decides then
  }
  best = _mm512_reduce_max_ps(top);
  nan = unordered != 0;
#endif
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = n; i < N; ++i) {
    const float v = widen(row[i]);
    nan |= v != v;
    best = v > best ? v : best;
  }
  auto is_it = [&](float v) { return nan ? v != v : v == best; };
  n = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; n + 16 <= N; n += 16) {
    const __m512 v = load16(row + n);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                              : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return n + __builtin_ctz(hit);
  }
#endif
  constexpr int64_t BLOCK = 256;
  for (int64_t b0 = n; b0 < N; b0 += BLOCK) {
    const int64_t b1 = std::min(N, b0 + BLOCK);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = b0; i < b1; ++i) hit |= is_it(widen(row[i]));
    if (!hit) continue;
    for (int64_t i = b0; i < b1; ++i)
      if (is_it(widen(row[i]))) return i;
  }
  return 0;  // unreachable: the maximum is one of the row's values
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.size(1) > 0 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "argmax_rows: logits [M, N > 0] float32 or bfloat16 on the CPU");
  const at::Tensor x = logits.contiguous();
  const int64_t M = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      o[m] = x.scalar_type() == at::kFloat ? argmax_row(x.data_ptr<float>() + m * N, N)
                                           : argmax_row(x.data_ptr<c10::BFloat16>() + m * N, N);
    }
  });
  return out;
}

bool bf16_flushes_subnormals() {
#if defined(KILN_AVX512) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("bf16_flushes_subnormals() -> bool", &bf16_flushes_subnormals);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def(
      "rope_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int heads, int dim) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rope_", &rope_);
}
