"""Native CPU kernels of the runtime, compiled from runtime/engine/native/csrc/ on first use.

Hand-written where no installable library does the job on a CPU box (see each source's
header): single-token attention read straight from the paged KV cache, the decoder's
fused elementwise steps (residual add + RMSNorm, silu * up, rotary embedding), the
W4A16 layer's one-pass int4 dequantisation for prefill and its decode kernel for CPUs
without AVX-512, the bf16-weight linear layer for CPUs without native bf16 (its AMX form for
decode-sized row counts on CPUs with AMX, its AVX512-BF16 form for every row count on CPUs
with that but no AMX), a whole prompt chunk's
causal attention in bf16 on AMX or AVX512-BF16, the int8 screen of a greedy step's LM head
(greedy_head.py), and W8A8's activation quantisation and output scaling (int8_act.cpp). The
build uses torch's extension builder (a C++ compiler and ninja; ninja is a dependency), once per
machine and source version; the shared object is cached in torch's extensions directory
(TORCH_EXTENSIONS_DIR). Where the build is impossible (no C++ compiler, or no ninja) the
runtime logs why once and keeps its pure-torch path; KILN_NATIVE=0 turns the kernels off.
A build that fails with a compiler present is a bug in the source, never a
reason to fall back quietly: it raises NativeBuildError with the compiler's own errors.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from kiln.runtime.engine.native.extension import BuildLockTimeout, build_and_load

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / "paged_attention.cpp",
    CSRC / "elementwise.cpp",
    CSRC / "int4_dequant.cpp",
    CSRC / "bf16_linear.cpp",
    CSRC / "dpbf16_linear.cpp",
    CSRC / "int4_linear.cpp",
    CSRC / "int8_screen.cpp",
    CSRC / "amx_linear.cpp",
    CSRC / "prefill_attention.cpp",
    CSRC / "int8_act.cpp",
]
# included by the sources: part of the build key
HEADERS = [CSRC / "simd.h", CSRC / "amx.h", CSRC / "dpbf16.h"]
OPS = (
    "paged_decode_attention", "rms_norm", "add_rms_norm_", "silu_mul", "rope_", "int4_dequant",
    "bf16_pack", "bf16_linear", "int4_pack", "int4_linear", "decode_attention_",
    "int8_screen", "amx_ready", "amx_pack", "amx_linear", "argmax_rows", "kv_store_",
    "amx_prefill_attention", "bf16_flushes_subnormals", "int4_amx_pack", "int4_amx_linear",
    "int8_amx_pack", "int8_amx_linear", "int8_quantize", "int8_rescale", "dpbf16_ready",
    "dpbf16_pack", "dpbf16_linear", "dpbf16_prefill_attention",
)  # fmt: skip
# -march=native: the build is for the machine that runs it, so the cache key includes
# the CPU's feature flags (a shared home directory on another CPU rebuilds). KILN_NATIVE_MARCH
# names another target, one this CPU can run (GCC's -march: x86-64-v3 is AVX2 and FMA, what a
# Zen 3 EPYC gets; skylake-avx512 is AVX-512 without BF16): the kernels then take that CPU's
# paths, which is how the tests check them on a newer CPU (tests/runtime/test_native_builds.py).
# -fno-trapping-math: the kernels never read floating-point exception flags, and without it
# GCC keeps loops with clamps or selects (exp_poly, bf16 rounding) scalar.
MARCH = os.environ.get("KILN_NATIVE_MARCH", "native")
CFLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-fno-trapping-math"]

# What bf16_linear.cpp and int4_linear.cpp need to compile to their vector kernels under
# -march=native (without them they build scalar loops, slower than torch's).
AVX2_KERNEL_FLAGS = ("avx2", "fma")

MAX_ERROR_LINES = 30  # of the compiler's output quoted in NativeBuildError

_lock = threading.Lock()
_loaded: bool | None = None


class NativeBuildError(RuntimeError):
    """A native kernel source failed to build although a compiler and ninja are present."""


def available() -> bool:
    """Whether the native kernels are loaded (building them on first call); NativeBuildError
    when their source does not compile."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def avx2_kernels_available(flags: str | None = None) -> bool:
    """Whether kiln's AVX2 linear kernels (bf16 weights, int4 weights) serve this CPU
    (`flags`: its /proc/cpuinfo flags, read when None): AVX2 and FMA, and the native kernels
    load."""
    present = set((this_cpus_flags() if flags is None else flags).split())
    return all(f in present for f in AVX2_KERNEL_FLAGS) and available()


