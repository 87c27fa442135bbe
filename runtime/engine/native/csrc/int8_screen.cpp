// kiln runtime: approximate logits from an int8 copy of the LM head, for exact greedy steps.
//
// Hand-written because no library does it: a greedy decode step needs only the argmax of the
// logits, and at a few rows the bf16 LM head (SmolLM2-135M: 49,152 x 576, 57 MB) is a third
// of the bytes a step reads. runtime/engine/layers/greedy_head.py screens the vocabulary with this int8
// copy (half the bytes), bounds each approximate logit's distance from the exact one, and
// recomputes exactly only the tokens that can still be the argmax (the rule and its proof are
// in greedy_head.py; `int8_greedy` carries it out, `int8_screen` is its first pass).
//
// `int8_screen(x, panels, scale, N)`: approx[m, n] = scale[n] * sum_k x[m, k] * q[n, k] in
// float32, x float32 or bfloat16 (widened exactly). Layout: `panels` is q [N, K] int8 in
// panels of 64 output columns, [ceil(N/64), K, 64], zeros past N (runtime/engine/layers/greedy_head.py
// packs it), so one row reads the whole copy as one stream. Per k the 64 codes are widened
// 8 at a time, 16 with AVX-512 (sign extension, then an exact conversion to float32) and
// multiplied in float32; the summation order is not the bf16 kernel's, which the screen's
// bound allows for.
// The candidates are then recomputed from the layer's own weight with its own arithmetic:
// bf16_linear's from its panels, amx_linear's from its tiles (kiln_amx::pair_row), or
// dpbf16_linear's from its pairs (kiln_dpbf16::column_sums).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "dpbf16.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace kiln_simd;

constexpr int64_t PANEL = 64;  // output columns per panel
constexpr int64_t MAX_ROWS = 4;
// The copy is prefetched this many bytes ahead of the k being multiplied (as bf16_linear's
// single row): SmolLM2-135M's head screened in 3.7 ms without, 2.8 ms with (one thread, a
// 2-core Xeon with AVX-512; 4 KB ahead alike).
constexpr int PREFETCH_AHEAD = 2048;

#if defined(__AVX2__) && defined(__FMA__)
// acc[r][c] = sum_k x[r, k] * q[c, k] for MR rows and the 8 * V columns of one panel starting
// at column 8 * v0.
template <int MR, int V>
inline void tile(const float* x, int64_t K, const int8_t* panel, int v0, float* out,
                 int64_t ldo) {
  __m256 acc[MR][V];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* codes = panel + k * PANEL + 8 * v0;
    _mm_prefetch(reinterpret_cast<const char*>(panel + k * PANEL) + PREFETCH_AHEAD, _MM_HINT_T0);
    __m256 w[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * v));
      w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(a, w[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + r * ldo + 8 * (v0 + v), acc[r][v]);
}
#else
template <int MR, int V>
inline void tile(const float* x, int64_t K, const int8_t* panel, int v0, float* out,
                 int64_t ldo) {
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 8 * v0; c < 8 * (v0 + V); ++c) {
      float dot = 0.f;
      for (int64_t k = 0; k < K; ++k) dot += x[r * K + k] * panel[k * PANEL + c];
      out[r * ldo + c] = dot;
    }
}
#endif

#if defined(__AVX512F__)
// One panel for MR rows, 16 columns a vector: all 64 columns in one pass over k (4 * MR
// accumulators). Each column's sum is the same sequence of float32 fused multiply-adds as the
// AVX2 tile's, so both builds give the same approximations; this one widens twice the codes
// per instruction, which is what bounds the AVX2 tile at one row.
template <int MR>
inline void panel_rows(const float* x, int64_t K, const int8_t* panel, float* out) {
  constexpr int V = PANEL / 16;
  __m512 acc[MR][V];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* codes = panel + k * PANEL;
    _mm_prefetch(reinterpret_cast<const char*>(codes) + PREFETCH_AHEAD, _MM_HINT_T0);
    __m512 w[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m128i sixteen = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * v));
      w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen));
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(a, w[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + r * PANEL + 16 * v, acc[r][v]);
}
#else
// One panel for MR rows: all 64 columns, in register-sized column blocks.
template <int MR>
inline void panel_rows(const float* x, int64_t K, const int8_t* panel, float* out) {
  constexpr int V = MR == 1 ? 8 : MR == 2 ? 4 : 2;  // 8 * MR accumulators at most
  for (int v0 = 0; v0 < PANEL / 8; v0 += V) tile<MR, V>(x, K, panel, v0, out, PANEL);
}
#endif

