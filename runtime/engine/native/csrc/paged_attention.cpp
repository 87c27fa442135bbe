// kiln runtime: single-token (decode) attention read straight from the paged KV cache, CPU.
//
// Hand-written because no library torch 2.13 can install on a CPU box does it: torch's
// scaled_dot_product_attention needs contiguous keys, so the pure-torch path first gathers
// every sequence's blocks into a new tensor (one copy of the whole context per layer) and
// then reads it again. Here each (sequence, KV head) pair walks its block table and reads
// each key and value row once, for all the query heads that share it (grouped-query).
//
// Layout (runtime/engine/attention.py): caches [kv_heads, num_blocks, block_size, head_dim] float32 or
// bfloat16 (widened to float32 as each row is read); q [batch, heads, head_dim] float32 with
// query heads h * group .. h * group + group - 1 on KV head h;
// block_tables [batch, width] int64; context_lens [batch] int64 (>= 1 and <= width * block_size).
// `decode_attention_` is the whole of a decode-only step's attention for one layer: it stores
// each row's key and value (from the stacked qkv projection, in the caches' dtype, as
// PagedKVCache.write does) before attending, and returns the model's dtype.
// Every (sequence, KV head) is computed alone, so a sequence's result does not depend on what
// else is in the batch. Softmax is the usual max-subtracted one, accumulated in float32; on
// bf16 dot products (a bf16 model on a CPU with AVX512-BF16) the probabilities are rounded to
// bf16 before they weigh the values, as torch's flash kernel rounds them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace kiln_simd;

template <typename T>
struct Problem {
  const float* q;
  const T* k;
  const T* v;
  const int64_t* tables;
  const int64_t* lens;
  float* out;
  int64_t heads, kv_heads, num_blocks, block_size, width;
  float scale;
};

constexpr int64_t PIECE = 16;  // rows: the unit in which Ahead asks for the caches

// The runs of up to PIECE rows of the caches that a thread's items read, in the order they
// read them (an item's keys, then its values), each asked into L2 AHEAD runs before its turn:
// `next()` as a run's reading starts asks for the run AHEAD further on. A sequence's blocks
// lie anywhere in the cache, 16 rows (2 KB of bf16 keys) each: too short a run for the
// hardware prefetchers, and a decode step's caches come from memory (30 layers' worth pass
// through the cache between a layer's steps). Asking one block ahead into L1 (this kernel's
// way before) left the time of SmolLM2-135M's 30 layers at batch 32, context ~220, blocks as
// the engine had placed them, at 19-21 ms where the same calls from cache take 7; this takes
// 16-18 (in the engine, old and new on alternate steps: 0.559 -> 0.416 ms a layer); asking
// whole items ahead in one burst changed nothing. A plain read of those blocks moves 11.5 GB/s
// unasked, 12 asked into L1, 17-18 asked into L2 4-16 runs ahead (one thread, a 2-core Zen 4
// EPYC).
template <typename T>
class Ahead {
 public:
  static constexpr int64_t AHEAD = 16;

  Ahead(const Problem<T>& pr, int64_t begin, int64_t end, int64_t dim)
      : bytes_(std::min(PIECE, pr.block_size) * dim * static_cast<int64_t>(sizeof(T))) {
    const int64_t bs = pr.block_size;
    int64_t count = 0;
    for (int64_t item = begin; item < end; ++item)
      count += 2 * ((pr.lens[item / pr.kv_heads] + bs - 1) / bs) * ((bs + PIECE - 1) / PIECE);
    runs_.reserve(count);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / pr.kv_heads, h = item % pr.kv_heads, len = pr.lens[b];
      for (const T* cache : {pr.k, pr.v})  // as for_each_row and its kin walk them
        for (int64_t t0 = 0, slot = 0; t0 < len; t0 += bs, ++slot) {
          const T* rows = cache + ((h * pr.num_blocks + pr.tables[b * pr.width + slot]) * bs) * dim;
          for (int64_t j = 0; j < std::min(bs, len - t0); j += PIECE)
            runs_.push_back(reinterpret_cast<const char*>(rows + j * dim));
        }
    }
    for (int64_t i = 0; i < AHEAD; ++i) ask();
  }
  void next() { ask(); }

 private:
  void ask() {
    if (at_ >= runs_.size()) return;
    const char* run = runs_[at_++];
    for (int64_t at = 0; at < bytes_; at += 64) __builtin_prefetch(run + at, 0, 2);  // into L2
  }
  const int64_t bytes_;
  std::vector<const char*> runs_;
  size_t at_ = 0;
};

