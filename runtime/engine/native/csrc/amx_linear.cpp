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
// `int4_amx_linear` (and `int8_amx_linear`, for W8A16's int8 codes, one byte a weight in the
// tiles' own order) is the same call for a W4A16 layer's group-wise int4 weight: per pair of
// blocks a thread dequantises the pair's codes into the tiles `amx_pack` would hold for the
// bf16 weight w = (u - 8) * scale + zero (one float32 FMA, rounded to nearest even bf16), in
// a buffer of its own, and runs the same tile loop over it: the result is amx_linear's on
// that bf16 weight, bit for bit (VCVTNE2PS2BF16 flushes a weight below 2^-126 in magnitude to
// zero where int4_dequant keeps it), while memory holds and streams half a byte a weight
// (`int4_amx_pack`: per pair and k-chunk two 256-byte tiles of codes, byte 2c + t of row j
// holding column c at k = 2j + t in its low nibble and column c + 8 in its high one, so one
// widening and two nibble masks give the two float vectors VCVTNE2PS2BF16 interleaves into a
// weight-tile row; scales and zeros as bf16 [pairs, groups, 2, 32]). Hand-written for the
// same reason as amx_linear, and because torch's int4 kernels multiply without the tile
// unit: at 8 to 32 rows kiln's AVX2 int4 kernel (int4_linear.cpp) ran 1.3-3x slower than
// amx_linear on the bf16 weight.
//
// The tile unit needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM), asked once by
// `amx_ready`; without AMX in the build (-march=native on a CPU without it) the ops say so.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

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

// The bf16 weight tiles of pair p, from `amx_pack`: read in place.
struct PackedTiles {
  struct Buffer {
    explicit Buffer(const PackedTiles&) {}
  };
  const uint16_t* w;
  int64_t chunks;
  const uint16_t* pair(int64_t p, Buffer&) const { return w + p * chunks * 2 * TILE; }
};

// A tile row of int4 codes (`int4_amx_pack`): 16 bytes, byte 2c + t holding column c at
// k = 2j + t in its low nibble and column c + 8 in its high one; lo / hi get u - 8 (exact).
struct Int4Codes {
  static constexpr int64_t ROW_BYTES = 16;
  static void row(const uint8_t* p, __m512& lo, __m512& hi) {
    const __m512i u =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i eight = _mm512_set1_epi32(8);
    lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(u, _mm512_set1_epi32(15)), eight));
    hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(u, 4), eight));
  }
};

// A tile row of int8 codes (`int8_amx_pack`): 32 bytes in the tile's own order, byte 2c + t
// column c at k = 2j + t, so the first 16 are columns 0-7 and the last 16 columns 8-15.
struct Int8Codes {
  static constexpr int64_t ROW_BYTES = 32;
  static void row(const uint8_t* p, __m512& lo, __m512& hi) {
    const auto* v = reinterpret_cast<const __m128i*>(p);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1)));
  }
};

// A group-wise integer weight's tiles (codes: `Codes`' layout, [pairs, chunks, 2, 16 rows]),
// dequantised pair by pair into the calling thread's buffer: w = code * scale + zero in one
// float32 FMA (code u - 8 for int4), rounded to nearest even bf16.
template <typename Codes>
struct QuantTiles {
  struct Buffer {
    explicit Buffer(const QuantTiles& source) : raw(source.chunks * 2 * TILE + 32) {}
    uint16_t* tiles() {  // 64-byte aligned, for whole-line stores
      const auto at = reinterpret_cast<uintptr_t>(raw.data());
      return reinterpret_cast<uint16_t*>((at + 63) & ~uintptr_t{63});
    }
    std::vector<uint16_t> raw;
  };
  const uint8_t* codes;
  const uint16_t* sz;  // bf16 [pairs, groups, 2, 32]: the pair's 32 scales, then its zeros
  int64_t chunks, group;

