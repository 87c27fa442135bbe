"""`kiln compile` end to end on a tiny model: artifact, caching, resume, inspect."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.runtime.formats import artifact
from tests.tiny_models import as_bin_checkpoint

REPO = Path(__file__).parents[2]


def recipe_file(
    tmp_path: Path,
    model: Path,
    *,
    samples: int = 8,
    seq: int = 64,
    method: str = "gptq",
    extra: str = "",
    report_samples: int = 4,
) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"""\
name: tiny-{method}
model:
  source: {model}
quantization:
  method: {method}
  group_size: 64
calibration:
  dataset: builtin:licenses
  num_samples: {samples}
  max_seq_len: {seq}
report:
  num_samples: {report_samples}
  max_seq_len: 64
output: out
{extra}""")
    return path


def kiln(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def published(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("compile")
    recipe = recipe_file(tmp, tiny_llama)
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    return recipe, json.loads(stdout)


def test_compile_publishes_a_content_addressed_artifact(compiled: tuple[Path, dict]) -> None:
    recipe, result = compiled
    path = Path(result["artifact"])
    assert path.parent == recipe.parent / "out"
    manifest = artifact.load_manifest(path)
    assert path.name == f"tiny-gptq-{manifest.digest[:12]}"
    assert result["digest"] == manifest.digest
    assert set(result["stages"]) == {"source", "quantize", "report", "package"}
    assert all(stage["status"] == "ran" for stage in result["stages"].values())
    assert "model/config.json" in manifest.files and "reports/quantization.json" in manifest.files
    assert manifest.recipe["quantization"]["weight_bits"] == 4
    assert manifest.source.architecture == "LlamaForCausalLM"
    assert {"torch", "transformers", "llmcompressor"} <= set(manifest.tools)
    assert artifact.verify(path) == []
    config = json.loads((path / "model" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"


def test_the_float_reference_made_beside_the_quantisation_leaves_nothing(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report's float log-probabilities, computed in a process of its own while the
    quantiser calibrated (for the tiny model too, with the size it starts from lowered), give
    the report and are removed once it has read them."""
    from kiln.compiler import pipeline

    monkeypatch.setattr(pipeline, "REFERENCE_BESIDE_MIN_PARAMETERS", 0)
    started: list[str] = []

    def counted(name: str) -> Any:
        real = getattr(pipeline, name)

        def start(*args: Any) -> Any:
            started.append(name)
            return real(*args)

        return start

    for name in ("start_process", "start_reference"):  # which way the process was started
        monkeypatch.setattr(pipeline, name, counted(name))
    import shutil

    source = shutil.copytree(tiny_llama, tmp_path / "source")  # a new source: hashed first
    recipe = recipe_file(tmp_path, source)
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    assert started == ["start_process"]  # while the new source was hashed, then its job handed
    assert "log-probabilities were computed beside the quantisation" in stderr
    assert "computing them now" not in stderr and "the report computes them" not in stderr
    report = json.loads((Path(json.loads(stdout)["artifact"]) / artifact.QUANT_REPORT).read_text())
    assert report["tokens"] > 0 and report["kl_mean"] >= 0
    assert list((tmp_path / "out" / ".kiln-cache").glob("*/.*")) == []  # nothing left


def test_rerun_of_an_unchanged_recipe_is_a_no_op(compiled: tuple[Path, dict]) -> None:
    recipe, first = compiled
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    again = json.loads(stdout)
    assert again["up_to_date"] is True
    assert again["artifact"] == first["artifact"]
    assert all(stage["status"] == "cached" for stage in again["stages"].values())
    code, _, stderr = kiln("compile", str(recipe))
    assert "up to date" in stderr


def test_force_recomputes_and_reproduces_the_same_digest(compiled: tuple[Path, dict]) -> None:
    recipe, first = compiled
    code, stdout, stderr = kiln("compile", str(recipe), "--json", "--force")
    assert code == 0, stderr
    again = json.loads(stdout)
    assert again["stages"]["quantize"]["status"] == "ran"
    assert again["digest"] == first["digest"]  # calibration is deterministic on CPU


def test_inspect_shows_and_verifies(compiled: tuple[Path, dict]) -> None:
    _, result = compiled
    code, stdout, _ = kiln("inspect", result["artifact"], "--verify")
    assert code == 0
    assert "tiny-gptq" in stdout and "all digests match" in stdout
    code, stdout, _ = kiln("inspect", result["artifact"], "--json")
    assert json.loads(stdout)["digest"] == result["digest"]


def test_inspect_verify_catches_a_changed_file(compiled: tuple[Path, dict], tmp_path: Path) -> None:
    _, result = compiled
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", result["artifact"], str(copy)], check=True)
    with open(copy / "model" / "config.json", "a") as handle:
        handle.write(" ")
    code, _, stderr = kiln("inspect", str(copy), "--verify")
    assert code == 3
    assert "model/config.json: sha256" in stderr