// Calls row(t, pointer) for positions t = 0 .. len - 1 of sequence b's KV head h in `cache`,
// walking its block table, with ahead.next() as each run of PIECE rows starts.
template <typename T, typename Row>
inline void for_each_row(const Problem<T>& pr, const T* cache, int64_t b, int64_t h, int64_t len,
                         int64_t dim, Ahead<T>& ahead, Row&& row) {
  const int64_t bs = pr.block_size;
  for (int64_t t0 = 0, slot = 0; t0 < len; t0 += bs, ++slot) {
    const int64_t block = pr.tables[b * pr.width + slot];
    const T* rows = cache + ((h * pr.num_blocks + block) * bs) * dim;
    const int64_t n = std::min(bs, len - t0);
    for (int64_t j = 0; j < n; ++j) {
      if (j % PIECE == 0) ahead.next();
      row(t0 + j, rows + j * dim);
    }
  }
}

// One (sequence, KV head): the group's scores against every key, softmax, weighted values.
// DIM and GROUP are compile-time for the common shapes (the accumulators then live in
// registers); 0 means "read it from the problem" (any other shape).
template <typename T, int DIM, int GROUP>
void attend_one(const Problem<T>& pr, int64_t b, int64_t h, int64_t dim_rt, int64_t group_rt,
                std::vector<float>& scores, std::vector<float>& acc_rt, Ahead<T>& ahead) {
  const int64_t dim = DIM ? DIM : dim_rt;
  const int64_t group = GROUP ? GROUP : group_rt;
  const int64_t len = pr.lens[b];
  const float* __restrict query = pr.q + (b * pr.heads + h * group) * dim;
  scores.resize(group * len);
  float* __restrict sc = scores.data();
  for_each_row(pr, pr.k, b, h, len, dim, ahead, [&](int64_t t, const T* __restrict key) {
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict qg = query + g * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qg[d] * widen(key[d]);
      sc[g * len + t] = dot * pr.scale;
    }
  });
  float total[GROUP ? GROUP : 64];
  for (int64_t g = 0; g < group; ++g) {
    float* __restrict row = sc + g * len;
    float top = row[0];
    for (int64_t t = 1; t < len; ++t) top = std::max(top, row[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      row[t] = exp_poly(row[t] - top);
      sum += row[t];
    }
    total[g] = sum;
  }
  float acc_fixed[(DIM && GROUP) ? DIM * GROUP : 1];
  float* __restrict acc = (DIM && GROUP) ? acc_fixed : acc_rt.data();
  for (int64_t i = 0; i < group * dim; ++i) acc[i] = 0.f;
  for_each_row(pr, pr.v, b, h, len, dim, ahead, [&](int64_t t, const T* __restrict value) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = sc[g * len + t];
      float* __restrict a = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += p * widen(value[d]);
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* __restrict target = pr.out + (b * pr.heads + h * group + g) * dim;
    const float inv = 1.f / total[g];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) target[d] = acc[g * dim + d] * inv;
  }
}

