// kiln runtime: what the AVX512-BF16 kernels (dpbf16_linear.cpp, prefill_attention.cpp) share
// with each other and with the int8 screen. KILN_DPBF16 is defined where the build targets
// AVX512-BF16 with AVX-512 BW and VL (-march=native on a Zen 4 EPYC or a Xeon since Cooper
// Lake).

#pragma once

#include <cstdint>

#include "simd.h"

#if defined(KILN_AVX512) && defined(__AVX512BF16__)
#define KILN_DPBF16 1
#include <immintrin.h>
#endif

namespace kiln_dpbf16 {

// One bf16 row x (KP pairs: an even K, as dpbf16_linear reads it) against output columns
// [16 g, 16 g + 16) of a weight from `dpbf16_pack`: out[0..15] the float32 sums dpbf16_linear
// computes for that row and those columns before its rounding, bit for bit (the same
// VDPBF16PS per pair, in the same order: the int8 screen's candidates, greedy_head.py). False
// where the build has no AVX512-BF16.
bool column_sums(const uint16_t* x, int64_t KP, const uint16_t* packed, int64_t g, float* out);

}  // namespace kiln_dpbf16
