"""The disk a compile needs is known before it is spent: `kiln plan` and `kiln validate` state it
(per stage, per target), and `kiln compile` refuses, before any stage runs, an output whose
filesystem has less free than that, naming both numbers (exit 2).

The small disks are real: tmpfs mounts in a private user and mount namespace (`unshare -rm`, as
tests/compiler/test_disk_full.py does), so the free space is what the kernel reports.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.compiler.disk import DiskEstimate, human, needed
from kiln.compiler.preflight import disk_estimate, run_preflight
from kiln.compiler.recipe.recipe import load_recipe
from tests.compiler.test_disk_full import needs_tmpfs, on_full_disk

PAGE = 4096
COMPILE = [sys.executable, "-m", "kiln.compiler.cli", "compile"]


def recipe(tmp_path: Path, source: Path | str, *, tp: int = 2) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: budget\nmodel:\n  source: {source}\n"
        "quantization:\n  method: gptq\n  group_size: 64\n"
        "calibration:\n  dataset: builtin:licenses\n  num_samples: 4\n  max_seq_len: 64\n"
        "report:\n  dataset: builtin:licenses\n  num_samples: 2\n  max_seq_len: 64\n"
        f"targets: [h100-sxm, l40s]\ndeploy:\n  tp_size: {tp}\noutput: out\n"
    )
    return path


def estimate(path: Path, output: Path, *, force: bool = False) -> DiskEstimate:
    return disk_estimate(run_preflight(load_recipe(path), check_memory=False), output, force=force)


def blocks(root: Path) -> int:
    """Bytes the files under `root` hold on disk, each hard-linked file once (`du -s`)."""
    seen, total = set(), 0
    for folder, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            st = (Path(folder) / name).lstat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def pages(nbytes: int) -> str:
    return str(-(-nbytes // PAGE) * PAGE)


def test_plan_itemises_each_stage_and_names_the_targets_an_export_serves(
    tmp_path: Path, tiny_llama: Path
) -> None:
    result = CliRunner().invoke(main, ["plan", str(recipe(tmp_path, tiny_llama))])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = {
        line.split()[0]: line for line in lines[lines.index("disk (all targets: one compile)") :]
    }
    assert "used in place" in rows["source"]
    assert "W4A16_GPTQ checkpoint, offloading while calibrating" in rows["quantize"]
    assert "for h100-sxm, l40s" in rows["export-tp2"]
    assert "ModelOpt HF conversion" in rows["trtllm/hf/"]
    assert "with the 5% margin" in rows["peak"] and rows["free:"].startswith("free: ")


def test_the_float_half_is_counted_beside_the_quantiser_only_where_it_runs_there(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below compiler/pipeline.py's REFERENCE_BESIDE_MIN_PARAMETERS the report computes the
    float log-probabilities itself: they are its scratch, not the quantise stage's."""
    from kiln.compiler.disk import estimate as disk

    def parts() -> dict[str, Any]:
        return {p.name: p for p in estimate(recipe(tmp_path, tiny_llama), tmp_path / "out").parts}

    small = parts()
    assert "log-probabilities beside it" not in small["quantize"].note
    assert small["report"].scratch > 0  # the report's own
    monkeypatch.setattr(disk, "REFERENCE_BESIDE_MIN_PARAMETERS", 0)
    large = parts()
    assert "log-probabilities beside it" in large["quantize"].note
    assert large["quantize"].scratch == small["quantize"].scratch + small["report"].scratch


def test_plan_json_carries_the_estimate_beside_the_targets(
    tmp_path: Path, tiny_llama: Path
) -> None:
    result = CliRunner().invoke(main, ["plan", str(recipe(tmp_path, tiny_llama)), "--json"])
    assert result.exit_code == 0, result.stderr
    found = json.loads(result.stdout)
    assert set(found) == {"h100-sxm", "l40s", "disk"}
    disk = found["disk"]
    names = [p["name"] for p in disk["parts"]]
    assert names[:4] == ["source", "quantize", "report", "export-tp2"]
    assert disk["needed_bytes"] == needed(disk["peak_bytes"]) > disk["peak_bytes"] > 0
    assert disk["output"] == str(tmp_path / "out") and disk["same_filesystem"] is True
    assert disk["free_bytes"]["output"] > 0


def test_validate_states_what_the_compile_keeps_and_the_free_space(
    tmp_path: Path, tiny_llama: Path
) -> None:
    path = recipe(tmp_path, tiny_llama)
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("disk: ")]
    assert line.startswith("disk: a fresh compile keeps about ")
    assert "at its peak (5% margin included)" in line
    assert f"free on the filesystem of {tmp_path / 'out'}" in line
    elsewhere = tmp_path / "elsewhere"
    args = ["validate", str(path), "--output", str(elsewhere), "--json"]
    as_json = json.loads(CliRunner().invoke(main, args).stdout)
    assert as_json["valid"] and as_json["disk"]["stage_cache"] == str(elsewhere / ".kiln-cache")