#if defined(__AVX512F__)
// Room for the bf16 probabilities after a (sequence, KV head)'s float32 scores, `len` each
// and a zero after the last.
inline int64_t pair_room(int64_t len) { return (len + 32) / 2; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The weighted values of a bf16 cache as dot products of bf16 pairs (VDPBF16PS): the group's
// probabilities (float32 exps in sc, their float32 sums in total) are rounded to bf16 once, as
// torch's flash kernel rounds them for its second product, and each pair of consecutive
// values is interleaved in registers (the 16-bit unpacks, which leave the dims in an order
// the end undoes) and multiplied with the pair of their probabilities, for every query head
// of the group: half the multiply-adds of the widened path, no widening. Batch 32, context
// 240, blocks scattered, one thread, a Zen 4 EPYC: 0.35 -> 0.31 ms per layer (in cache 0.25 ->
// 0.20).
template <int DIM, int GROUP>
void weigh_pairs(const Problem<c10::BFloat16>& pr, int64_t b, int64_t h, int64_t len,
                 const float* sc, const float* total, float* room, Ahead<c10::BFloat16>& ahead) {
  constexpr int NP = DIM / 32;
  const int64_t stride = 2 * pair_room(len);
  uint16_t* probs = reinterpret_cast<uint16_t*>(room);
  auto lanes = [](int64_t left, int64_t width) -> uint64_t {
    return left >= width ? (uint64_t{1} << width) - 1 : left <= 0 ? 0 : (uint64_t{1} << left) - 1;
  };
  for (int g = 0; g < GROUP; ++g) {
    const float* row = sc + g * len;
    uint16_t* to = probs + g * stride;
    for (int64_t t = 0; t < len; t += 32) {
      const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(lanes(len - t, 16)), row + t);
      const __m512 hi =
          _mm512_maskz_loadu_ps(static_cast<__mmask16>(lanes(len - t - 16, 16)), row + t + 16);
      const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);
      _mm512_mask_storeu_epi16(to + t, static_cast<__mmask32>(lanes(len - t, 32)),
                               reinterpret_cast<__m512i>(both));
    }
    to[len] = 0;
  }
  alignas(64) static const uint16_t zeros[DIM] = {};
  __m512 lo[GROUP][NP], hi[GROUP][NP];
  for (int g = 0; g < GROUP; ++g)
    for (int i = 0; i < NP; ++i) lo[g][i] = hi[g][i] = _mm512_setzero_ps();
  const int64_t bs = pr.block_size;
  for (int64_t t0 = 0, slot = 0; t0 < len; t0 += bs, ++slot) {
    const int64_t block = pr.tables[b * pr.width + slot];
    const uint16_t* rows = reinterpret_cast<const uint16_t*>(pr.v) +
                           ((h * pr.num_blocks + block) * bs) * DIM;
    const int64_t n = std::min(bs, len - t0);
    for (int64_t j = 0; j < n; j += 2) {
      if (j % PIECE == 0) ahead.next();
      const uint16_t* first = rows + j * DIM;
      const uint16_t* second = j + 1 < n ? first + DIM : zeros;
      __m512i low[NP], high[NP];
      for (int i = 0; i < NP; ++i) {
        const __m512i a = _mm512_loadu_si512(first + 32 * i);
        const __m512i c = _mm512_loadu_si512(second + 32 * i);
        low[i] = _mm512_unpacklo_epi16(a, c);
        high[i] = _mm512_unpackhi_epi16(a, c);
      }
      for (int g = 0; g < GROUP; ++g) {
        int32_t pair;
        std::memcpy(&pair, probs + g * stride + t0 + j, sizeof(pair));
        const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        for (int i = 0; i < NP; ++i) {
          lo[g][i] = _mm512_dpbf16_ps(lo[g][i], reinterpret_cast<__m512bh>(low[i]), p);
          hi[g][i] = _mm512_dpbf16_ps(hi[g][i], reinterpret_cast<__m512bh>(high[i]), p);
        }
      }
    }
  }
  // lane j of 128-bit lane k holds dim 8k + j (lo) or 8k + 4 + j (hi) of its 32
  const __m512i first16 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i last16 =
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int g = 0; g < GROUP; ++g) {
    float* target = pr.out + (b * pr.heads + h * GROUP + g) * DIM;
    const __m512 inv = _mm512_set1_ps(1.f / total[g]);
    for (int i = 0; i < NP; ++i) {
      const __m512 a = _mm512_permutex2var_ps(lo[g][i], first16, hi[g][i]);
      const __m512 c = _mm512_permutex2var_ps(lo[g][i], last16, hi[g][i]);
      _mm512_storeu_ps(target + 32 * i, _mm512_mul_ps(a, inv));
      _mm512_storeu_ps(target + 32 * i + 16, _mm512_mul_ps(c, inv));
    }
  }
}
#endif