def test_inspect_of_a_non_artifact_is_a_clear_error(tmp_path: Path) -> None:
    code, _, stderr = kiln("inspect", str(tmp_path))
    assert code == 2  # a path that names no artifact is a usage error, as for serve and gate
    assert "not a kiln artifact" in stderr


def test_recipe_error_exits_2_and_creates_no_output(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = recipe_file(tmp_path, tiny_llama, extra="colour: blue\n")
    code, _, stderr = kiln("compile", str(recipe), "--json")
    assert code == 2
    assert "colour: unknown key" in stderr
    assert not (tmp_path / "out").exists()


def test_killed_compile_leaves_nothing_visible_and_the_next_run_resumes(
    tmp_path: Path, tiny_llama: Path
) -> None:
    recipe = recipe_file(tmp_path, tiny_llama, samples=256, seq=256)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.compiler.cli", "compile", str(recipe)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    quantize = tmp_path / "out" / ".kiln-cache" / "quantize"
    deadline = time.monotonic() + 120
    while not list(quantize.glob("*.partial")):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "quantize stage never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert published(tmp_path / "out") == []

    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["stages"]["source"]["status"] == "cached"
    assert result["stages"]["quantize"]["status"] == "ran"
    assert published(tmp_path / "out") == [Path(result["artifact"])]
    assert not list(quantize.glob("*.partial"))


def test_a_published_awq_checkpoint_compiles_without_recalibration(
    tmp_path: Path, tiny_llama: Path
) -> None:
    from tests.prequantized import make_awq_checkpoint

    awq = make_awq_checkpoint(tiny_llama, tmp_path / "awq", group_size=64).path
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: tiny-awq-import\nmodel:\n  source: {awq}\ntargets: [l40s]\n"
                      "output: out\n")  # fmt: skip
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    manifest = artifact.load_manifest(json.loads(stdout)["artifact"])
    assert manifest.scheme.scheme == "W4A16_AWQ"
    assert manifest.scheme.backend == "import"
    assert manifest.scheme.calibration is None
    assert "trtllm/tp1/rank0.safetensors" in manifest.files
    assert manifest.targets["l40s"].engine == "planned"


def test_a_recipe_that_contradicts_an_imported_checkpoint_is_refused(
    tmp_path: Path, tiny_llama: Path
) -> None:
    from tests.prequantized import make_awq_checkpoint

    awq = make_awq_checkpoint(tiny_llama, tmp_path / "awq", group_size=64).path
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: x\nmodel:\n  source: {awq}\nquantization:\n  method: gptq\n"
                      "  group_size: 64\n")  # fmt: skip
    code, _, stderr = kiln("validate", str(recipe))
    assert code == 2
    assert f"{recipe}:5: quantization.method:" in stderr


def test_tied_embeddings_export_to_tensorrt_llm(tmp_path: Path) -> None:
    from tests.tiny_models import make_tiny_model

    # SmolLM2 ties lm_head to the embedding and keeps lm_head unquantised (`ignore`).
    tied = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    recipe = recipe_file(tmp_path, tied, extra="targets: [l40s]\n")
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    manifest = artifact.load_manifest(json.loads(stdout)["artifact"])
    assert manifest.targets["l40s"].engine == "planned"
    assert "trtllm/tp1/rank0.safetensors" in manifest.files


def test_a_rerun_sweeps_every_temporary_a_killed_run_left(
    compiled: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe, first = compiled
    out = recipe.parent / "out"
    user_cache = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(user_cache))
    planted = [
        out / ".tiny-gptq-k1ll3d.partial" / "model",  # an artifact being assembled
        out / ".kiln-cache" / "quantize" / ".0123456789ab-k1ll3d.partial" / "model",
        user_cache / "kiln" / "sources" / ".hf_dir-0123456789abcdef.k1ll3d.tmp" / "model",
    ]
    for folder in planted:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"0" * 4096)
    manifest_tmp = Path(first["artifact"]) / ".manifest.json.tmp"
    manifest_tmp.write_text("{")

    code, stdout, stderr = kiln("compile", str(recipe), "--json")

    assert code == 0, stderr
    assert json.loads(stdout)["up_to_date"] is True
    assert not any(folder.parent.exists() for folder in planted)
    assert not manifest_tmp.exists()
    assert artifact.verify(Path(first["artifact"])) == []


