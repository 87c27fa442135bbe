// kiln runtime: y = x W^T (+ b) with a bfloat16 weight, for CPUs that do not compute bf16.
//
// Hand-written because nothing torch 2.13 can install does it on such a CPU: oneDNN runs a
// bf16 GEMM only where the CPU has AVX512-BF16, AMX or AVX2-VNNI-2, and elsewhere torch's bf16
// matmul falls back to a generic loop (SmolLM2-135M's 32-row decode step 5x slower than
// float32 on an AVX2 EPYC). A float32 weight streams twice the bytes of a bf16 one, and a
// decode step at a few rows is bound by those bytes. Here the weight stays bf16 in memory,
// each value is widened to float32 in registers (bf16 is the upper half of a float32, so the
// widening is exact), and the products are accumulated in float32: the arithmetic of a bf16
// linear layer (float32 accumulation, one rounding of the result to the output dtype), with
// half the bytes of float32 read per call.
//
// Layout: `bf16_pack` reorders W [N, K] into panels of 64 output columns, [ceil(N/64), K, 64]
// (zeros past N), so a single-row call reads the whole weight as one stream, front to back.
// Each k's 64 values are four sub-panels of 16 columns, the columns interleaved within each
// (see `slot`). `bf16_linear` computes a tile of MR rows x 16*NB columns at a time: per k it
// widens NB sub-panels' 16 values and does MR*NB*2 fused multiply-adds (AVX2: 8 lanes), the
// accumulators living in registers. With 2-8 rows every row tile meets a block of k's of a
// panel while it sits in L1, so each panel streams from memory once, in order; with more,
// blocks of rows meet each sub-panel in turn, a block of k's at a time. x is float32 or
// bfloat16 (widened once per call); the result has x's dtype. Every output is the same
// sequential float32 sum over k whatever the tile, so a row's result does not depend on the
// other rows of the call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace kiln_simd;

constexpr int64_t LANES = 16;    // output columns per sub-panel
constexpr int64_t PANEL = 64;    // output columns per panel: four sub-panels
constexpr int64_t SUBS = PANEL / LANES;
constexpr int64_t M_BLOCK = 48;  // rows whose inputs stay in L2 while the panels pass by
constexpr int64_t K_BLOCK = 64;  // k's of a panel (8 KB) in L1 while every row tile reads them
constexpr int64_t FEW_ROWS = 8;  // up to this many rows, blocks of k (measured: faster to 8)
// k's per block with more rows: every row's whole K (SmolLM2's 576 to 1,536) spilled the row
// tiles' inputs to L2, and a step's projections at 128-512 rows ran 1.2-1.25x slower than
// MKL's float32 GEMM on the widened weight; in blocks of 128, 1.12-1.14x (x86-64-v3 build,
// one thread, a Xeon; 64 and 256 measured alike). Results are unchanged: each output is still
// one fused multiply-add per k, in order.
constexpr int64_t MANY_K = 128;
// A single row asks for the weight this many bytes ahead of the k it multiplies: the hardware
// prefetchers alone left a step's projections at 31-32 ms where this gives 26-27 (SmolLM2-135M,
// one thread, a 2-core Xeon with AVX-512; 2-8 KB ahead measured alike).
constexpr int PREFETCH_AHEAD = 2048;

// Where a panel stores its column c (0-15) within each k's 16 values: columns 0-7 in the even
// slots, 8-15 in the odd ones (read back by widen16).
constexpr int64_t slot(int64_t c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; }

