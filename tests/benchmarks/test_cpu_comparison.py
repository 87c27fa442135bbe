"""cpu_comparison's `--isa avx2`: which builds and settings each server would be started with."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.benchmarks import comparators
from tests.benchmarks.comparators import SetupError
from tests.benchmarks.cpu_comparison import SERVERS, machine


def run_args(isa: str) -> argparse.Namespace:
    return argparse.Namespace(isa=isa, threads=1)


def test_kiln_is_held_to_avx2_only_when_asked() -> None:
    native = SERVERS["kiln"](Path("model"), 8000, run_args("native"), 1)
    held = SERVERS["kiln"](Path("model"), 8000, run_args("avx2"), 1)

    assert "KILN_NATIVE_MARCH" not in native.env
    assert held.env["KILN_NATIVE_MARCH"] == "x86-64-v3"
    assert held.env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert held.env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert held.argv == native.argv


def test_vllm_cpu_is_refused_under_avx2_with_the_reason() -> None:
    with pytest.raises(SetupError, match="--isa native"):
        SERVERS["vllm-cpu"](Path("model"), 8000, run_args("avx2"), 1)


def test_llama_server_avx2_build_lives_beside_the_native_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("llama.cpp", "llama.cpp-avx2"):  # both already built: no cmake runs
        binary = tmp_path / name / "build" / "bin" / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.touch()
        (tmp_path / name / ".kiln-ready").touch()
    monkeypatch.setattr(comparators, "smollm2_gguf", lambda: Path("model.gguf"))

    native = comparators.llama_server(8000, 1, 1, cache=tmp_path)
    held = comparators.llama_server(8000, 1, 1, cache=tmp_path, isa="avx2")

    assert native.argv[0] == str(tmp_path / "llama.cpp" / "build" / "bin" / "llama-server")
    assert held.argv[0] == str(tmp_path / "llama.cpp-avx2" / "build" / "bin" / "llama-server")
    assert "-DGGML_AVX512=OFF" in comparators.LLAMA_ISA["avx2"]


def test_the_table_header_says_the_servers_were_held() -> None:
    assert "held to AVX2 (--isa avx2)" in machine("avx2")
    assert "held" not in machine("native")
