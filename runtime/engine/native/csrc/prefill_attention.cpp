// kiln runtime: causal self-attention of a whole prompt chunk (prefill) in bf16, on AMX tiles
// or on AVX512-BF16 dot products.
//
// Hand-written because the only fused attention torch 2.13 runs on a CPU (the flash kernel
// behind scaled_dot_product_attention) takes ~0.3 ms per layer for a 128-token chunk of
// SmolLM2-135M (9 query heads on 3 KV heads, head_dim 64): 148 ms of a ~750 ms prefill step
// of 16 prompts (one thread, a 2-core Xeon with AMX), for ~9 MFLOP a call; on a 2-core Zen 4
// EPYC (AVX512-BF16, no AMX) 0.71 ms a call, 85 ms of a ~640 ms step of 4 prompts.
//
// Per KV head: its keys are packed into pair-interleaved blocks (16 keys x 32 dims: per pair
// of dims, the 16 keys' two values side by side), its values likewise (32 keys x 16 dims: per
// pair of keys, the 16 dims' two values side by side). Those are the tiles TDPBF16PS reads as
// its second operand, and each 64-byte row of one is the vector VDPBF16PS multiplies with a
// broadcast pair of the first operand, so both kernels read the same packing. Per query head
// of its group and block of 16 queries: the scores against every key block up to the
// diagonal (float32 sums), the causal softmax in float32 (max subtracted, exp, row sums of
// the float32 exponentials), the probabilities rounded to bf16 (as torch's flash kernel rounds
// them for its second product), probabilities x values (float32 sums), each row divided by
// its sum and rounded to bf16. A query's result depends only on its own chunk.
//
// `amx_prefill_attention` runs the two products on AMX tiles, `dpbf16_prefill_attention` on
// AVX512-BF16 (register tiles of 4 queries x 64 keys, then 4 queries x 64 dims); they differ
// only in the order of the float32 sums.
//
// q [T, H, D], k and v [T, KVH, D] bfloat16 (rows at any stride, heads and dims contiguous:
// views of the stacked qkv projection), H a multiple of KVH, D a multiple of 64; the result
// is [T, H * D] bfloat16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "dpbf16.h"
#include "simd.h"

namespace {

using namespace kiln_simd;

constexpr int64_t Q_BLOCK = 16;   // queries per block (an accumulator tile's rows)
constexpr int64_t K_BLOCK = 16;   // keys per key block (score columns)
constexpr int64_t V_CHUNK = 32;   // keys per value block (the second product's k)
constexpr int64_t TILE = 512;     // bf16 values per block (16 rows of 64 bytes)

struct Chunk {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  int64_t q_row, k_row, v_row;  // elements from one token to the next
  uint16_t* out;
  int64_t T, H, KVH, D;
  float scale;
};

#ifdef KILN_DPBF16
// KV head h's keys as blocks [ceil(T/16)][D/32][16 dim pairs][16 keys][2], zeros past T: each
// block row gathers one pair of dims from 16 keys.
void pack_keys(const Chunk& c, int64_t h, uint16_t* packed) {
  const int64_t blocks = (c.T + K_BLOCK - 1) / K_BLOCK, chunks = c.D / 32;
  // key n's pair r sits n * k_row / 2 + r 32-bit words past the block's first
  const __m512i stride = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int>(c.k_row / 2)));
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t left = c.T - kb * K_BLOCK;
    const __mmask16 live = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    for (int64_t dc = 0; dc < chunks; ++dc) {
      uint16_t* tile = packed + (kb * chunks + dc) * TILE;
      const uint16_t* first = c.k + kb * K_BLOCK * c.k_row + h * c.D + dc * 32;
      for (int64_t r = 0; r < 16; ++r) {
        const __m512i pairs =
            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, stride, first + 2 * r, 4);
        _mm512_storeu_si512(tile + r * 32, pairs);
      }
    }
  }
}