#if defined(__AVX2__) && defined(__FMA__)
// 16 packed values of one k: the even slots (columns 0-7) shifted into place, the odd slots
// (columns 8-15) masked: two cheap integer ops, none on the shuffle unit.
inline void widen16(const uint16_t* p, __m256& low, __m256& high) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  low = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  high = _mm256_and_ps(_mm256_castsi256_ps(raw),
                       _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// acc[r][c] += sum_{k0 <= k < k1} x[r, k] * W[c, k] for MR rows and NB consecutive sub-panels
// of one panel (16 * NB columns), one fused multiply-add per k in order; the accumulators
// start at zero when `first` and are read from acc_io otherwise (row stride ld floats).
// AHEAD > 0: prefetch the two cache lines AHEAD bytes past each k's (a stream reading whole
// panels).
template <int MR, int NB, int AHEAD = 0>
inline void tile(const float* x, int64_t ldx, const uint16_t* panels, int64_t k0, int64_t k1,
                 float* acc_io, int64_t ld, bool first) {
  __m256 acc[MR][2 * NB];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < 2 * NB; ++v)
      acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_io + r * ld + 8 * v);
  for (int64_t k = k0; k < k1; ++k) {
    __m256 w[2 * NB];
    if constexpr (AHEAD > 0) {
      const char* ahead = reinterpret_cast<const char*>(panels + k * PANEL) + AHEAD;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      widen16(panels + k * PANEL + b * LANES, w[2 * b], w[2 * b + 1]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
      for (int v = 0; v < 2 * NB; ++v) acc[r][v] = _mm256_fmadd_ps(a, w[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < 2 * NB; ++v) _mm256_storeu_ps(acc_io + r * ld + 8 * v, acc[r][v]);
}
#else
template <int MR, int NB, int AHEAD = 0>
inline void tile(const float* x, int64_t ldx, const uint16_t* panels, int64_t k0, int64_t k1,
                 float* acc_io, int64_t ld, bool first) {
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b)
      for (int64_t c = 0; c < LANES; ++c) {
        float dot = first ? 0.f : acc_io[r * ld + b * LANES + c];
        for (int64_t k = k0; k < k1; ++k) {
          c10::BFloat16 w;
          w.x = panels[k * PANEL + b * LANES + slot(c)];
          dot = std::fma(x[r * ldx + k], widen(w), dot);
        }
        acc_io[r * ld + b * LANES + c] = dot;
      }
}
#endif

template <typename T>
struct Problem {
  const float* x;
  const uint16_t* packed;
  const float* bias;  // float32 [N] or nullptr
  T* out;
  int64_t M, N, K;
};

// acc [rows, 64] (row stride PANEL) of panel p, bias added, stored as T in rows m0 ...
template <typename T>
inline void store(const Problem<T>& pr, const float* acc, int64_t m0, int64_t rows, int64_t p) {
  const int64_t n0 = p * PANEL, width = std::min<int64_t>(PANEL, pr.N - n0);
  for (int64_t r = 0; r < rows; ++r) {
    T* row = pr.out + (m0 + r) * pr.N + n0;
    const float* a = acc + r * PANEL;
    for (int64_t c = 0; c < width; ++c)
      row[c] = narrow<T>(pr.bias ? a[c] + pr.bias[n0 + c] : a[c]);
  }
}

// Rows (rows <= 6, x's first row at x) against one sub-panel, k in [k0, k1).
inline void sub_rows(const float* x, int64_t K, const uint16_t* w, int64_t rows, int64_t k0,
                     int64_t k1, float* acc, bool first) {
  switch (rows) {
    case 1: tile<1, 1>(x, K, w, k0, k1, acc, PANEL, first); break;
    case 2: tile<2, 1>(x, K, w, k0, k1, acc, PANEL, first); break;
    case 3: tile<3, 1>(x, K, w, k0, k1, acc, PANEL, first); break;
    case 4: tile<4, 1>(x, K, w, k0, k1, acc, PANEL, first); break;
    case 5: tile<5, 1>(x, K, w, k0, k1, acc, PANEL, first); break;
    default: tile<6, 1>(x, K, w, k0, k1, acc, PANEL, first); break;
  }
}

// Rows (rows <= 6) against the whole panel, k in [k0, k1): one row takes the panel as one
// tile and two rows half of it (more accumulators in flight), more rows one sub-panel.
inline void panel_rows(const float* x, int64_t K, const uint16_t* panel, int64_t rows,
                       int64_t k0, int64_t k1, float* acc, bool first) {
  if (rows == 1) {
    tile<1, SUBS>(x, K, panel, k0, k1, acc, PANEL, first);
  } else if (rows == 2) {
    for (int64_t sub = 0; sub < SUBS; sub += 2)
      tile<2, 2>(x, K, panel + sub * LANES, k0, k1, acc + sub * LANES, PANEL, first);
  } else {
    for (int64_t sub = 0; sub < SUBS; ++sub)
      sub_rows(x, K, panel + sub * LANES, rows, k0, k1, acc + sub * LANES, first);
  }
}

template <typename T>
void linear(const Problem<T>& pr) {
  const int64_t panels = (pr.N + PANEL - 1) / PANEL;
  // Threads split the output columns, so each reads its own part of the weight.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float acc[M_BLOCK * PANEL];
    if (pr.M == 1) {
      // Bound by the weight's bytes, read once: a whole panel per k (one stream), with
      // enough independent accumulators in flight.
      for (int64_t p = begin; p < end; ++p) {
        tile<1, SUBS, PREFETCH_AHEAD>(pr.x, pr.K, pr.packed + p * pr.K * PANEL, 0, pr.K, acc,
                                      PANEL, true);
        store(pr, acc, 0, 1, p);
      }
      return;
    }
    for (int64_t m_block = 0; m_block < pr.M; m_block += M_BLOCK) {
      const int64_t m_end = std::min(pr.M, m_block + M_BLOCK);
      for (int64_t p = begin; p < end; ++p) {
        const uint16_t* panel = pr.packed + p * pr.K * PANEL;
        if (pr.M <= FEW_ROWS) {
          // Too few rows to keep the FMA units busy on one sub-panel: every row tile meets
          // each block of K_BLOCK k's of the panel while it sits in L1, so the panel streams
          // from memory once, front to back; the accumulators wait in `acc` between blocks.
          for (int64_t k0 = 0; k0 < pr.K; k0 += K_BLOCK) {
            const int64_t k1 = std::min(pr.K, k0 + K_BLOCK);
            for (int64_t m0 = m_block; m0 < m_end; m0 += 6)
              panel_rows(pr.x + m0 * pr.K, pr.K, panel, std::min<int64_t>(6, m_end - m0), k0,
                         k1, acc + (m0 - m_block) * PANEL, k0 == 0);
          }
        } else {
          // Six rows per tile keep the FMA units busy; the block of rows meets each
          // sub-panel a block of MANY_K k's at a time, so that block's inputs (48 rows x
          // MANY_K floats) stay in L1 beside the sub-panel's values while every row tile
          // reads them; the accumulators wait in `acc` between blocks.
          for (int64_t sub = 0; sub < SUBS; ++sub)
            for (int64_t k0 = 0; k0 < pr.K; k0 += MANY_K)
              for (int64_t m0 = m_block; m0 < m_end; m0 += 6)
                sub_rows(pr.x + m0 * pr.K, pr.K, panel + sub * LANES,
                         std::min<int64_t>(6, m_end - m0), k0, std::min(pr.K, k0 + MANY_K),
                         acc + (m0 - m_block) * PANEL + sub * LANES, k0 == 0);
        }
        // Either way each output is one fused multiply-add per k, in order: the same bits
        // as a single row's.
        store(pr, acc, m_block, m_end - m_block, p);
      }
    }
  });
}

at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  weight.scalar_type() == at::kBFloat16,
              "bf16_pack: a bfloat16 weight [N, K] on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + PANEL - 1) / PANEL;
  at::Tensor padded = at::zeros({panels * PANEL, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  // [panels, sub, half, 8, K] -> [panels, K, sub, 8, half]: column 8 * half + i of a
  // sub-panel lands in slot 2 * i + half (`slot`)
  return padded.view({panels, SUBS, 2, LANES / 2, K})
      .permute({0, 4, 1, 3, 2})
      .contiguous()
      .view({panels, K, PANEL});
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_linear: x [M, K] float32 or bfloat16 on the CPU");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == PANEL && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) && packed.size(0) * PANEL >= N &&
                  packed.size(0) * PANEL < N + PANEL,
              "bf16_linear: a weight from bf16_pack with x's K columns and N outputs");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bf16_linear: bias [N]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const float* b = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  if (M == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    linear(Problem<float>{x32.data_ptr<float>(), w, b, out.data_ptr<float>(), M, N, K});
  } else {
    linear(Problem<c10::BFloat16>{x32.data_ptr<float>(), w, b, out.data_ptr<c10::BFloat16>(), M,
                                  N, K});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("bf16_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_linear", &bf16_linear);
}
