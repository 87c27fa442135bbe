// kiln runtime: y = x W^T (+ b) for bfloat16 x and W on CPUs with AVX512-BF16 but no AMX, at
// every row count: its pairs are a bf16 layer's only copy there (runtime/engine/layers/dense.py). At
// prefill sizes it matches or passes oneDNN's GEMM, so the weight is not held twice.
//
// Hand-written because oneDNN's bf16 GEMM, what torch runs on such a CPU, leaves a quarter of
// the core's bf16 dot-product rate unused at a decode step's row counts: SmolLM2-135M's
// projections at 32 rows reach 64-80% of it (a 2-core Zen 4 EPYC, one thread), and a step of
// 32 sequences there is bound by that arithmetic, not by the weight's bytes. This kernel keeps
// the dot-product units fed from registers (tests/benchmarks/runtime_linear.py compares both).
//
// Layout: `dpbf16_pack` reorders W [N, K] into panels of 64 output columns, [ceil(N/64),
// ceil(K/2), 64, 2] (zeros past N and past K): per pair of k's, each column's two weights side
// by side, the 32-bit lane that vdpbf16ps multiplies with the pair (x[k], x[k + 1]). A tile is
// R rows (5 at most) x the panel's 64 columns: per pair 4 weight loads, R broadcasts of x's pair
// and 4 R dot products into 4 R float32 accumulators held in registers. K goes in blocks of
// K_PAIRS pairs (the panel's block stays in L2 while every row tile reads it), and the
// accumulators wait in a float32 buffer between blocks (stored and reloaded exactly). The
// next panel is asked for while this one computes (see `linear`). Every
// output is the same sequence of vdpbf16ps over k pairs whatever the tile, so a row's result
// does not depend on the other rows of the call; it differs from oneDNN's only in the order
// of those dot products.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "dpbf16.h"

namespace {

constexpr int64_t PANEL = 64;     // output columns per panel: four vectors of 16
constexpr int64_t MAX_R = 5;      // rows per tile: 20 accumulators, 4 weights, a broadcast
constexpr int64_t K_PAIRS = 768;  // pairs of k per block: 192 KB of a panel
constexpr int64_t CHUNK_ROWS = 120;  // from here a call on several threads is split by rows
constexpr int64_t SPREAD_MIN_ROWS = 20;  // from here the next panel's lines are spread over tiles

bool dpbf16_ready() {
#if defined(KILN_DPBF16)
  return true;
#else
  return false;
#endif
}

#if defined(KILN_DPBF16)
// acc[r][0..63] (+)= sum over pairs [p0, p1) of x[r]'s pair . W's pair, for R rows of x (row
// stride ldx bf16, an even K) against one panel; `first` starts from zero.
// `next` (or null): the panel the call reads after this one, whose pairs [p0, p1) are asked
// into L2 alongside. `ask` (or null): `asks` cache lines from there on, asked into L1 and L2
// evenly over the pairs (this tile's share of the next panel).
template <int R>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t p0, int64_t p1,
                 float* acc_io, bool first, const uint16_t* next, const char* ask,
                 int64_t asks) {
  int64_t due = 0, left = asks;  // due: asks owed times the pair count, one made per count
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_io + r * PANEL + 16 * j);
  const uint16_t* w = panel + p0 * 2 * PANEL;
  for (int64_t p = p0; p < p1; ++p, w += 2 * PANEL) {
    if (next != nullptr) {
      const char* later = reinterpret_cast<const char*>(next + p * 2 * PANEL);
#pragma GCC unroll 4
      for (int line = 0; line < 4; ++line) _mm_prefetch(later + 64 * line, _MM_HINT_T1);
    }
    if (ask != nullptr) {
      for (due += asks; due >= p1 - p0 && left > 0; due -= p1 - p0, --left, ask += 64)
        _mm_prefetch(ask, _MM_HINT_T0);
    }
    __m512bh wv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) wv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 32 * j));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xb);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc_io + r * PANEL + 16 * j, acc[r][j]);
}

inline void rows_tile(int64_t rows, const uint16_t* x, int64_t ldx, const uint16_t* panel,
                      int64_t p0, int64_t p1, float* acc, bool first, const uint16_t* next,
                      const char* ask, int64_t asks) {
  switch (rows) {
    case 1: tile<1>(x, ldx, panel, p0, p1, acc, first, next, ask, asks); break;
    case 2: tile<2>(x, ldx, panel, p0, p1, acc, first, next, ask, asks); break;
    case 3: tile<3>(x, ldx, panel, p0, p1, acc, first, next, ask, asks); break;
    case 4: tile<4>(x, ldx, panel, p0, p1, acc, first, next, ask, asks); break;
    default: tile<MAX_R>(x, ldx, panel, p0, p1, acc, first, next, ask, asks); break;
  }
}