def test_a_gguf_source_is_counted_as_its_float32_conversion(tmp_path: Path) -> None:
    found = estimate(recipe(tmp_path, "builtin:smollm2-135m-instruct", tp=1), tmp_path / "out")
    source = found.parts[0]
    assert source.note == "builtin converted to float32"
    assert source.bytes > 134_515_008 * 4  # SmolLM2-135M's parameters, float32


def test_the_estimate_bounds_what_a_compile_keeps(tmp_path: Path, tiny_llama: Path) -> None:
    path, out = recipe(tmp_path, tiny_llama), tmp_path / "out"
    before = estimate(path, out)
    result = CliRunner().invoke(main, ["compile", str(path)])
    assert result.exit_code == 0, result.stderr
    written = blocks(out)
    assert written <= before.total < 3 * written, (written, before.total)


def test_a_compile_that_ran_finds_every_stage_cached_and_needs_nothing(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """The estimate computes each stage's key as the pipeline does, artifact included."""
    path, out = recipe(tmp_path, tiny_llama), tmp_path / "out"
    assert CliRunner().invoke(main, ["compile", str(path)]).exit_code == 0
    after = estimate(path, out)
    assert after.cached == ["source", "quantize", "report", "export-tp2"]
    assert all(p.cached for p in after.parts) and after.peak == 0
    # --force runs every stage again: nothing is credited
    assert estimate(path, out, force=True).cached == []


def test_leftovers_of_a_killed_run_count_as_free(tmp_path: Path, tiny_llama: Path) -> None:
    """A killed compile's partial stage is removed before the stages run."""
    path, out = recipe(tmp_path, tiny_llama), tmp_path / "out"
    partial = out / ".kiln-cache" / "quantize" / ".0123456789ab-x.partial"
    partial.mkdir(parents=True)
    (partial / "offloaded.safetensors").write_bytes(b"\1" * 300_000)
    assert estimate(path, out).reclaimable >= 300_000


@needs_tmpfs
def test_a_compile_onto_a_disk_too_small_is_refused_before_any_stage(
    tmp_path: Path, tiny_llama: Path
) -> None:
    path, disk = recipe(tmp_path, tiny_llama), tmp_path / "small"
    disk.mkdir()
    out = disk / "artifacts"
    need = needed(estimate(path, out).peak)
    # What the disk holds afterwards, listed before the namespace (and its tmpfs) goes away.
    then_list = '"$@"; code=$?; echo on the disk:; ls -A "$TARGET"; exit $code'
    done = on_full_disk(disk, "sh", "-c", then_list, "sh", *COMPILE, str(path), "--output",
                        str(out), size="1m")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        f"{out}: the compile needs about {human(need)} there at its peak (stage cache "
    ) in done.stderr
    assert f"in {out}/.kiln-cache" in done.stderr and "but 1.0 MiB is free" in done.stderr
    assert "point --output (or the recipe's `output:`) at a larger disk" in done.stderr
    assert "KILN_NO_DISK_CHECK=1 skips this check" in done.stderr
    # Nothing was written there: no stage ran, no model loaded, not even the output folder.
    assert done.stdout.splitlines() == ["on the disk:"]


@needs_tmpfs
def test_a_compile_given_just_its_peak_completes_and_a_rerun_there_is_not_refused(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """The peak is a bound of what the compile holds at once: on a disk of exactly that size,
    with the margin's check skipped, every stage fits; then an unchanged recipe's rerun on the
    disk it filled needs nothing and is not refused."""
    path, disk = recipe(tmp_path, tiny_llama), tmp_path / "exact"
    disk.mkdir()
    out = disk / "artifacts"
    peak = estimate(path, out).peak
    run = f"{' '.join(COMPILE)} {path} --output {out}"
    script = f"KILN_NO_DISK_CHECK=1 {run} && {run}"
    done = on_full_disk(disk, "sh", "-c", script, size=pages(peak))
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stderr


@needs_tmpfs
def test_a_stage_cache_on_a_filesystem_of_its_own_makes_the_artifact_a_copy(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """Hard links cannot cross filesystems: the artifact copies the stage outputs, and each
    filesystem is checked for its own part."""
    path, out = recipe(tmp_path, tiny_llama), tmp_path / "out"
    (out / ".kiln-cache").mkdir(parents=True)
    plan = [sys.executable, "-m", "kiln.compiler.cli", "plan", str(path), "--json"]
    done = on_full_disk(out / ".kiln-cache", *plan, "--output", str(out), size="1m")
    assert done.returncode == 0, done.stderr
    disk = json.loads(done.stdout)["disk"]
    assert disk["same_filesystem"] is False
    assert disk["free_bytes"]["stage_cache"] == 1 << 20
    (linked,) = [part for part in disk["parts"] if part["where"] == "link"]
    assert disk["artifact_bytes"] > linked["bytes"] > 0