// KV head h's values as blocks [ceil(T/32)][D/16][16 key pairs][16 dims][2], zeros past T:
// each block row interleaves two keys' 16 dims.
void pack_values(const Chunk& c, int64_t h, uint16_t* packed) {
  const int64_t chunks = (c.T + V_CHUNK - 1) / V_CHUNK, blocks = c.D / 16;
  auto row = [&](int64_t key, int64_t db) {
    if (key >= c.T) return _mm512_setzero_si512();
    const __m256i dims = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(c.v + key * c.v_row + h * c.D + db * 16));
    return _mm512_cvtepu16_epi32(dims);
  };
  for (int64_t kc = 0; kc < chunks; ++kc)
    for (int64_t db = 0; db < blocks; ++db) {
      uint16_t* tile = packed + (kc * blocks + db) * TILE;
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t key = kc * V_CHUNK + 2 * r;
        const __m512i second = _mm512_slli_epi32(row(key + 1, db), 16);
        const __m512i pairs = _mm512_or_si512(row(key, db), second);
        _mm512_storeu_si512(tile + r * 32, pairs);
      }
    }
}

// Row i of a block: scores s[0 .. width) (float32, unscaled) of which the first `valid` are
// causal; the probabilities (bf16, zeros past `valid`) into p, the sum of their float32
// values returned.
float softmax_row(const float* s, int64_t valid, int64_t width, float scale, uint16_t* p) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < valid; j += 16) {
    const int64_t left = valid - j;
    const __mmask16 live = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, s + j));
  }
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  const __m512 factor = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t left = std::max<int64_t>(0, valid - j);
    const __mmask16 live = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 shifted = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), peak);
    const __m512 x = _mm512_mul_ps(shifted, factor);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(x));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_reduce_add_ps(sum);
}

// out[i][16 j ..] = sum over the k of `steps` blocks of x_i's pairs . vectors, for R rows of x
// and NB vectors of 16 lanes: x_i's pair for row r of block b sits at x + i ldx + 32 b + 2 r,
// vector j's at blocks + b block_stride + j vector_stride + 32 r. Each lane is one float32
// accumulator taking a VDPBF16PS per pair, in order.
template <int R, int NB>
inline void dot_tile(const uint16_t* x, int64_t ldx, const uint16_t* blocks, int64_t steps,
                     int64_t block_stride, int64_t vector_stride, float* out, int64_t ldo) {
  __m512 acc[R][NB];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < steps; ++b) {
    const uint16_t* block = blocks + b * block_stride;
    for (int64_t r = 0; r < 16; ++r) {
      __m512bh w[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(block + j * vector_stride + r * 32));
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, x + i * ldx + b * 32 + 2 * r, sizeof(pair));
        const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xb);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + i * ldo + 16 * j, acc[i][j]);
}

// dot_tile over `rows` rows of x, 4 at a time, against NB vectors
template <int NB>
inline void dot_rows(const uint16_t* x, int64_t ldx, int rows, const uint16_t* blocks,
                     int64_t steps, int64_t block_stride, int64_t vector_stride, float* out,
                     int64_t ldo) {
  for (int i = 0; i < rows; i += 4) {
    const uint16_t* xi = x + i * ldx;
    float* oi = out + i * ldo;
    switch (std::min(4, rows - i)) {
      case 1: dot_tile<1, NB>(xi, ldx, blocks, steps, block_stride, vector_stride, oi, ldo); break;
      case 2: dot_tile<2, NB>(xi, ldx, blocks, steps, block_stride, vector_stride, oi, ldo); break;
      case 3: dot_tile<3, NB>(xi, ldx, blocks, steps, block_stride, vector_stride, oi, ldo); break;
      default: dot_tile<4, NB>(xi, ldx, blocks, steps, block_stride, vector_stride, oi, ldo);
    }
  }
}

// The two products of one block of `rows` queries on AVX512-BF16, in register tiles of 4 rows
// x 64 columns (keys for the scores, dims for the weighted values).
struct DotProducts {
  static void start(int) {}
  static void finish() {}

