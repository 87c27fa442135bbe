"""Hostile or damaged input is refused with exit 2 and the input named, never exit 3
("internal error") and never accepted silently."""

from __future__ import annotations

import errno
import os
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main

BINARY = bytes(range(255, -1, -1)) * 8  # neither UTF-8 nor text, from its first byte


def recipe(
    tmp_path: Path, source: Path, *, dataset: str = "builtin:licenses", extra: str = ""
) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: bad-input\nmodel:\n  source: {source}\nquantization:\n  method: gptq\n"
        f"  group_size: 64\ncalibration:\n  dataset: {dataset}\n  num_samples: 4\n{extra}"
    )
    return path


def kiln(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stderr


def gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


HOSTILE_GGUF = {
    # more key/value pairs promised than the file holds: gguf raised IndexError
    "truncated": b"GGUF" + struct.pack("<IQQ", 3, 0, 5),
    # a tensor count far beyond the file
    "tensors": b"GGUF" + struct.pack("<IQQ", 3, 1 << 30, 0),
    # the architecture an array of numbers, not a name
    "array": b"GGUF"
    + struct.pack("<IQQ", 3, 0, 1)
    + gguf_string("general.architecture")
    + struct.pack("<IIQ", 9, 4, 2)
    + struct.pack("<II", 7, 8),
}


@pytest.mark.parametrize("header", sorted(HOSTILE_GGUF))
def test_a_hostile_gguf_header_exits_2_naming_the_file(
    tmp_path: Path, header: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    gguf = tmp_path / "hostile.gguf"
    gguf.write_bytes(HOSTILE_GGUF[header])
    code, stderr = kiln("validate", str(recipe(tmp_path, gguf)))
    assert code == 2, stderr
    assert f"{gguf}" in stderr and "internal error" not in stderr


@pytest.mark.parametrize("suffix", ["jsonl", "txt"])
def test_a_binary_calibration_file_exits_2_naming_it(
    tmp_path: Path, tiny_llama: Path, suffix: str
) -> None:
    data = tmp_path / f"calib.{suffix}"
    data.write_bytes(BINARY)
    code, stderr = kiln("validate", str(recipe(tmp_path, tiny_llama, dataset=str(data))))
    assert code == 2, stderr
    assert f"{data}:1: not UTF-8 text" in stderr


def test_a_text_file_with_nul_bytes_is_refused(tmp_path: Path, tiny_llama: Path) -> None:
    data = tmp_path / "calib.txt"
    data.write_bytes(b"valid UTF-8 text\n\nthen\x00\x00\x00 zeros of a binary file\n")
    code, stderr = kiln("validate", str(recipe(tmp_path, tiny_llama, dataset=str(data))))
    assert code == 2, stderr
    assert f"{data}:3: not UTF-8 text" in stderr


def test_binary_recorded_traffic_exits_2_naming_it(tmp_path: Path, tiny_llama: Path) -> None:
    data = tmp_path / "traffic.jsonl"
    data.write_bytes(BINARY)
    code, stderr = kiln("validate", str(recipe(tmp_path, tiny_llama, dataset=f"traffic:{data}")))
    assert code == 2, stderr
    assert f"{data}:1: not UTF-8 text" in stderr


def test_truncated_safetensors_fail_validate(tmp_path: Path, tiny_llama: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, stderr = kiln("validate", str(recipe(tmp_path, model)))
    assert code == 2, stderr
    assert f"{weights} is damaged or truncated" in stderr


def test_a_missing_shard_fails_validate(tmp_path: Path, tiny_llama: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}'
    )
    code, stderr = kiln("validate", str(recipe(tmp_path, model)))
    assert code == 2, stderr
    assert "names missing weight files: model-00002-of-00002.safetensors" in stderr


def test_an_output_that_is_a_file_exits_2(tmp_path: Path, tiny_llama: Path) -> None:
    (tmp_path / "out").write_text("not a directory\n")
    path = recipe(tmp_path, tiny_llama, extra="output: out\n")
    code, stderr = kiln("validate", str(path))
    assert code == 2, stderr
    assert f"output: {tmp_path / 'out'} is a file" in stderr
    code, stderr = kiln("compile", str(path))
    assert code == 2, stderr
    assert (tmp_path / "out").read_text() == "not a directory\n"


def test_an_output_under_proc_exits_2(tmp_path: Path, tiny_llama: Path) -> None:
    code, stderr = kiln("validate", str(recipe(tmp_path, tiny_llama, extra="output: /proc/kiln\n")))
    assert code == 2, stderr
    assert "output: /proc/kiln is under /proc, a kernel filesystem" in stderr


def test_compile_output_option_is_checked_too(tmp_path: Path, tiny_llama: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, stderr = kiln(
        "compile", str(recipe(tmp_path, tiny_llama)), "--output", str(blocker / "out")
    )
    assert code == 2, stderr
    assert f"cannot be created: {blocker} is a file" in stderr


def test_a_full_disk_is_said_so_not_reported_as_an_internal_error() -> None:
    import click

    from kiln.compiler.cli.exits import handle_errors

    @click.command()
    @handle_errors
    def writes() -> None:
        # What a write onto a full disk raises (test_disk_full.py fills a real one); not
        # /dev/full, which a machine without the device would create as a file.
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/out/model.safetensors")

    result = CliRunner().invoke(writes, [])
    assert result.exit_code == 3
    assert "no space left on the device" in result.stderr and "internal error" not in result.stderr