// out [M, N] = x [M, 2 KP] (bf16, even K) times the panels, bias (float32 [N] or null) added.
void linear(const uint16_t* x, int64_t M, int64_t KP, const uint16_t* packed, const float* bias,
            c10::BFloat16* out, int64_t N) {
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const int64_t ldx = 2 * KP;
  // Threads split the output columns, so each reads its own part of the weight. With more
  // than one thread, a call of more than CHUNK_ROWS rows (a prefill) is split by rows
  // instead, one run of rows a thread: a projection of few panels (9 for SmolLM2-135M's 576
  // outputs) leaves a thread idle a tenth of the time when split by columns.
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = threads > 1 && M > CHUNK_ROWS
                            ? ((M + threads - 1) / threads + MAX_R - 1) / MAX_R * MAX_R
                            : M;
  const int64_t chunks = M == 0 ? 0 : (M + chunk - 1) / chunk;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(chunk * PANEL);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item % panels, m_first = item / panels * chunk;
      const int64_t rows = std::min(chunk, M - m_first);  // this item's rows of x
      const uint16_t* xs = x + m_first * ldx;
      c10::BFloat16* outs = out + m_first * N;
      const uint16_t* panel = packed + p * KP * 2 * PANEL;
      // The next panel is asked for while this one computes. A single row streams the
      // weight: a pair's four lines of the next panel into L2 with each pair of this one (30
      // layers' projections of SmolLM2-135M, one thread, a 2-core Zen 4 EPYC: 12.2-12.7 ms vs
      // 14.7-15.7 with the hardware's prefetch and a prefetch 2 KB ahead in the panel,
      // 13.3-13.7 with the hardware's alone). From SPREAD_MIN_ROWS rows the first row tile
      // alone would wait on memory while the others compute from L2, so every tile asks
      // for its share of the next panel, paced over its pairs (weights of 40 layers read in
      // turn, so each comes from memory, same EPYC, 32 rows, medians: gate/up 0.577 ->
      // 0.548 ms, down 0.313 -> 0.279, q/k/v 0.197 -> 0.179; from cache 0.525, 0.263,
      // 0.168 either way; a 32-row decode step in the engine 64.9 -> 63.0 ms). Between 2 and
      // 19 rows every way of asking tried (in the panel, in bursts, spread) was neutral or
      // up to a fifth slower.
      const bool more = item + 1 < end && p + 1 < panels;  // the same rows' next panel
      const uint16_t* next = rows == 1 && more ? panel + KP * 2 * PANEL : nullptr;
      const bool spread = rows >= SPREAD_MIN_ROWS && more;
      const int64_t tiles = (rows + MAX_R - 1) / MAX_R;
      for (int64_t p0 = 0; p0 < KP; p0 += K_PAIRS) {
        const int64_t p1 = std::min(KP, p0 + K_PAIRS);
        const char* block = reinterpret_cast<const char*>(panel + (KP + p0) * 2 * PANEL);
        const int64_t lines = spread ? (p1 - p0) * 4 : 0;  // of the next panel's block
        for (int64_t m = 0, t = 0; m < rows; m += MAX_R, ++t) {
          const int64_t first_line = lines * t / tiles, last_line = lines * (t + 1) / tiles;
          rows_tile(std::min(MAX_R, rows - m), xs + m * ldx, ldx, panel, p0, p1,
                    acc.data() + m * PANEL, p0 == 0, next,
                    spread ? block + 64 * first_line : nullptr, last_line - first_line);
        }
      }
      const int64_t n0 = p * PANEL, width = std::min(PANEL, N - n0);
      for (int64_t m = 0; m < rows; ++m) {
        const float* a = acc.data() + m * PANEL;
        c10::BFloat16* row = outs + m * N + n0;
        for (int64_t c = 0; c < width; ++c)
          row[c] = kiln_simd::narrow<c10::BFloat16>(bias ? a[c] + bias[n0 + c] : a[c]);
      }
    }
  });
}
#endif

at::Tensor dpbf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  weight.scalar_type() == at::kBFloat16,
              "dpbf16_pack: a bfloat16 weight [N, K] on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + PANEL - 1) / PANEL, pairs = (K + 1) / 2;
  at::Tensor padded = at::zeros({panels * PANEL, 2 * pairs}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [panels, 64, pairs, 2] -> [panels, pairs, 64, 2]
  return padded.view({panels, PANEL, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor dpbf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(dpbf16_ready(),
              "dpbf16_linear: kiln's native kernels were built without AVX512-BF16 (a CPU "
              "without it, or KILN_NATIVE_MARCH naming one); ask "
              "kiln.runtime.native.dpbf16_kernels_available() first, as DenseLinear does");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "dpbf16_linear: x [M, K] bfloat16 on the CPU");
  const int64_t M = x.size(0), K = x.size(1), KP = (K + 1) / 2;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(1) == KP && packed.size(2) == PANEL && packed.size(3) == 2 &&
                  packed.is_contiguous() && packed.size(0) * PANEL >= N &&
                  packed.size(0) * PANEL < N + PANEL,
              "dpbf16_linear: a weight from dpbf16_pack with x's K columns and N outputs");
  at::Tensor xs = x.contiguous();
  if (K % 2) xs = at::constant_pad_nd(xs, {0, 1});  // the last pair's second x is zero
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "dpbf16_linear: bias [N]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(KILN_DPBF16)
  linear(reinterpret_cast<const uint16_t*>(xs.data_ptr<c10::BFloat16>()), M, KP,
         reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
         bias.has_value() ? b32.data_ptr<float>() : nullptr, out.data_ptr<c10::BFloat16>(), N);
#endif
  return out;
}

}  // namespace

namespace kiln_dpbf16 {

bool column_sums(const uint16_t* x, int64_t KP, const uint16_t* packed, int64_t g, float* out) {
#if defined(KILN_DPBF16)
  const uint16_t* w = packed + (g / 4) * KP * 2 * PANEL + (g % 4) * 32;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t p = 0; p < KP; ++p, w += 2 * PANEL) {
    int32_t pair;
    std::memcpy(&pair, x + 2 * p, sizeof(pair));
    const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
    acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_loadu_si512(w)), xb);
  }
  _mm512_storeu_ps(out, acc);
  return true;
#else
  (void)x, (void)KP, (void)packed, (void)g, (void)out;
  return false;
#endif
}

}  // namespace kiln_dpbf16

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("dpbf16_ready() -> bool", &dpbf16_ready);
  m.def("dpbf16_pack(Tensor weight) -> Tensor");
  m.def("dpbf16_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("dpbf16_pack", &dpbf16_pack);
  m.impl("dpbf16_linear", &dpbf16_linear);
}
