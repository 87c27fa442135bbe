// kiln runtime: y = x W^T for a group-wise int4 weight at decode-sized batches, on AVX2 CPUs.
//
// Hand-written because torch's int4 weight kernel (`_weight_int4pack_mm_for_cpu`) is slow on
// CPUs without AVX-512: on a 2-core Zen 3 EPYC (AVX2), one thread, a one-row call on a
// 3072x576 weight reads its 0.9 MB at ~2.6 GB/s where one thread reads ~10 GB/s, and a W4A16
// model decoded about as slowly as the same model in bf16 there.
//
// At one row the work is widening codes, not reading them: widening each code to float32
// and multiplying in float32 (kiln's first version of this kernel) took 7 vector
// instructions per 16 weights and ran at the CPU's vector ports, not its memory (a 3072x576
// weight read at the same speed from cache as from memory). Here each activation row enters
// as 16-bit integers, one power-of-two unit per group of the weight: the group's largest
// magnitude sets the unit so that it fills 15 bits, and each value is rounded to it (bf16
// values within 2^7 of the group's largest are exact; smaller ones are rounded to 2^-15 of
// it, below a bf16 output's own rounding). Codes then multiply as integers: `vpmaddwd`
// multiplies 16 code/activation pairs and adds each two into int32, which hold a group's
// sum exactly, 7 instructions per 32 weights. Per group, in float32:
//
//   sum_k x[k] ((u[k] - 8) s + z) = s unit sum_k q[k] u[k] + (z - 8 s) sum_k x[k]
//
// (u the stored code in [0, 15], s and z the group's scale and zero, q the activation's
// integer, sum_k x[k] over the unrounded activations); output rounded once to the dtype.
//
// Layout (`int4_pack`): panels of 64 output columns, codes [ceil(N/64), K/2, 64] bytes, so a
// one-row call reads the weight as one stream. Per pair of k (2j, 2j+1), 16 bytes per 16
// columns: byte 2i+t of chunk b holds column 16b+i at k = 2j+t in its low nibble and column
// 16b+8+i in its high one (b < 4, i < 8, t < 2), so the bytes widened to 16-bit lanes and
// split into nibbles are two vectors of (k, k+1) code pairs of 8 consecutive columns.
// Scales and zeros are bf16 (as the layer holds them) in [panels, groups, 2, 64]: the 64
// scales of a panel's group, then its 64 zeros.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace kiln_simd;

constexpr int64_t PANEL = 64;     // output columns per panel
constexpr int64_t BYTES = 64;     // bytes of codes per pair of k of a panel
constexpr int64_t CHUNK = 16;     // columns whose codes are 16 consecutive bytes
constexpr int64_t CHUNKS = PANEL / CHUNK;
constexpr int64_t PREFETCH = 1024;  // bytes ahead in a panel's code stream
constexpr float Q_MAX = 32767.f;
// a group's int32 sums stay exact up to 2^31 / (2 * 32767 * 15) pairs of k
constexpr int64_t MAX_GROUP = 4096;

struct Problem {
  const int16_t* q;     // [M, K] activations as integers, in their group's unit
  const float* unit;    // [M, groups]: the value of one integer step in each group
  const float* xsum;    // [M, groups]: each row's (unrounded) sum over each group
  const uint8_t* codes; // [panels, K / 2, 64]
  const uint16_t* sz;   // bf16 [panels, groups, 2, 64]
  int64_t M, N, K, group;
};

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 widen8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Rows m0 .. m0 + MR - 1 against chunks c0 .. c0 + NB - 1 of panel p: out[r][16 * NB] floats.
template <int MR, int NB>
inline void tile(const Problem& pr, int64_t p, int64_t c0, int64_t m0, float* out) {
  const int64_t groups = pr.K / pr.group, pairs = pr.group / 2;
  const uint8_t* codes = pr.codes + p * (pr.K / 2) * BYTES + c0 * CHUNK;
  const uint16_t* sz = pr.sz + p * groups * 2 * PANEL + c0 * CHUNK;
  const __m256i low = _mm256_set1_epi16(15);
  // The running sums stay in memory (L1), touched once per group: the group's integer
  // accumulators and the widened codes need the registers.
  alignas(32) float y[MR * 2 * NB * 8] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[MR][2 * NB];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < 2 * NB; ++v) acc[r][v] = _mm256_setzero_si256();
    // a group's sums stay exact: |q u| < 2^15 * 15, two per lane per pair, group / 2 pairs
    for (int64_t j = g * pairs; j < (g + 1) * pairs; ++j) {
      // The hardware prefetcher alone leaves a one-row call waiting on memory: ask for the
      // codes PREFETCH bytes ahead (one cache line per pair of k).
      if (NB == CHUNKS) {
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(codes) + j * BYTES + PREFETCH;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);  // never faults
      }
      __m256i a[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        int32_t both;  // the row's activations at k = 2j and 2j + 1
        std::memcpy(&both, pr.q + (m0 + r) * pr.K + 2 * j, sizeof(both));
        a[r] = _mm256_set1_epi32(both);
      }
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        const __m256i words = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * BYTES + CHUNK * b)));
        const __m256i u_low = _mm256_and_si256(words, low);
        const __m256i u_high = _mm256_srli_epi16(words, 4);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          acc[r][2 * b] = _mm256_add_epi32(acc[r][2 * b], _mm256_madd_epi16(u_low, a[r]));
          acc[r][2 * b + 1] = _mm256_add_epi32(acc[r][2 * b + 1], _mm256_madd_epi16(u_high, a[r]));
        }
      }
    }
    const uint16_t* scales = sz + g * 2 * PANEL;