  const uint16_t* pair(int64_t p, Buffer& buffer) const {
    constexpr int64_t TILE_BYTES = 16 * Codes::ROW_BYTES;
    const int64_t groups = chunks * CHUNK / group, per_group = group / CHUNK;
    const uint8_t* in = codes + p * chunks * 2 * TILE_BYTES;
    uint16_t* out = buffer.tiles();
    // lane l of a half-row vector: column l / 2 (of the block's first or second eight)
    const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i spread_hi = _mm512_add_epi32(spread, _mm512_set1_epi32(8));
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* held = sz + (p * groups + g) * 2 * PAIR;
      for (int b = 0; b < 2; ++b) {
        const __m512 s = load16(reinterpret_cast<const c10::BFloat16*>(held + b * BLOCK));
        const __m512 z = load16(reinterpret_cast<const c10::BFloat16*>(held + PAIR + b * BLOCK));
        const __m512 s_lo = _mm512_permutexvar_ps(spread, s);
        const __m512 s_hi = _mm512_permutexvar_ps(spread_hi, s);
        const __m512 z_lo = _mm512_permutexvar_ps(spread, z);
        const __m512 z_hi = _mm512_permutexvar_ps(spread_hi, z);
        for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
          const uint8_t* rows = in + (c * 2 + b) * TILE_BYTES;
          uint16_t* tile = out + (c * 2 + b) * TILE;
          for (int j = 0; j < 16; ++j) {
            __m512 lo, hi;
            Codes::row(rows + j * Codes::ROW_BYTES, lo, hi);
            const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s_hi, z_hi),
                                                   _mm512_fmadd_ps(lo, s_lo, z_lo));
            _mm512_store_si512(tile + j * 32, reinterpret_cast<__m512i>(w));
          }
        }
      }
    }
    return out;
  }
};

// Rows m0 .. M - 1 against pair p's weight tiles, 32 rows (four accumulator tiles) at a time.
void pair_rows(const Problem& pr, const uint16_t* pair, int64_t p, float* acc, int& low_now,
               int& high_now) {
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

// Source gives each pair's tiles: `PackedTiles`, or `QuantTiles` (above) dequantising them
// into the calling thread's buffer.
template <typename Source>
void linear(const Problem& pr, const Source& source) {
  const int64_t pairs = (pr.N + PAIR - 1) / PAIR;
  // Threads split the pairs, so each streams its own part of the weight.
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[2 * M_TILE * PAIR];
    int low_now = -1, high_now = -1;
    typename Source::Buffer buffer(source);
    for (int64_t p = begin; p < end; ++p) {
      pair_rows(pr, source.pair(p, buffer), p, acc, low_now, high_now);
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
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  linear(Problem{reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()),
                 bias.has_value() ? b32.data_ptr<float>() : nullptr,
                 reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), M, N, chunks},
         PackedTiles{w, chunks});
#endif
  return out;
}

// A group size the tile layouts hold: whole k-chunks per group, whole groups per row.
void check_group(const char* op, int64_t K, int64_t group) {
  TORCH_CHECK(group > 0 && group % CHUNK == 0 && K % group == 0, op,
              ": a group size that is a multiple of 32 and divides K");
}

// scale and zero (float32 [N, K / group], each exact in bf16; zero may be absent: zeros) as
// bf16 [pairs, groups, 2, 32], N padded to a pair with zero scales and zeros.
at::Tensor pack_scales(const char* op, const at::Tensor& scale, const at::Tensor* zero,
                       int64_t N, int64_t groups) {
  const int64_t pairs = (N + PAIR - 1) / PAIR;
  at::Tensor held = at::zeros({pairs * PAIR, groups, 2}, scale.options().dtype(at::kFloat));
  for (int64_t i = 0; i < (zero ? 2 : 1); ++i) {
    const at::Tensor& t = i == 0 ? scale : *zero;
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == N &&
                    t.size(1) == groups,
                op, ": float32 scale and zero [N, K / group]");
    held.narrow(0, 0, N).select(2, i).copy_(t);
  }
  // [pair, column, group, s/z] -> [pair, group, s/z, column]
  at::Tensor ordered = held.view({pairs, PAIR, groups, 2}).permute({0, 2, 3, 1});
  at::Tensor sz = ordered.to(at::kBFloat16);
  TORCH_CHECK(sz.to(at::kFloat).equal(ordered), op,
              ": scales and zeros must be exact in bfloat16 (round them as the layer holds them)");
  return sz.contiguous();
}

// codes: unsigned int4 codes u [N, K] as uint8 (0-15); scale, zero: float32 [N, K / group],
// each exact in bf16. Returns (codes, scales and zeros) in int4_amx_linear's layout (above).
std::tuple<at::Tensor, at::Tensor> int4_amx_pack(const at::Tensor& codes, const at::Tensor& scale,
                                                 const at::Tensor& zero, int64_t group) {
  check_ready("int4_amx_pack");
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.scalar_type() == at::kByte,
              "int4_amx_pack: uint8 codes [N, K] on the CPU");
  const int64_t N = codes.size(0), K = codes.size(1);
  check_group("int4_amx_pack", K, group);
  at::Tensor sz = pack_scales("int4_amx_pack", scale, &zero, N, K / group);
  const int64_t pairs = (N + PAIR - 1) / PAIR, chunks = K / CHUNK;
  at::Tensor u = at::zeros({pairs * PAIR, K}, codes.options());
  u.narrow(0, 0, N).copy_(codes.bitwise_and(15));
  // [pair, block, half, column, chunk, k-pair, t] -> [pair, chunk, block, k-pair, column, t, half]
  at::Tensor ordered = u.view({pairs, 2, 2, 8, chunks, CHUNK / 2, 2})
                           .permute({0, 4, 1, 5, 3, 6, 2})
                           .contiguous()
                           .view({pairs, chunks, 2, 16, 16, 2});
  at::Tensor packed = ordered.select(5, 0).bitwise_or(ordered.select(5, 1).bitwise_left_shift(4));
  return {packed.contiguous(), sz};
}