  // scores [rows][width] of queries q (row stride q_row) against key blocks [0, key_blocks)
  static void scores(const uint16_t* q, int64_t q_row, int rows, const uint16_t* keys,
                     int64_t chunks, int64_t key_blocks, float* s, int64_t width) {
    const int64_t stride = chunks * TILE;  // from one key block to the next
    int64_t kb = 0;
    for (; kb + 4 <= key_blocks; kb += 4)
      dot_rows<4>(q, q_row, rows, keys + kb * stride, chunks, TILE, stride, s + kb * 16, width);
    const uint16_t* rest = keys + kb * stride;
    switch (key_blocks - kb) {
      case 1: dot_rows<1>(q, q_row, rows, rest, chunks, TILE, stride, s + kb * 16, width); break;
      case 2: dot_rows<2>(q, q_row, rows, rest, chunks, TILE, stride, s + kb * 16, width); break;
      case 3: dot_rows<3>(q, q_row, rows, rest, chunks, TILE, stride, s + kb * 16, width); break;
      default: break;
    }
  }

  // acc [rows][64] = probabilities [rows][used of width] x values' dims [16 d0, 16 d0 + 64)
  static void weigh(const uint16_t* p, int64_t width, int rows, int64_t used,
                    const uint16_t* values, int64_t dim_blocks, int64_t d0, float* acc) {
    dot_rows<4>(p, width, rows, values + d0 * TILE, used / V_CHUNK, dim_blocks * TILE, TILE,
                acc, 64);
  }
};
#endif

#ifdef KILN_AMX
using kiln_amx::TileConfig;

// The two products of one block of `rows` queries, on AMX tiles: 0-3 accumulators and 4 the
// queries or probabilities (`rows` rows each), 5-6 keys or values (16 rows).
struct Tiles {
  static int& configured() {
    thread_local int rows = -1;
    return rows;
  }

  static void start(int rows) {
    if (rows == configured()) return;
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    for (int t = 0; t < 5; ++t) c.rows[t] = static_cast<uint8_t>(rows);
    _tile_loadconfig(&c);
    configured() = rows;
  }

  static void finish() {
    _tile_release();
    configured() = -1;
  }

  static void scores(const uint16_t* q, int64_t q_row, int, const uint16_t* keys,
                     int64_t chunks, int64_t key_blocks, float* s, int64_t width) {
    const char* qb = reinterpret_cast<const char*>(q);
    for (int64_t kb = 0; kb < key_blocks; ++kb) {
      _tile_zero(0);
      for (int64_t dc = 0; dc < chunks; ++dc) {
        _tile_loadd(4, qb + dc * 64, q_row * 2);
        _tile_loadd(5, keys + (kb * chunks + dc) * TILE, 64);
        _tile_dpbf16ps(0, 4, 5);
      }
      _tile_stored(0, s + kb * K_BLOCK, width * 4);
    }
  }

  static void weigh(const uint16_t* p, int64_t width, int, int64_t used,
                    const uint16_t* values, int64_t dim_blocks, int64_t d0, float* acc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc * V_CHUNK < used; ++kc) {
      const uint16_t* tiles = values + (kc * dim_blocks + d0) * TILE;
      _tile_loadd(4, p + kc * V_CHUNK, width * 2);
      _tile_loadd(5, tiles, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, tiles + TILE, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, tiles + 2 * TILE, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, tiles + 3 * TILE, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, acc, 256);
    _tile_stored(1, acc + 16, 256);
    _tile_stored(2, acc + 32, 256);
    _tile_stored(3, acc + 48, 256);
  }
};
#endif