#pragma GCC unroll 8
    for (int v = 0; v < 2 * NB; ++v) {
      const __m256 s = widen8(scales + 8 * v);
      // z - 8 s: the weight (u - 8) s + z is u s + (z - 8 s)
      const __m256 shift = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, widen8(scales + PANEL + 8 * v));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (m0 + r) * groups + g;
        const __m256 sum =
            _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][v]), _mm256_set1_ps(pr.unit[at]));
        float* dst = y + (r * 2 * NB + v) * 8;
        _mm256_store_ps(dst, _mm256_fmadd_ps(shift, _mm256_set1_ps(pr.xsum[at]),
                                             _mm256_fmadd_ps(s, sum, _mm256_load_ps(dst))));
      }
    }
  }
  std::copy(y, y + MR * 2 * NB * 8, out);
}
#else
// Without AVX2 and FMA the runtime keeps torch's int4 kernel (`int4_on_kiln`): no slow copy
// of this one is kept that nothing would run.
template <int MR, int NB>
inline void tile(const Problem&, int64_t, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "int4_linear: kiln's int4 kernel was built for a CPU without AVX2 and FMA");
}
#endif

template <typename T, int MR, int NB>
inline void run_tile(const Problem& pr, T* y, int64_t p, int64_t c0, int64_t m0) {
  alignas(32) float acc[MR * CHUNK * NB];
  tile<MR, NB>(pr, p, c0, m0, acc);
  const int64_t n0 = p * PANEL + c0 * CHUNK;
  const int64_t width = std::min<int64_t>(CHUNK * NB, pr.N - n0);
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < width; ++c)
      y[(m0 + r) * pr.N + n0 + c] = narrow<T>(acc[r * CHUNK * NB + c]);
}

template <typename T>
void linear(const Problem& pr, T* y) {
  const int64_t panels = (pr.N + PANEL - 1) / PANEL;
  // Threads split the output columns, so each streams its own part of the weight.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      // Four rows at a time share each widened chunk of codes (16 bytes per pair of k, in
      // L1 while the row blocks pass over it) per tile; the last one to three rows take
      // wider tiles, a whole panel for a single row (one stream, as a one-row call).
      const int64_t m0 = pr.M - pr.M % 4;
      for (int64_t c = 0; c < CHUNKS; ++c)
        for (int64_t m = 0; m < m0; m += 4) run_tile<T, 4, 1>(pr, y, p, c, m);
      switch (pr.M - m0) {
        case 3:
          for (int64_t c = 0; c < CHUNKS; ++c) run_tile<T, 3, 1>(pr, y, p, c, m0);
          break;
        case 2:
          for (int64_t c = 0; c < CHUNKS; c += 2) run_tile<T, 2, 2>(pr, y, p, c, m0);
          break;
        case 1: run_tile<T, 1, CHUNKS>(pr, y, p, 0, m0); break;
        default: break;
      }
    }
  });
}

// Each row's groups as 16-bit integers: unit = 2^(e - 15) for the group's largest magnitude
// below 2^e, q = x / unit rounded to nearest even (|q| <= 32767). A group holding Inf or NaN
// (or whose sum overflows) gets a NaN unit, so its outputs are NaN as a float product's would be.
template <typename T>
void to_integers(const T* x, int64_t M, int64_t K, int64_t group, int16_t* q, float* unit,
                 float* xsum) {
  const int64_t groups = K / group;
  for (int64_t i = 0; i < M * groups; ++i) {
    const T* in = x + i * group;
    float largest = 0.f, total = 0.f;
    for (int64_t k = 0; k < group; ++k) {
      const float v = widen(in[k]);
      largest = std::max(largest, std::fabs(v));
      total += v;
    }
    xsum[i] = total;
    int16_t* out = q + i * group;
    if (!std::isfinite(largest) || !std::isfinite(total)) {
      unit[i] = std::numeric_limits<float>::quiet_NaN();
      std::fill(out, out + group, int16_t{0});
      continue;
    }
    int e = 0;
    std::frexp(largest, &e);  // largest < 2^e (largest = 0: e = 0, all integers 0)
    // 2^(15 - e) as a float, capped for groups below 2^-112 (they lose low bits instead)
    const int up = std::min(15 - e, 127);
    const float to_q = std::ldexp(1.f, up);
    unit[i] = std::ldexp(1.f, -up);
    for (int64_t k = 0; k < group; ++k) {
      const float scaled = std::nearbyint(widen(in[k]) * to_q);
      out[k] = static_cast<int16_t>(std::min(std::max(scaled, -Q_MAX), Q_MAX));
    }
  }
}