// The same computation in AVX-512, for the specialised shapes (head_dim a multiple of 16):
// each run of 16 keys is widened to float32 once into a stack buffer, scored for every query
// head of the group at once (one partial-sum vector per key, then one transposing reduction
// instead of a horizontal sum per key), exp runs 16 lanes wide, and the group's value
// accumulators live in registers. SmolLM2-135M's shapes at batch 32, context 150-175, bf16
// cache, one thread, a Xeon with AVX-512: 0.35 vs 0.57 ms of CPU per layer. Only the
// summation order differs from the scalar path.
template <typename T, int DIM, int GROUP>
void attend_avx512(const Problem<T>& pr, int64_t b, int64_t h, int64_t, int64_t,
                   std::vector<float>& scores, std::vector<float>&, Ahead<T>& ahead) {
  constexpr int NV = DIM / 16;
  const int64_t len = pr.lens[b], bs = pr.block_size;
  const float* query = pr.q + (b * pr.heads + h * GROUP) * DIM;
  scores.resize(GROUP * len + 16 + GROUP * pair_room(len));
  float* sc = scores.data();
  const __m512 scale = _mm512_set1_ps(pr.scale);
  alignas(64) float wide[16 * DIM];  // 16 keys widened once, read by every query head
  // Scores as dot products of bf16 pairs (VDPBF16PS) where the CPU has them, the cache is
  // bf16 and the group's queries are bf16 values (a bf16 model's always are): the keys are
  // then read as stored, without widening, at half the multiply-adds. Products of bf16 values
  // are exact in float32; only the summation order differs from the widened path. Batch 32,
  // context 215, blocks scattered, one thread, a Zen 4 EPYC: 0.46 -> 0.31 ms per layer (in
  // cache 0.38 -> 0.23: the widened path was bound by its arithmetic there).
  bool pairs = false;
#if defined(__AVX512BF16__)
  constexpr int NP = DIM / 32;
  __m512bh qb[GROUP][NP > 0 ? NP : 1];
  if constexpr (std::is_same_v<T, c10::BFloat16> && DIM % 32 == 0) {
    const __m512i low_bits = _mm512_set1_epi32(0xFFFF);  // zero in a bf16 value's float32
    __mmask16 inexact = 0;
    for (int g = 0; g < GROUP; ++g)
      for (int i = 0; i < NP; ++i) {
        const __m512 lo = _mm512_loadu_ps(query + g * DIM + 32 * i);
        const __m512 hi = _mm512_loadu_ps(query + g * DIM + 32 * i + 16);
        inexact |= _mm512_test_epi32_mask(_mm512_castps_si512(lo), low_bits) |
                   _mm512_test_epi32_mask(_mm512_castps_si512(hi), low_bits);
        qb[g][i] = _mm512_cvtne2ps_pbh(hi, lo);
      }
    pairs = inexact == 0;
  }
#endif
  for (int64_t t0 = 0, slot = 0; t0 < len; t0 += bs, ++slot) {
    const int64_t block = pr.tables[b * pr.width + slot];
    const T* rows = pr.k + ((h * pr.num_blocks + block) * bs) * DIM;
    const int64_t n = std::min(bs, len - t0);
    for (int64_t j0 = 0; j0 < n; j0 += PIECE) {
      ahead.next();
      const int64_t m = std::min<int64_t>(PIECE, n - j0);
      if (!pairs)
        for (int64_t j = 0; j < m; ++j)
          for (int i = 0; i < NV; ++i)
            _mm512_store_ps(wide + j * DIM + 16 * i, load16(rows + (j0 + j) * DIM + 16 * i));
      const __mmask16 live = static_cast<__mmask16>((1u << m) - 1);
      for (int g = 0; g < GROUP; ++g) {
        const float* qg = query + g * DIM;
        __m512 part[16];
        for (int j = 0; j < 16; ++j) {
          if (j >= m) {
            part[j] = _mm512_setzero_ps();
            continue;
          }
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16> && DIM % 32 == 0) {
            if (pairs) {
              const T* key = rows + (j0 + j) * DIM;
              __m512 s = _mm512_setzero_ps();
              for (int i = 0; i < NP; ++i)
                s = _mm512_dpbf16_ps(
                    s, qb[g][i], reinterpret_cast<__m512bh>(_mm512_loadu_si512(key + 32 * i)));
              part[j] = s;
              continue;
            }
          }
#endif
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_load_ps(wide + j * DIM));
          for (int i = 1; i < NV; ++i)
            s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * i),
                                _mm512_load_ps(wide + j * DIM + 16 * i), s);
          part[j] = s;
        }
        _mm512_mask_storeu_ps(sc + g * len + t0 + j0, live, _mm512_mul_ps(sum_each(part), scale));
      }
    }
  }
  float total[GROUP];
  for (int g = 0; g < GROUP; ++g) {
    float* row = sc + g * len;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 live = len - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - t)) - 1);
      top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, row + t));
    }
    const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 live = len - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - t)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + t), peak));
      _mm512_mask_storeu_ps(row + t, live, e);
      sum = _mm512_mask_add_ps(sum, live, sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && DIM % 32 == 0) {
    if (pairs) {
      weigh_pairs<DIM, GROUP>(pr, b, h, len, sc, total, sc + GROUP * len + 16, ahead);
      return;
    }
  }
