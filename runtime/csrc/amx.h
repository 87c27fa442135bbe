// kiln runtime: what amx_linear.cpp shares with the other native kernels.

#pragma once

#include <cstdint>

namespace kiln_amx {

// One bf16 row x (chunks * 32 values) against pair `pair` (32 output columns) of weight tiles
// from `amx_pack`: out[0..31] the float32 sums amx_linear computes for that row and those
// columns before its rounding, bit for bit (the int8 screen's candidates, greedy_head.py).
// False where the build or the OS has no AMX.
bool pair_row(const uint16_t* x, int64_t chunks, const uint16_t* tiles, int64_t pair,
              float* out);

}  // namespace kiln_amx