// approx [M, N] = scale[n] * sum_k x[m, k] * q[n, k] (x widened to float32 [M, K]).
void screen(const float* xs, int64_t M, int64_t K, const int8_t* q, int64_t P, const float* s,
            int64_t N, float* o) {
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    alignas(32) float acc[MAX_ROWS * PANEL];
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* panel = q + p * K * PANEL;
      switch (M) {
        case 1: panel_rows<1>(xs, K, panel, acc); break;
        case 2: panel_rows<2>(xs, K, panel, acc); break;
        case 3: panel_rows<3>(xs, K, panel, acc); break;
        default: panel_rows<4>(xs, K, panel, acc); break;
      }
      const int64_t n0 = p * PANEL, width = std::min<int64_t>(PANEL, N - n0);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < width; ++c) o[r * N + n0 + c] = s[n0 + c] * acc[r * PANEL + c];
    }
  });
}

// Where bf16_pack stores column n: panel n / 64, position (n % 64 / 16) * 16 + slot(n % 16).
inline int64_t bf16_offset(int64_t n, int64_t K, int64_t k) {
  const int64_t c = n % 16;
  const int64_t position = (n % PANEL / 16) * 16 + (c < 8 ? 2 * c : 2 * (c - 8) + 1);
  return (n / PANEL) * K * PANEL + k * PANEL + position;
}

template <typename T>
inline float as_output(float v) {
  return widen(narrow<T>(v));
}

// Row m's argmax of the bf16 layer's outputs (rounded to T), or -1 where the screen cannot
// decide (a non-finite approximate logit, or more than max_candidates candidates); exact(n) is
// candidate n's float32 sum as the layer computes it.
template <typename T, typename Exact>
int64_t decide(const float* x, int64_t K, const float* approx, const float* slack, int64_t N,
               int64_t max_candidates, std::vector<int64_t>& cand, Exact&& exact) {
  float norm = 0.f;
  for (int64_t k = 0; k < K; ++k) norm += std::fabs(x[k]);
  norm *= 1.f + 0x1p-10f;
  // bound_n: how far the exact float32 logit can be from approx_n (greedy_head.py); the last
  // term covers subnormal products or partial sums flushed to zero, K of them at most
  const float flushed = static_cast<float>(K) * 0x1p-125f;
  auto bound = [&](int64_t n) {
    return norm * slack[n] + std::fabs(approx[n]) * 0x1p-20f + flushed;
  };
  float floor = -INFINITY;
  for (int64_t n = 0; n < N; ++n) {
    if (!std::isfinite(approx[n])) return -1;
    floor = std::max(floor, approx[n] - bound(n));
  }
  const float reach = as_output<T>(floor);
  cand.clear();
  for (int64_t n = 0; n < N; ++n) {
    if (as_output<T>(approx[n] + bound(n)) >= reach) {
      if (static_cast<int64_t>(cand.size()) == max_candidates) return -1;
      cand.push_back(n);
    }
  }
  // Each candidate exactly as the layer computes it, then rounded to T. The first of equal
  // maxima wins, as argmax's.
  int64_t best = -1;
  float best_value = 0.f;
  for (const int64_t n : cand) {
    const float value = as_output<T>(exact(n));
    if (best < 0 || value > best_value) best = n, best_value = value;
  }
  return best;
}

// exact(n) for a kernel that computes W columns at a time: fill(g, sums) gives columns
// [W g, W g + W); the last group is kept, as candidates come in increasing order.
template <int W, typename Fill>
struct GroupSums {
  Fill fill;
  alignas(64) float sums[W] = {};
  int64_t cached = -1;
  float operator()(int64_t n) {
    if (n / W != cached) {
      cached = n / W;
      fill(cached, sums);
    }
    return sums[n % W];
  }
};

template <int W, typename Fill>
GroupSums<W, Fill> group_sums(Fill fill) {
  return GroupSums<W, Fill>{fill};
}

// Candidate n as bf16_linear computes it from its panels: one float32 fused multiply-add per
// k, in order from zero.
inline float panel_sum(const float* x, int64_t K, const uint16_t* w, int64_t n) {
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    c10::BFloat16 v;
    v.x = w[bf16_offset(n, K, k)];
    acc = std::fma(x[k], widen(v), acc);
  }
  return acc;
}