@functools.cache
def amx_kernels_available() -> bool:
    """Whether kiln's AMX kernels (amx_linear.cpp, prefill_attention.cpp's tiles) serve this
    CPU: AMX-BF16 in its flags, the native kernels load, and the OS lets the process use the
    tile unit."""
    present = set(this_cpus_flags().split())
    if not {"amx_bf16", "amx_tile", "avx512_bf16"} <= present or not available():
        return False
    return bool(torch.ops.kiln.amx_ready())


@functools.cache
def dpbf16_kernels_available() -> bool:
    """Whether kiln's AVX512-BF16 kernels (dpbf16_linear.cpp, prefill_attention.cpp's dot
    products) serve this CPU: the flag is there and the native kernels load built for it."""
    if "avx512_bf16" not in this_cpus_flags().split() or not available():
        return False
    return bool(torch.ops.kiln.dpbf16_ready())


@functools.cache
def this_cpus_flags() -> str:
    """/proc/cpuinfo's flags, read once: every dense layer of a model asks at load."""
    from kiln.runtime.engine.native.cpu import cpu_flags

    return cpu_flags()


def missing_toolchain() -> str | None:
    """What the build lacks on this machine (the C++ compiler, ninja), or None."""
    from torch.utils.cpp_extension import get_cxx_compiler, is_ninja_available

    compiler = get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; set CXX)"
    if not is_ninja_available():
        return "no ninja (pip install ninja)"
    return None


def build(sources: list[Path], name: str) -> None:
    """Compile and load `sources` as the torch extension `name` (extension.py: a killed
    build never blocks the next); NativeBuildError naming the sources and quoting the
    compiler's errors when they do not build, or naming the lock another build holds."""
    from torch.utils.cpp_extension import load

    def compile_into(directory: Path) -> None:
        load(
            name=name,
            sources=[str(path) for path in sources],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )

    try:
        build_and_load(name, compile_into)
    except BuildLockTimeout as error:
        raise NativeBuildError(str(error)) from error
    except (RuntimeError, OSError) as error:
        lines = str(error).splitlines()
        errors = [line for line in lines if "error" in line.lower()] or lines
        shown = "\n".join(errors[:MAX_ERROR_LINES])
        fix = "fix the source (this is a bug in kiln)"
        if MARCH != "native":
            fix = (
                f"KILN_NATIVE_MARCH={MARCH} may be what GCC refused: unset it, or name a "
                "-march GCC knows and this CPU can run (e.g. x86-64-v3)"
            )
        raise NativeBuildError(
            f"{', '.join(str(p) for p in sources)}: the native CPU kernel failed to build:\n"
            f"{shown}\n{fix}, or set KILN_NATIVE=0 to serve with the pure-torch path"
        ) from error


def _load() -> bool:
    if os.environ.get("KILN_NATIVE", "1") == "0":
        return False
    missing = missing_toolchain()
    if missing is not None:
        log.warning(
            "kiln runtime: native CPU kernels unavailable (%s); decode attention uses the "
            "pure-torch path (slower). Install one, or set KILN_NATIVE=0 to silence.",
            missing,
        )
        return False
    log.info("kiln runtime: loading native CPU kernels (built once per machine, ~20 s)")
    build(SOURCES, f"kiln_native_{_build_key()}")
    missing_ops = [op for op in OPS if not hasattr(torch.ops.kiln, op)]
    if missing_ops:
        raise NativeBuildError(
            f"{SOURCES[0]}: built, but registers no {', '.join(missing_ops)}; the source and "
            "OPS disagree (a bug in kiln)"
        )
    return True


def _build_key() -> str:
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
        digest.update(flags.encode())
    except (OSError, StopIteration):
        pass
    return digest.hexdigest()[:12]