// codes: signed int8 codes [N, K]; scale: float32 [N, K / group], each exact in bf16 (zeros:
// none). Returns (codes, scales and zeros) in int8_amx_linear's layout: the tile order
// amx_pack gives a bf16 weight, one byte a weight.
std::tuple<at::Tensor, at::Tensor> int8_amx_pack(const at::Tensor& codes, const at::Tensor& scale,
                                                 int64_t group) {
  check_ready("int8_amx_pack");
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.scalar_type() == at::kChar,
              "int8_amx_pack: int8 codes [N, K] on the CPU");
  const int64_t N = codes.size(0), K = codes.size(1);
  check_group("int8_amx_pack", K, group);
  at::Tensor sz = pack_scales("int8_amx_pack", scale, nullptr, N, K / group);
  const int64_t pairs = (N + PAIR - 1) / PAIR, chunks = K / CHUNK;
  at::Tensor padded = at::zeros({pairs * PAIR, K}, codes.options());
  padded.narrow(0, 0, N).copy_(codes);
  // [pair, block, column, chunk, k-pair, t] -> [pair, chunk, block, k-pair, column, t]
  at::Tensor packed = padded.view({pairs, 2, BLOCK, chunks, CHUNK / 2, 2})
                          .permute({0, 3, 1, 4, 2, 5})
                          .contiguous();
  return {packed, sz};
}

// y = x W^T on a weight from int4_amx_pack (BITS 4) or int8_amx_pack (BITS 8).
template <int BITS>
at::Tensor quant_amx_linear(const char* op, const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& sz, int64_t N, int64_t group) {
  check_ready(op);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16, op,
              ": x [M, K] bfloat16 on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  check_group(op, K, group);
  const int64_t chunks = K / CHUNK, pairs = (N + PAIR - 1) / PAIR;
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 &&
                  codes.numel() == pairs * chunks * 2 * 16 * (4 * BITS) &&
                  codes.dim() >= 2 && codes.size(0) == pairs && codes.size(1) == chunks,
              op, ": codes from its pack with x's K columns and N outputs");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 4 &&
                  sz.size(0) == pairs && sz.size(1) == K / group,
              op, ": scales and zeros from its pack with the same group");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef KILN_AMX
  at::Tensor xc = x.contiguous();
  using Codes = std::conditional_t<BITS == 4, Int4Codes, Int8Codes>;
  const QuantTiles<Codes> source{static_cast<const uint8_t*>(codes.data_ptr()),
                                 reinterpret_cast<const uint16_t*>(sz.data_ptr<c10::BFloat16>()),
                                 chunks, group};
  linear(Problem{reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()), nullptr,
                 reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), M, N, chunks},
         source);
#endif
  return out;
}

at::Tensor int4_amx_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                           int64_t N, int64_t group) {
  return quant_amx_linear<4>("int4_amx_linear", x, codes, sz, N, group);
}

at::Tensor int8_amx_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                           int64_t N, int64_t group) {
  return quant_amx_linear<8>("int8_amx_linear", x, codes, sz, N, group);
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
  m.def("int4_amx_pack(Tensor codes, Tensor scale, Tensor zero, int group) -> (Tensor, Tensor)");
  m.def("int4_amx_linear(Tensor x, Tensor codes, Tensor sz, int N, int group) -> Tensor");
  m.def("int8_amx_pack(Tensor codes, Tensor scale, int group) -> (Tensor, Tensor)");
  m.def("int8_amx_linear(Tensor x, Tensor codes, Tensor sz, int N, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
  m.impl("int4_amx_pack", &int4_amx_pack);
  m.impl("int4_amx_linear", &int4_amx_linear);
  m.impl("int8_amx_pack", &int8_amx_pack);
  m.impl("int8_amx_linear", &int8_amx_linear);
}