#endif
  __m512 acc[GROUP][NV];
  for (int g = 0; g < GROUP; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_setzero_ps();
  for_each_row(pr, pr.v, b, h, len, DIM, ahead, [&](int64_t t, const T* value) {
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load16(value + 16 * i);
    for (int g = 0; g < GROUP; ++g) {
      const __m512 p = _mm512_set1_ps(sc[g * len + t]);
      for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(p, vv[i], acc[g][i]);
    }
  });
  for (int g = 0; g < GROUP; ++g) {
    float* target = pr.out + (b * pr.heads + h * GROUP + g) * DIM;
    const __m512 inv = _mm512_set1_ps(1.f / total[g]);
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(target + 16 * i, _mm512_mul_ps(acc[g][i], inv));
  }
}
#define KILN_ATTEND attend_avx512
#else
#define KILN_ATTEND attend_one
#endif

template <typename T>
using Attend = void (*)(const Problem<T>&, int64_t, int64_t, int64_t, int64_t,
                        std::vector<float>&, std::vector<float>&, Ahead<T>&);

template <typename T, int DIM>
Attend<T> pick_group(int64_t group) {
  switch (group) {
    case 1: return &KILN_ATTEND<T, DIM, 1>;
    case 2: return &KILN_ATTEND<T, DIM, 2>;
    case 3: return &KILN_ATTEND<T, DIM, 3>;
    case 4: return &KILN_ATTEND<T, DIM, 4>;
    case 5: return &KILN_ATTEND<T, DIM, 5>;
    case 6: return &KILN_ATTEND<T, DIM, 6>;
    case 7: return &KILN_ATTEND<T, DIM, 7>;
    case 8: return &KILN_ATTEND<T, DIM, 8>;
    default: return &attend_one<T, 0, 0>;
  }
}

template <typename T>
Attend<T> pick(int64_t dim, int64_t group) {
  if (group > 64) return nullptr;
  if (dim == 64) return pick_group<T, 64>(group);
  if (dim == 128) return pick_group<T, 128>(group);
  return &attend_one<T, 0, 0>;
}

template <typename T>
void run(const at::Tensor& qc, const at::Tensor& kc, const at::Tensor& vc, const int64_t* tables,
         const int64_t* lens, at::Tensor& out, int64_t width, double scale) {
  const int64_t batch = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const int64_t kv_heads = kc.size(0), num_blocks = kc.size(1), block_size = kc.size(2);
  const int64_t group = heads / kv_heads;
  const Attend<T> attend = pick<T>(dim, group);
  TORCH_CHECK(attend != nullptr, "paged_decode_attention: more than 64 query heads per KV head");
  const Problem<T> pr{qc.data_ptr<float>(), kc.data_ptr<T>(), vc.data_ptr<T>(), tables, lens,
                      out.data_ptr<float>(), heads, kv_heads, num_blocks, block_size, width,
                      static_cast<float>(scale)};
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * dim);
    Ahead<T> ahead(pr, begin, end, dim);
    for (int64_t item = begin; item < end; ++item)
      attend(pr, item / kv_heads, item % kv_heads, dim, group, scores, acc, ahead);
  });
}