std::tuple<at::Tensor, at::Tensor> int4_pack(const at::Tensor& codes, const at::Tensor& scale,
                                             const at::Tensor& zero) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 2,
              "int4_pack: uint8 codes [N, K] in [0, 15] on the CPU");
  TORCH_CHECK(codes.numel() == 0 || codes.max().item<uint8_t>() <= 15,
              "int4_pack: codes must lie in [0, 15] (4-bit codes plus 8)");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.sizes() == zero.sizes() &&
                  scale.size(1) > 0 && K % scale.size(1) == 0 && (K / scale.size(1)) % 2 == 0 &&
                  K / scale.size(1) <= MAX_GROUP,
              "int4_pack: scale and zero [N, groups] with groups dividing K into even groups of "
              "at most 4096 columns");
  const int64_t groups = scale.size(1), panels = (N + PANEL - 1) / PANEL;
  at::Tensor padded = at::zeros({panels * PANEL, K}, codes.options());
  padded.narrow(0, 0, N).copy_(codes);
  // [panels, chunk, half, 8, K / 2, 2]: half 0 -> low nibble, half 1 -> high nibble
  at::Tensor split = padded.view({panels, CHUNKS, 2, 8, K / 2, 2});
  at::Tensor bytes = at::bitwise_or(split.select(2, 0).bitwise_and(15),
                                    split.select(2, 1).bitwise_and(15).bitwise_left_shift(4));
  // [panels, chunk, 8, K / 2, 2] -> [panels, K / 2, chunk, 8, 2]
  at::Tensor packed = bytes.permute({0, 3, 1, 2, 4}).contiguous().view({panels, K / 2, BYTES});
  at::Tensor both = at::zeros({panels * PANEL, 2, groups}, scale.options().dtype(at::kBFloat16));
  both.narrow(0, 0, N).select(1, 0).copy_(scale);
  both.narrow(0, 0, N).select(1, 1).copy_(zero);
  at::Tensor sz = both.view({panels, PANEL, 2, groups}).permute({0, 3, 2, 1}).contiguous();
  return {packed, sz};
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                       int64_t N, at::ScalarType dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_linear: x [M, K] float32 or bfloat16 on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.device().is_cpu() && sz.device().is_cpu(),
              "int4_linear: codes, scales and zeros on the CPU");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  2 * packed.size(1) == K && packed.size(2) == BYTES &&
                  packed.size(0) * PANEL >= N && packed.size(0) * PANEL < N + PANEL,
              "int4_linear: codes from int4_pack with x's K columns and N outputs");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 4 && sz.is_contiguous() &&
                  sz.size(0) == packed.size(0) && sz.size(2) == 2 && sz.size(3) == PANEL &&
                  sz.size(1) > 0 && K % sz.size(1) == 0 && (K / sz.size(1)) % 2 == 0,
              "int4_linear: scales and zeros from int4_pack");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "int4_linear: float32 or bfloat16 output");
  const int64_t groups = sz.size(1), group = K / groups;
  at::Tensor out = at::empty({M, N}, x.options().dtype(dtype));
  if (M == 0) return out;
  // The integers, units and group sums in plain buffers: a decode step makes ~120 of these
  // calls, and a torch operator per call would cost more than the conversion.
  std::vector<int16_t> q(M * K);
  std::vector<float> unit(M * groups), xsum(M * groups);
  const at::Tensor xc = x.contiguous();
  if (xc.scalar_type() == at::kFloat) {
    to_integers(xc.data_ptr<float>(), M, K, group, q.data(), unit.data(), xsum.data());
  } else {
    to_integers(xc.data_ptr<c10::BFloat16>(), M, K, group, q.data(), unit.data(), xsum.data());
  }
  const Problem pr{q.data(), unit.data(), xsum.data(), packed.data_ptr<uint8_t>(),
                   reinterpret_cast<const uint16_t*>(sz.data_ptr<c10::BFloat16>()), M, N, K,
                   group};
  if (dtype == at::kFloat) {
    linear(pr, out.data_ptr<float>());
  } else {
    linear(pr, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("int4_pack(Tensor codes, Tensor scale, Tensor zero) -> (Tensor, Tensor)");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor sz, int N, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("int4_pack", &int4_pack);
  m.impl("int4_linear", &int4_linear);
}
