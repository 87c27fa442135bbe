// kiln runtime: y = x W^T (+ b) for bfloat16 x and W on CPUs with AMX, at decode-sized row
// counts (1 to a few hundred rows).
//
// Hand-written because oneDNN's bf16 GEMM, the only AMX GEMM torch 2.13 reaches on a CPU, pays
// a fixed cost per call and reads a small projection's weight at 6-8 GB/s when only a few
// rows meet it, where a stream of tile loads reaches the core's read bandwidth: SmolLM2-135M's
// 121 projections of a decode step, distinct weights, one thread, a 2-core Xeon with AMX, at
// 1 / 8 / 32 / 64 rows 19-25 / 24-25 / 28-32 / 39-45 ms here against 26-36 / 33-38 / 40-45 /
// 47-51 ms on oneDNN's packed weight (tests/benchmarks/runtime_linear.py measures it in place).
// From ~128 rows (prefill) oneDNN's blocking wins and DenseLinear hands it the call.
//
// Layout: `amx_pack` reorders W [N, K] into pairs of 16-column blocks, each k-chunk of 32
// values of a block one 1 KB tile in the pair-interleaved order TDPBF16PS reads (16 rows of
// two consecutive k's for each of 16 columns): [ceil(N/32), ceil(K/32), 2, 16, 16, 2], zeros
// past N and K. A call streams the packed weight front to back, once: per pair of blocks it
// keeps a 32-row x 32-column accumulator in four tiles while x's rows (read in place, 32 k's
// a tile) meet each k-chunk's two weight tiles. Every output sums its k-chunks in order from
// zero, so a row's result does not depend on the other rows of the call.
//
// The tile unit needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM), asked once by
// `amx_ready`; without AMX in the build (-march=native on a CPU without it) the ops say so.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "amx.h"
#include "simd.h"

namespace {

using namespace kiln_simd;
#ifdef KILN_AMX
using kiln_amx::permitted;
using kiln_amx::TileConfig;
#endif

constexpr int64_t BLOCK = 16;   // output columns per weight tile
constexpr int64_t PAIR = 32;    // output columns per accumulator (two weight tiles)
constexpr int64_t CHUNK = 32;   // k's per tile
constexpr int64_t M_TILE = 16;  // rows per accumulator tile
constexpr int64_t TILE = BLOCK * CHUNK;  // bf16 values per weight tile

#ifdef KILN_AMX
// Tiles: 0-1 rows 0-15 of the pair's two blocks, 2-3 rows 16-31; 4-5 x's rows 0-15 and 16-31;
// 6-7 the two weight tiles. `low` and `high` rows in each half (high may be 0).
void configure(int low, int high) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  c.rows[0] = c.rows[1] = c.rows[4] = static_cast<uint8_t>(low);
  const uint8_t upper = static_cast<uint8_t>(high > 0 ? high : 1);
  c.rows[2] = c.rows[3] = c.rows[5] = upper;
  _tile_loadconfig(&c);
}

struct Problem {
  const uint16_t* x;  // [M, Kp] bf16
  const uint16_t* w;  // amx_pack layout
  const float* bias;  // float32 [N] or nullptr
  uint16_t* out;      // [M, N] bf16
  int64_t M, N, chunks;
};

// acc [rows, 32] (row stride 32) of pair p, bias added, rounded to bf16 into rows m0 ...
void store(const Problem& pr, const float* acc, int64_t m0, int64_t rows, int64_t p) {
  const int64_t n0 = p * PAIR, width = std::min<int64_t>(PAIR, pr.N - n0);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* row = pr.out + (m0 + r) * pr.N + n0;
    const float* a = acc + r * PAIR;
    if (width == PAIR) {
      __m512 lo = _mm512_load_ps(a), hi = _mm512_load_ps(a + 16);
      if (pr.bias != nullptr) {
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(pr.bias + n0));
        hi = _mm512_add_ps(hi, _mm512_loadu_ps(pr.bias + n0 + 16));
      }
      // round to nearest even, NaN kept: as `narrow`
      _mm512_storeu_si512(row, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    } else {
      for (int64_t c = 0; c < width; ++c) {
        row[c] = narrow<c10::BFloat16>(pr.bias ? a[c] + pr.bias[n0 + c] : a[c]).x;
      }
    }
  }
}