// The block tables and lengths a call reads, checked before any of it is read; `op` names
// the operator in the error.
void check_tables(const char* op, const int64_t* table_p, const int64_t* len_p, int64_t batch,
                  int64_t width, int64_t block_size, int64_t num_blocks) {
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len_p[b] >= 1 && len_p[b] <= width * block_size, op,
                ": context length out of range");
    for (int64_t slot = 0; slot < (len_p[b] + block_size - 1) / block_size; ++slot) {
      const int64_t block = table_p[b * width + slot];
      TORCH_CHECK(block >= 0 && block < num_blocks, op, ": bad block id");
    }
  }
}

at::Tensor attend(const char* op, const at::Tensor& qc, const at::Tensor& kc,
                  const at::Tensor& vc, const at::Tensor& tables, const at::Tensor& lens,
                  double scale) {
  const int64_t batch = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const int64_t kv_heads = kc.size(0), num_blocks = kc.size(1), block_size = kc.size(2);
  const int64_t width = tables.size(1);
  TORCH_CHECK(kc.size(3) == dim && heads % kv_heads == 0, op, ": head shapes");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.size(0) == batch, op,
              ": one block table and length per sequence");
  const int64_t* table_p = tables.data_ptr<int64_t>();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  check_tables(op, table_p, len_p, batch, width, block_size, num_blocks);
  at::Tensor out = at::empty_like(qc);
  if (kc.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(qc, kc, vc, table_p, len_p, out, width, scale);
  } else {
    run<float>(qc, kc, vc, table_p, len_p, out, width, scale);
  }
  return out;
}

void check_caches(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const at::ScalarType held = k_cache.scalar_type();
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  v_cache.scalar_type() == held && (held == at::kFloat || held == at::kBFloat16),
              op, ": float32 or bfloat16 caches on the CPU");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), op,
              ": caches [KVH, NB, BS, D]");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  constexpr const char* op = "paged_decode_attention";
  check_caches(op, k_cache, v_cache);
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3,
              "paged_decode_attention: a float32 query [B, H, D] on the CPU");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: int64 block tables and lengths");
  return attend(op, q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                block_tables.contiguous(), context_lens.contiguous(), scale);
}

// Row r's keys and values (after its query heads in qkv) into the caches at slots[r], in the
// caches' dtype; its query heads as float32, rounded to the caches' dtype first as the torch
// path attends (a bf16 cache under a float32 model attends in bf16).
template <typename In, typename Held>
void store_and_widen(const In* qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                     const int64_t* slots, int64_t cache_rows, Held* k_cache, Held* v_cache,
                     float* q) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  for (int64_t r = 0; r < rows; ++r) {
    const In* row = qkv + r * width;
    float* q_to = q + r * heads * dim;
    for (int64_t i = 0; i < heads * dim; ++i) q_to[i] = widen(narrow<Held>(widen(row[i])));
    const int64_t slot = slots[r];
    for (int64_t h = 0; h < kv_heads; ++h) {
      Held* k_to = k_cache + (h * cache_rows + slot) * dim;
      Held* v_to = v_cache + (h * cache_rows + slot) * dim;
      const In* k_from = row + (heads + h) * dim;
      const In* v_from = row + (heads + kv_heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        k_to[d] = narrow<Held>(widen(k_from[d]));
        v_to[d] = narrow<Held>(widen(v_from[d]));
      }
    }
  }
}

template <typename In>
void store(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t dim,
           const int64_t* slots, at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& q) {
  const int64_t rows = qkv.size(0), cache_rows = k_cache.size(1) * k_cache.size(2);
  if (k_cache.scalar_type() == at::kBFloat16) {
    store_and_widen(qkv.data_ptr<In>(), rows, heads, kv_heads, dim, slots, cache_rows,
                    k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
                    q.data_ptr<float>());
  } else {
    store_and_widen(qkv.data_ptr<In>(), rows, heads, kv_heads, dim, slots, cache_rows,
                    k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), q.data_ptr<float>());
  }
}