#ifdef KILN_DPBF16
template <typename Products>
void attend(const Chunk& c) {
  const int64_t group = c.H / c.KVH, dim_chunks = c.D / 32, dim_blocks = c.D / 16;
  const int64_t key_blocks = (c.T + K_BLOCK - 1) / K_BLOCK;
  const int64_t value_chunks = (c.T + V_CHUNK - 1) / V_CHUNK;
  const int64_t width = value_chunks * V_CHUNK;  // score and probability columns, padded
  at::parallel_for(0, c.KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> keys(key_blocks * dim_chunks * TILE);
    std::vector<uint16_t> values(value_chunks * dim_blocks * TILE);
    std::vector<float> scores(Q_BLOCK * width);
    std::vector<uint16_t> probs(Q_BLOCK * width);
    alignas(64) float acc[Q_BLOCK * 64];
    float sums[Q_BLOCK];
    for (int64_t h = begin; h < end; ++h) {
      pack_keys(c, h, keys.data());
      pack_values(c, h, values.data());
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = h * group + g;
        for (int64_t t0 = 0; t0 < c.T; t0 += Q_BLOCK) {
          const int rows = static_cast<int>(std::min<int64_t>(Q_BLOCK, c.T - t0));
          Products::start(rows);
          const int64_t last = t0 + rows - 1;  // the block's last query sees keys 0 .. last
          Products::scores(c.q + t0 * c.q_row + head * c.D, c.q_row, rows, keys.data(),
                           dim_chunks, last / K_BLOCK + 1, scores.data(), width);
          const int64_t used = (last / V_CHUNK + 1) * V_CHUNK;  // columns the product reads
          for (int i = 0; i < rows; ++i) {
            sums[i] = softmax_row(scores.data() + i * width, t0 + i + 1, used, c.scale,
                                  probs.data() + i * width);
          }
          for (int64_t d0 = 0; d0 < dim_blocks; d0 += 4) {  // 64 dims at a time
            Products::weigh(probs.data(), width, rows, used, values.data(), dim_blocks, d0, acc);
            for (int i = 0; i < rows; ++i) {
              const __m512 inv = _mm512_set1_ps(1.f / sums[i]);
              uint16_t* target = c.out + (t0 + i) * c.H * c.D + head * c.D + d0 * 16;
              for (int v = 0; v < 4; ++v) {
                const __m512 o = _mm512_mul_ps(_mm512_load_ps(acc + i * 64 + 16 * v), inv);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(target + 16 * v),
                                    reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(o)));
              }
            }
          }
        }
      }
    }
    Products::finish();
  });
}
#endif

void check_view(const at::Tensor& t, const char* op, const char* name, int64_t tokens,
                int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == 3 &&
                  t.size(0) == tokens && t.size(2) == dim && t.stride(2) == 1 &&
                  t.stride(1) == dim,
              op, ": ", name, " [T, heads, D] bfloat16 on the CPU, heads and dims contiguous");
}

enum class Unit { Tiles, DotProducts };

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale, Unit unit) {
  const char* op = unit == Unit::Tiles ? "amx_prefill_attention" : "dpbf16_prefill_attention";
  TORCH_CHECK(q.dim() == 3, op, ": q [T, H, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  check_view(q, op, "q", T, D);
  check_view(k, op, "k", T, D);
  check_view(v, op, "v", T, D);
  const int64_t KVH = k.size(1);
  TORCH_CHECK(v.size(1) == KVH && KVH > 0 && H % KVH == 0 && D % 64 == 0 && D > 0, op,
              ": query heads a multiple of KV heads, head_dim a multiple of 64");
  at::Tensor out = at::empty({T, H * D}, q.options());
#ifdef KILN_DPBF16
  const Chunk chunk{reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()),
                    reinterpret_cast<const uint16_t*>(k.data_ptr<c10::BFloat16>()),
                    reinterpret_cast<const uint16_t*>(v.data_ptr<c10::BFloat16>()),
                    q.stride(0), k.stride(0), v.stride(0),
                    reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), T, H, KVH, D,
                    static_cast<float>(scale)};
#endif
  if (unit == Unit::Tiles) {
#if defined(KILN_AMX) && defined(KILN_DPBF16)
    TORCH_CHECK(kiln_amx::permitted(), op, ": the OS refused the tile unit");
    if (T > 0) attend<Tiles>(chunk);
#else
    TORCH_CHECK(false, op, ": this build has no AMX kernel; ask "
                "kiln.runtime.native.amx_kernels_available() first");
#endif
  } else {
#ifdef KILN_DPBF16
    if (T > 0) attend<DotProducts>(chunk);
#else
    TORCH_CHECK(false, op, ": this build has no AVX512-BF16 kernel; ask "
                "kiln.runtime.native.dpbf16_kernels_available() first");
#endif
  }
  return out;
}

at::Tensor amx_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale) {
  return prefill_attention(q, k, v, scale, Unit::Tiles);
}

at::Tensor dpbf16_prefill_attention(const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v, double scale) {
  return prefill_attention(q, k, v, scale, Unit::DotProducts);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("amx_prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("dpbf16_prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("amx_prefill_attention", &amx_prefill_attention);
  m.impl("dpbf16_prefill_attention", &dpbf16_prefill_attention);
}
