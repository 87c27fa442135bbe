// kiln runtime: int4 weights (two codes per byte) dequantised in one pass, CPU.
//
// Hand-written because torch has no operator for it: the W4A16 layer's prefill path needs
// the float weight w[n, 2j + h] = (u - 8) * scale[n, g] + zero[n, g], u the low (h = 0) or
// high (h = 1) nibble of byte j of row n and g its column's group, and torch spells that as
// five operators over the whole weight (split the nibbles, interleave, widen, scale,
// shift), each a pass over [N, K]. Here each byte is read once and each weight written
// once, computed in float32 as torch computes it (a multiply, then an add; where the
// compiler fuses the two, the last bit may differ) and stored as float32 or rounded to
// bfloat16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "simd.h"

namespace {

using namespace kiln_simd;

template <typename T>
void dequant_rows(const uint8_t* nibbles, const float* scale, const float* zero, T* out,
                  int64_t N, int64_t K, int64_t group) {
  const int64_t groups = K / group, half = group / 2;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* in = nibbles + n * (K / 2) + g * half;
        T* dst = out + n * K + g * group;
        const float s = scale[n * groups + g], z = zero[n * groups + g];
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float low = static_cast<float>(in[j] & 15) - 8.f;
          const float high = static_cast<float>(in[j] >> 4) - 8.f;
          dst[2 * j] = narrow<T>(low * s + z);
          dst[2 * j + 1] = narrow<T>(high * s + z);
        }
      }
    }
  });
}

at::Tensor int4_dequant(const at::Tensor& nibbles, const at::Tensor& scale,
                        const at::Tensor& zero, int64_t group, at::ScalarType dtype) {
  TORCH_CHECK(nibbles.device().is_cpu() && nibbles.scalar_type() == at::kByte &&
                  nibbles.dim() == 2 && nibbles.is_contiguous(),
              "int4_dequant: contiguous uint8 nibbles [N, K / 2] on the CPU");
  const int64_t N = nibbles.size(0), K = nibbles.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0,
              "int4_dequant: an even group size dividing K");
  for (const at::Tensor* t : {&scale, &zero}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == N && t->size(1) == K / group,
                "int4_dequant: contiguous float32 scale and zero [N, K / group]");
  }
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "int4_dequant: float32 or bfloat16 output");
  at::Tensor out = at::empty({N, K}, nibbles.options().dtype(dtype));
  const uint8_t* in = nibbles.data_ptr<uint8_t>();
  if (dtype == at::kFloat) {
    dequant_rows(in, scale.data_ptr<float>(), zero.data_ptr<float>(), out.data_ptr<float>(), N,
                 K, group);
  } else {
    dequant_rows(in, scale.data_ptr<float>(), zero.data_ptr<float>(),
                 out.data_ptr<c10::BFloat16>(), N, K, group);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("int4_dequant(Tensor nibbles, Tensor scale, Tensor zero, int group, ScalarType dtype)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("int4_dequant", &int4_dequant); }
