// kiln runtime: a W8A8 layer's activation quantisation and output scaling, one pass each, CPU.
//
// Hand-written because torch spells each as a chain of operators over the whole tensor:
// quantising (widen, |x|, row max, divide, round, clamp, narrow to int8) and scaling the
// int32 products (widen, an [M, N] outer product of the scales, multiply, narrow) each make
// four to six passes and allocate as many temporaries. On SmolLM2-135M's gate_up at 512 rows
// (a 2-core Xeon with AMX, one thread) they took 6.6 ms around a 1.8 ms `_int_mm`. Both
// compute what runtime/engine/layers/kernels.py's Int8Linear computes with torch, in the same order, so the
// results are the same bits:
//
//   int8_quantize: scale = max|x| / 127.5 over each row (per_token) or the whole input, eps
//     (2^-23) where that is 0, or the static scale given; codes = round-half-even(x / scale)
//     clamped to [-128, 127], x widened to float32 first.
//   int8_rescale: y[m, n] = (float(acc[m, n]) * (scale[m] * weight_scale[n])) rounded to the
//     output dtype (float32 or bf16), acc int32 (`_int_mm`) or float32 (kiln's bf16 kernel on
//     the codes, on CPUs without VNNI).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "simd.h"

namespace {

using namespace kiln_simd;

constexpr float CODE_PEAK = 127.5f;  // compressed-tensors' int8 activation range
constexpr int64_t GRAIN = 16;         // rows per parallel task

template <typename T>
float row_peak(const T* x, int64_t K) {
#if defined(KILN_AVX512)
  __m512 peak = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 live = live16(K - k);
    peak = _mm512_max_ps(peak, _mm512_abs_ps(load16(x + k, live)));  // masked lanes read 0
  }
  return _mm512_reduce_max_ps(peak);
#else
  float peak = 0.f;
#pragma omp simd reduction(max : peak)
  for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(widen(x[k])));
  return peak;
#endif
}

float nonzero_scale(float peak) {
  const float scale = peak / CODE_PEAK;
  return scale == 0.f ? FLT_EPSILON : scale;
}

template <typename T>
void quantize_row(const T* x, int64_t K, float scale, int8_t* codes) {
#if defined(KILN_AVX512)
  // 16 lanes: the same division, rounding half to even, clamp and narrowing
  const __m512 s = _mm512_set1_ps(scale), low = _mm512_set1_ps(-128.f);
  const __m512 high = _mm512_set1_ps(127.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 live = live16(K - k);
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load16(x + k, live), s),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(high, _mm512_max_ps(low, q)));
    _mm_mask_storeu_epi8(codes + k, live, _mm512_cvtepi32_epi8(c));
  }
#else
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::nearbyint(widen(x[k]) / scale);
    codes[k] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, q)));
  }
#endif
}

template <typename T>
void quantize(const T* x, int64_t M, int64_t K, const float* fixed, bool per_token,
              int8_t* codes, float* scales) {
  float shared = 0.f;
  if (fixed != nullptr) {
    shared = *fixed;
  } else if (!per_token) {
    float peak = 0.f;
    for (int64_t m = 0; m < M; ++m) peak = std::max(peak, row_peak(x + m * K, K));
    shared = nonzero_scale(peak);
  }
  at::parallel_for(0, M, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float scale = shared;
      if (fixed == nullptr && per_token) scale = scales[m] = nonzero_scale(row_peak(x + m * K, K));
      quantize_row(x + m * K, K, scale, codes + m * K);
    }
  });
  if (!per_token || fixed != nullptr) scales[0] = shared;
}

template <typename A, typename T>
void rescale(const A* acc, int64_t M, int64_t N, const float* scale, bool per_row,
             const float* weight_scale, T* out) {
  at::parallel_for(0, M, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float s = scale[per_row ? m : 0];
      const A* a = acc + m * N;
      T* y = out + m * N;
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) {
        const float product = s * weight_scale[n];  // as torch's [M, N] outer product
        y[n] = narrow<T>(static_cast<float>(a[n]) * product);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x,
                                                 const std::optional<at::Tensor>& static_scale,
                                                 bool per_token) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_quantize: x [M, K] float32 or bfloat16 on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xc = x.contiguous();
  at::Tensor codes = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor fixed;
  if (static_scale.has_value()) {
    TORCH_CHECK(static_scale->numel() == 1, "int8_quantize: one static scale");
    fixed = static_scale->to(at::kFloat).contiguous();
  }
  const bool rows = per_token && !static_scale.has_value();
  at::Tensor scales = rows ? at::empty({M, 1}, x.options().dtype(at::kFloat))
                           : at::empty({}, x.options().dtype(at::kFloat));
  const float* f = static_scale.has_value() ? fixed.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    quantize(xc.data_ptr<c10::BFloat16>(), M, K, f, rows, codes.data_ptr<int8_t>(),
             scales.data_ptr<float>());
  } else {
    quantize(xc.data_ptr<float>(), M, K, f, rows, codes.data_ptr<int8_t>(),
             scales.data_ptr<float>());
  }
  return {codes, scales};
}

at::Tensor int8_rescale(const at::Tensor& acc, const at::Tensor& scale,
                        const at::Tensor& weight_scale, at::ScalarType dtype) {
  TORCH_CHECK(acc.device().is_cpu() && acc.dim() == 2 &&
                  (acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat),
              "int8_rescale: int32 or float32 products [M, N] on the CPU");
  const int64_t M = acc.size(0), N = acc.size(1);
  const bool per_row = scale.numel() != 1;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && (!per_row || scale.numel() == M),
              "int8_rescale: float32 scale, one per row or one for all");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.numel() == N,
              "int8_rescale: float32 weight_scale [N]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "int8_rescale: float32 or bfloat16 output");
  at::Tensor a = acc.contiguous(), s = scale.contiguous(), w = weight_scale.contiguous();
  at::Tensor out = at::empty({M, N}, acc.options().dtype(dtype));
  const float* sp = s.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  if (acc.scalar_type() == at::kInt) {
    if (dtype == at::kBFloat16) {
      rescale(a.data_ptr<int32_t>(), M, N, sp, per_row, wp, out.data_ptr<c10::BFloat16>());
    } else {
      rescale(a.data_ptr<int32_t>(), M, N, sp, per_row, wp, out.data_ptr<float>());
    }
  } else if (dtype == at::kBFloat16) {
    rescale(a.data_ptr<float>(), M, N, sp, per_row, wp, out.data_ptr<c10::BFloat16>());
  } else {
    rescale(a.data_ptr<float>(), M, N, sp, per_row, wp, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("int8_quantize(Tensor x, Tensor? static_scale, bool per_token) -> (Tensor, Tensor)");
  m.def("int8_rescale(Tensor acc, Tensor scale, Tensor weight_scale, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("int8_quantize", &int8_quantize);
  m.impl("int8_rescale", &int8_rescale);
}