// Keys and values [T, KVH, D] (any strides, D contiguous) stored at flat slots [T] of caches
// [KVH, NB, BS, D] of their dtype: PagedKVCache.write's index_copy_, one row copy per token and
// head. torch's index_copy_ along the caches' token dimension ran at ~2 GB/s (a 2048-token
// prefill chunk: 22 ms of a ~750 ms step, one thread, a 2-core Xeon).
void kv_store_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping) {
  constexpr const char* op = "kv_store_";
  check_caches(op, k_cache, v_cache);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "kv_store_: contiguous caches (it stores into them)");
  const int64_t kv_heads = k_cache.size(0), dim = k_cache.size(3);
  const int64_t cache_rows = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == kv_heads &&
                  k.size(2) == dim && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == k_cache.scalar_type() && k.device().is_cpu() &&
                  v.device().is_cpu(),
              "kv_store_: keys and values [T, KVH, D] of the caches' dtype, D contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == k.size(0),
              "kv_store_: int64 slots, one per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t tokens = k.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot_p[t] >= 0 && slot_p[t] < cache_rows, "kv_store_: slot out of range");
  const int64_t bytes = dim * static_cast<int64_t>(k.element_size());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t size = k.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t to = (h * cache_rows + slot_p[t]) * bytes;
      std::memcpy(kc + to, kp + (t * k.stride(0) + h * k.stride(1)) * size, bytes);
      std::memcpy(vc + to, vp + (t * v.stride(0) + h * v.stride(1)) * size, bytes);
    }
  }
}

// A step of decodes only, in one call: each row of qkv [B, (H + 2 KVH) D] (queries, keys,
// values side by side, as the stacked projection leaves them, rotated) stores its key and
// value at its slot, then attends over its context; out [B, H D] in qkv's dtype. The torch
// path does this in ~10 operator calls per layer (slices, transposes, two index_copy_, the
// query's widening, the output's narrowing): a decode step runs it for every layer.
at::Tensor decode_attention_(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, int64_t heads, double scale) {
  constexpr const char* op = "decode_attention_";
  check_caches(op, k_cache, v_cache);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention_: contiguous caches (it stores into them)");
  const at::ScalarType dtype = qkv.scalar_type();
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "decode_attention_: qkv [B, (H + 2 KVH) D] float32 or bfloat16 on the CPU");
  const int64_t kv_heads = k_cache.size(0), dim = k_cache.size(3), rows = qkv.size(0);
  TORCH_CHECK(heads > 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "decode_attention_: qkv's width is not (heads + 2 kv_heads) head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == rows && block_tables.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong,
              "decode_attention_: int64 slots, block tables and lengths, one per row");
  const at::Tensor slots = slot_mapping.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t cache_rows = k_cache.size(1) * k_cache.size(2);
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slot_p[r] >= 0 && slot_p[r] < cache_rows, "decode_attention_: slot out of range");
  // every table checked before the first key is stored: a bad one leaves the caches untouched
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == rows && lens.size(0) == rows,
              "decode_attention_: one block table and length per row");
  check_tables(op, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), rows, tables.size(1),
               k_cache.size(2), k_cache.size(1));
  const at::Tensor qc = qkv.contiguous();
  at::Tensor q = at::empty({rows, heads, dim}, qkv.options().dtype(at::kFloat));
  if (dtype == at::kBFloat16) {
    store<c10::BFloat16>(qc, heads, kv_heads, dim, slot_p, k_cache, v_cache, q);
  } else {
    store<float>(qc, heads, kv_heads, dim, slot_p, k_cache, v_cache, q);
  }
  const at::Tensor attended = attend(op, q, k_cache, v_cache, tables, lens, scale);
  if (dtype == at::kFloat) return attended.view({rows, heads * dim});
  // Narrowed here, as torch's conversion rounds: a `.to(dtype)` was one more operator per
  // layer of every decode step (~30 a token).
  at::Tensor out = at::empty({rows, heads * dim}, qkv.options());
  const float* from = attended.data_ptr<float>();
  c10::BFloat16* to = out.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < rows * heads * dim; ++i) to[i] = narrow<c10::BFloat16>(from[i]);
  return out;
}

}  // namespace

TORCH_LIBRARY(kiln, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> Tensor");
  m.def(
      "decode_attention_(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "Tensor block_tables, Tensor context_lens, int heads, float scale) -> Tensor");
  m.def(
      "kv_store_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("decode_attention_", &decode_attention_);
  m.impl("kv_store_", &kv_store_);
}
