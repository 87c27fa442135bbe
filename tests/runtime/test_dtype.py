"""`--dtype auto`: bf16 on CPUs that compute it natively or where kiln's AVX2 bf16-weight
kernel serves, float32 on others, the checkpoint's dtype on GPUs; an explicit dtype is taken
as given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.dtype import choose_dtype
from kiln.runtime.engine.native.cpu import cpu_flags, native_bf16

CPU = torch.device("cpu")
UNSET = ""  # KILN_DTYPE as if unset (the suite pins it)
# Flag lines as /proc/cpuinfo prints them (shortened).
SAPPHIRE_RAPIDS = "fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"
ZEN4 = "fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 avx512_vp2intersect"
ICE_LAKE = "fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_vbmi2"
AMX_ONLY = "fpu sse2 avx2 amx_tile amx_bf16"
ZEN3 = "fpu sse2 fma f16c avx2 bmi2 vaes vpclmulqdq"
SANDY_BRIDGE = "fpu sse2 sse4_2 avx"


def test_native_bf16_names_the_flag_that_grants_it() -> None:
    assert native_bf16(SAPPHIRE_RAPIDS) == "avx512_bf16"
    assert native_bf16(ZEN4) == "avx512_bf16"
    assert native_bf16(AMX_ONLY) == "amx_bf16"
    assert native_bf16(ICE_LAKE) is None  # AVX-512 and VNNI, but bf16 only emulated
    assert native_bf16("") is None
    assert native_bf16("xavx512_bf16 avx512_bf16x") is None  # whole flags only


def test_auto_is_bf16_where_the_cpu_computes_it_natively() -> None:
    for flags in (SAPPHIRE_RAPIDS, ZEN4, AMX_ONLY):
        choice = choose_dtype("auto", {"dtype": "float32"}, CPU, flags, UNSET)
        assert choice.dtype == torch.bfloat16
        assert "natively" in choice.reason and native_bf16(flags) in choice.reason
    slow = choose_dtype("auto", {"dtype": "bfloat16"}, CPU, ICE_LAKE, UNSET, bf16_kernel=False)
    assert slow.dtype == torch.float32 and slow.name == "float32"
    assert "no native bf16" in slow.reason


def test_auto_is_bf16_where_kilns_bf16_weight_kernel_serves_the_cpu() -> None:
    choice = choose_dtype("auto", {"dtype": "float32"}, CPU, ZEN3, UNSET, bf16_kernel=True)
    assert choice.dtype == torch.bfloat16
    assert "AVX2 kernel" in choice.reason and "float32" in choice.reason


def test_auto_asks_whether_the_kernel_serves_a_cpu_without_avx2() -> None:
    # No AVX2/FMA: the kernel would be a scalar loop, so auto stays float32 (decided from the
    # flags alone, without building anything).
    old = choose_dtype("auto", {}, CPU, SANDY_BRIDGE, UNSET)
    assert old.dtype == torch.float32 and "nor AVX2 with FMA" in old.reason


def test_an_explicit_dtype_wins_on_any_cpu() -> None:
    for flags in (SAPPHIRE_RAPIDS, ICE_LAKE):
        assert choose_dtype("float32", {}, CPU, flags).dtype == torch.float32
        assert choose_dtype("bfloat16", {}, CPU, flags).dtype == torch.bfloat16
    assert choose_dtype("float16", {}, CPU, ICE_LAKE).reason == "--dtype float16"


def test_auto_on_a_gpu_keeps_the_checkpoints_dtype() -> None:
    gpu = torch.device("cuda")
    assert choose_dtype("auto", {"torch_dtype": "float16"}, gpu, "", UNSET).dtype == torch.float16
    assert choose_dtype("auto", {"dtype": "float32"}, gpu, "", UNSET).dtype == torch.float32
    assert choose_dtype("auto", {}, gpu, "", UNSET).dtype == torch.bfloat16


def test_cpu_flags_reads_the_flags_line_of_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\n"
        f"flags\t\t: {SAPPHIRE_RAPIDS}\nbugs\t\t: spectre_v1\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert cpu_flags(cpuinfo) == SAPPHIRE_RAPIDS


def test_kiln_dtype_says_what_auto_means_and_an_explicit_dtype_still_wins() -> None:
    pinned = choose_dtype("auto", {}, CPU, SAPPHIRE_RAPIDS, override="float32")
    assert pinned.dtype == torch.float32 and pinned.reason == "auto: KILN_DTYPE=float32"
    assert choose_dtype("auto", {}, CPU, ICE_LAKE, override="bfloat16").dtype == torch.bfloat16
    assert choose_dtype("float16", {}, CPU, ICE_LAKE, override="float32").dtype == torch.float16
    with pytest.raises(UsageError, match="KILN_DTYPE='fp32' is not a dtype; set it to one of"):
        choose_dtype("auto", {}, CPU, ICE_LAKE, override="fp32")


def test_without_cpuinfo_the_flags_come_from_torchs_probes(tmp_path: Path) -> None:
    flags = cpu_flags(tmp_path / "absent").split()
    assert set(flags) <= {"avx512_bf16", "amx_bf16"}