at::Tensor int8_screen(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                       int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.size(0) <= MAX_ROWS,
              "int8_screen: x [M, K] float32 or bfloat16 on the CPU, M <= 4");
  TORCH_CHECK(panels.scalar_type() == at::kChar && panels.dim() == 3 &&
                  panels.size(2) == PANEL && panels.is_contiguous() &&
                  panels.size(1) == x.size(1) && panels.size(0) * PANEL >= N &&
                  panels.size(0) * PANEL < N + PANEL,
              "int8_screen: int8 panels [ceil(N/64), K, 64] with x's K columns and N outputs");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == N &&
                  scale.is_contiguous(),
              "int8_screen: scale float32 [N]");
  at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), N}, x32.options());
  if (x.size(0) > 0)
    screen(x32.data_ptr<float>(), x.size(0), x.size(1), panels.data_ptr<int8_t>(),
           panels.size(0), scale.data_ptr<float>(), N, out.data_ptr<float>());
  return out;
}

// Each row's argmax of the bf16 layer whose weight is `weight` (no bias): its bf16_pack panels,
// its amx_pack tiles (then x is bfloat16 with K a multiple of 32, as amx_linear reads it) or
// its dpbf16_pack pairs (then x is bfloat16 with an even K), decided through the int8 screen;
// an empty tensor where some row cannot be decided that way.
at::Tensor int8_greedy(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                       const at::Tensor& slack, const at::Tensor& weight, int64_t N,
                       int64_t max_candidates) {
  at::Tensor approx = int8_screen(x, panels, scale, N);
  TORCH_CHECK(slack.scalar_type() == at::kFloat && slack.dim() == 1 && slack.size(0) == N &&
                  slack.is_contiguous(),
              "int8_greedy: slack float32 [N]");
  const int64_t M = x.size(0), K = x.size(1);
  const bool tiles = weight.dim() == 6, pairs = weight.dim() == 4;
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  (tiles    ? weight.size(1) * 32 == K && weight.size(0) * 32 >= N &&
                               weight.size(0) * 32 < N + 32 && bf16_x
                   : pairs ? weight.size(1) * 2 == K && weight.size(2) == PANEL &&
                                 weight.size(0) == panels.size(0) && bf16_x
                           : weight.sizes() == panels.sizes()),
              "int8_greedy: the bf16_pack panels, or the amx_pack tiles or dpbf16_pack pairs "
              "under a bfloat16 x (K even), of the layer the screen copies");
  at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor xc = x.contiguous();
  at::Tensor tokens = at::empty({M}, x.options().dtype(at::kLong));
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  std::vector<int64_t> cand;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x32.data_ptr<float>() + m * K;
    const float* am = approx.data_ptr<float>() + m * N;
    const float* sl = slack.data_ptr<float>();
    int64_t token;
    if (tiles || pairs) {
      // AMX and VDPBF16PS read subnormal inputs as zero: such a row is left to the full head
      for (int64_t k = 0; k < K; ++k)
        if (xm[k] != 0.f && std::fabs(xm[k]) < FLT_MIN) return at::empty({0}, tokens.options());
    }
    const uint16_t* xb =
        bf16_x ? reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()) + m * K : nullptr;
    if (pairs) {
      auto exact = group_sums<16>([&](int64_t g, float* sums) {
        TORCH_CHECK(kiln_dpbf16::column_sums(xb, K / 2, w, g, sums),
                    "int8_greedy: dpbf16 pairs on a CPU or build without AVX512-BF16");
      });
      token = decide<c10::BFloat16>(xm, K, am, sl, N, max_candidates, cand, exact);
    } else if (tiles) {
      auto exact = group_sums<32>([&](int64_t g, float* sums) {
        TORCH_CHECK(kiln_amx::pair_row(xb, K / 32, w, g, sums),
                    "int8_greedy: AMX tiles on a CPU or build without AMX");
      });
      token = decide<c10::BFloat16>(xm, K, am, sl, N, max_candidates, cand, exact);
    } else {
      auto exact = [&](int64_t n) { return panel_sum(xm, K, w, n); };
      token = bf16_x
                  ? decide<c10::BFloat16>(xm, K, am, sl, N, max_candidates, cand, exact)
                  : decide<float>(xm, K, am, sl, N, max_candidates, cand, exact);
    }
    if (token < 0) return at::empty({0}, tokens.options());
    tokens.data_ptr<int64_t>()[m] = token;
  }
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("int8_screen(Tensor x, Tensor panels, Tensor scale, int N) -> Tensor");
  m.def(
      "int8_greedy(Tensor x, Tensor panels, Tensor scale, Tensor slack, Tensor weight, int N, "
      "int max_candidates) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("int8_screen", &int8_screen);
  m.impl("int8_greedy", &int8_greedy);
}