// acc [rows, 32] (row stride 32) = x's rows against one pair of blocks: tiles 0-1 (and 2-3
// for rows past 16: `high`) summed chunk by chunk in order from zero, as configured.
void accumulate(const uint16_t* x, const uint16_t* pair, int64_t chunks, bool high, float* acc) {
  const char* xa = reinterpret_cast<const char*>(x);
  const int64_t ldx = chunks * CHUNK * 2;  // bytes per row of x
  _tile_zero(0);
  _tile_zero(1);
  if (high) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* b = pair + c * 2 * TILE;
    _tile_loadd(4, xa + c * CHUNK * 2, ldx);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + TILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (high) {
      _tile_loadd(5, xa + M_TILE * ldx + c * CHUNK * 2, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, PAIR * 4);
  _tile_stored(1, acc + BLOCK, PAIR * 4);
  if (high) {
    _tile_stored(2, acc + M_TILE * PAIR, PAIR * 4);
    _tile_stored(3, acc + M_TILE * PAIR + BLOCK, PAIR * 4);
  }
}

void linear(const Problem& pr) {
  const int64_t pairs = (pr.N + PAIR - 1) / PAIR;
  // Threads split the pairs, so each streams its own part of the weight.
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[2 * M_TILE * PAIR];
    int low_now = -1, high_now = -1;
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* pair = pr.w + p * pr.chunks * 2 * TILE;
      for (int64_t m0 = 0; m0 < pr.M; m0 += 2 * M_TILE) {
        const int rows = static_cast<int>(std::min<int64_t>(2 * M_TILE, pr.M - m0));
        const int low = std::min<int>(M_TILE, rows), high = rows - low;
        if (low != low_now || high != high_now) {
          configure(low, high);
          low_now = low;
          high_now = high;
        }
        accumulate(pr.x + m0 * pr.chunks * CHUNK, pair, pr.chunks, high > 0, acc);
        store(pr, acc, m0, rows, p);
      }
    }
    _tile_release();
  });
}
#endif

bool amx_ready() {
#ifdef KILN_AMX
  return permitted();
#else
  return false;
#endif
}

void check_ready(const char* op) {
  TORCH_CHECK(amx_ready(), op,
              ": this build has no AMX kernel (a CPU without AMX-BF16, or the kernel refused the "
              "tile unit); use DenseLinear, which falls back to oneDNN");
}

at::Tensor amx_pack(const at::Tensor& weight) {
  check_ready("amx_pack");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  weight.scalar_type() == at::kBFloat16,
              "amx_pack: a bfloat16 weight [N, K] on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t pairs = (N + PAIR - 1) / PAIR, chunks = (K + CHUNK - 1) / CHUNK;
  at::Tensor padded = at::zeros({pairs * PAIR, chunks * CHUNK}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [pair, block, column, chunk, k-pair, 2] -> [pair, chunk, block, k-pair, column, 2]
  return padded.view({pairs, 2, BLOCK, chunks, CHUNK / 2, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous();
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      const std::optional<at::Tensor>& bias) {
  check_ready("amx_linear");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "amx_linear: x [M, K] bfloat16 on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 6 &&
                  packed.is_contiguous() && packed.size(1) * CHUNK >= K &&
                  packed.size(1) * CHUNK < K + CHUNK && packed.size(0) * PAIR >= N &&
                  packed.size(0) * PAIR < N + PAIR,
              "amx_linear: a weight from amx_pack with x's K columns and N outputs");
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "amx_linear: bias [N]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef KILN_AMX
  const int64_t chunks = packed.size(1);
  at::Tensor xc = x.contiguous();
  if (chunks * CHUNK != K) xc = at::constant_pad_nd(xc, {0, chunks * CHUNK - K});  // zero k's
  linear(Problem{reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                 bias.has_value() ? b32.data_ptr<float>() : nullptr,
                 reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), M, N, chunks});
#endif
  return out;
}

}  // namespace

namespace kiln_amx {

bool pair_row(const uint16_t* x, int64_t chunks, const uint16_t* tiles, int64_t pair,
              float* out) {
#ifdef KILN_AMX
  if (!permitted()) return false;
  configure(1, 0);  // the tiles of a one-row call (any row of a call sums alike)
  accumulate(x, tiles + pair * chunks * 2 * TILE, chunks, false, out);
  _tile_release();
  return true;
#else
  (void)x, (void)chunks, (void)tiles, (void)pair, (void)out;
  return false;
#endif
}

}  // namespace kiln_amx

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
}
