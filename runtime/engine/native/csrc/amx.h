// kiln runtime: what the AMX kernels (amx_linear.cpp, prefill_attention.cpp) share with each other
// and with the other native kernels. KILN_AMX is defined where the build targets AMX-BF16
// (-march=native on a CPU with it).

#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KILN_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kiln_amx {

#ifdef KILN_AMX
// Whether the OS lets this process use the tile unit: ARCH_REQ_XCOMP_PERM (0x1023) for
// XFEATURE_XTILEDATA (18), asked once per process.
inline bool permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// The operand of _tile_loadconfig (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif

// One bf16 row x (chunks * 32 values) against pair `pair` (32 output columns) of weight tiles
// from `amx_pack`: out[0..31] the float32 sums amx_linear computes for that row and those
// columns before its rounding, bit for bit (the int8 screen's candidates, greedy_head.py).
// False where the build or the OS has no AMX.
bool pair_row(const uint16_t* x, int64_t chunks, const uint16_t* tiles, int64_t pair,
              float* out);

}  // namespace kiln_amx