def test_published_artifacts_carry_no_remote_code(tmp_path: Path, tiny_llama: Path) -> None:
    # A .bin checkpoint: the source stage converts it and keeps the source's other files.
    model = as_bin_checkpoint(tiny_llama, tmp_path / "remote-code-model")
    ran = tmp_path / "remote code ran"
    (model / "modeling_evil.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    for name, auto in [
        ("config.json", "AutoModelForCausalLM"),
        ("tokenizer_config.json", "AutoTokenizer"),
    ]:
        config = json.loads((model / name).read_text())
        config["auto_map"] = {auto: "modeling_evil.Evil"}
        (model / name).write_text(json.dumps(config))
    recipe = recipe_file(tmp_path, model, samples=4, seq=32)

    code, stdout, stderr = kiln("compile", str(recipe), "--json")

    assert code == 0, stderr
    path = Path(json.loads(stdout)["artifact"])
    assert not [p for p in path.rglob("*.py")]
    for config in path.rglob("*.json"):
        assert "auto_map" not in json.loads(config.read_text()), config
    assert artifact.verify(path) == []
    assert not ran.exists()


def _flip_one_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("force", [False, True])
def test_a_damaged_artifact_is_not_up_to_date_and_is_published_again(
    tmp_path: Path, tiny_llama: Path, force: bool
) -> None:
    recipe = recipe_file(tmp_path, tiny_llama)
    code, out, _ = kiln("compile", str(recipe), "--json")
    assert code == 0
    first = json.loads(out)
    weights = next(Path(first["artifact"], "model").glob("*.safetensors"))
    _flip_one_bit(weights)
    assert artifact.verify(first["artifact"])  # damaged
    code, out, _ = kiln("compile", str(recipe), "--json", *(["--force"] if force else []))
    assert code == 0
    again = json.loads(out)
    assert again["up_to_date"] is False
    assert again["artifact"] == first["artifact"] and again["digest"] == first["digest"]
    assert artifact.verify(again["artifact"]) == []  # republished whole
    code, out, _ = kiln("compile", str(recipe), "--json")
    assert json.loads(out)["up_to_date"] is True  # and now it is


MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")


def _memory_cgroup(name: str) -> Path | None:
    """A new cgroup-v1 memory group, where this machine lets the tests make one."""
    group = MEMORY_CGROUPS / name
    try:
        group.mkdir()
    except OSError:
        return None
    return group


def test_an_out_of_memory_kill_after_quantising_keeps_the_quantised_stage(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """The kernel's OOM killer ends a compile whose report outgrows its memory (the process
    is moved into a memory cgroup with a limit below what the report needs as soon as the
    quantise stage is published): nothing is published, and the rerun reuses the quantised
    stage and runs the report."""
    group = _memory_cgroup(f"kiln-test-{os.getpid()}")
    if group is None:
        pytest.skip("this machine lets no test make a memory cgroup (/sys/fs/cgroup/memory)")
    try:
        # enough held-out text that the report's forward needs megabytes of new memory
        recipe = recipe_file(tmp_path, tiny_llama, report_samples=64)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.compiler.cli", "compile", str(recipe)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        quantised = tmp_path / "out" / ".kiln-cache" / "quantize"
        deadline = time.monotonic() + 300
        while not list(quantised.glob("[!.]*/stage.json")):
            assert proc.poll() is None, "the compile ended before its quantise stage was kept"
            assert time.monotonic() < deadline, "the quantise stage never finished"
            time.sleep(0.01)
        (group / "memory.limit_in_bytes").write_text(str(4 * 2**20))
        (group / "cgroup.procs").write_text(str(proc.pid))  # new pages count against 4 MiB
        assert proc.wait(timeout=300) == -signal.SIGKILL
        assert "oom_kill 1" in (group / "memory.oom_control").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        group.rmdir()
    assert published(tmp_path / "out") == []

    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    stages = json.loads(stdout)["stages"]
    assert stages["quantize"]["status"] == "cached" and stages["report"]["status"] == "ran"


def test_each_file_an_artifact_links_is_hashed_once(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export thread hashes each folder the artifact links as soon as it is final (the
    quantised model, the TensorRT-LLM checkpoint, the PyTorch path's conversion), and the
    package publishes with those digests: every weight file is read for its sha256 once."""
    from kiln.compiler.compile import compile_recipe

    recipe = recipe_file(tmp_path, tiny_llama, extra="targets: [h100-sxm]\n")
    recipe.write_text(recipe.read_text().replace("method: gptq\n  group_size: 64", "method: fp8"))
    hashed: list[int] = []
    real = artifact.sha256_file

    def counted(path: Path) -> str:
        hashed.append(os.stat(path).st_ino)
        return real(path)

    monkeypatch.setattr(artifact, "sha256_file", counted)
    result = compile_recipe(recipe, output=tmp_path / "out")
    weights = sorted(result.artifact.rglob("*.safetensors"))
    linked = {p.relative_to(result.artifact).parts[:2] for p in weights}
    assert {("model", "model.safetensors"), ("trtllm", "tp1"), ("trtllm", "hf")} <= linked
    assert [hashed.count(os.stat(p).st_ino) for p in weights] == [1] * len(weights)
    assert artifact.verify(result.artifact) == []
