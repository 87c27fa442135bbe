"""`kiln compile` runs the recipe's gate and, with --promote, promotes only on a pass."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.compiler.compile import CompileResult, compile_recipe
from kiln.compiler.gating import gate_compiled
from kiln.compiler.recipe.recipe import Recipe, load_recipe
from kiln.gates.releases import Registry
from kiln.runtime.base.errors import ArtifactError, UsageError
from kiln.runtime.formats import artifact
from tests.compiler.test_compile import kiln, published
from tests.gates.conftest import build_artifact

RECIPE = """\
name: tiny-{method}
model:
  source: {model}
quantization:
  method: {method}
calibration:
  dataset: builtin:licenses
  num_samples: 8
  max_seq_len: 64
report:
  num_samples: 2
  max_seq_len: 32
output: out
"""
# Small enough for a tiny model in seconds; no shadow traffic.
GATES = """\
gates:
  tasks: [kiln_mc]
  limit: 8
  divergence: {{num_texts: 2, max_seq_len: 32, top_k: 10}}
  thresholds: {thresholds}
"""


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def gated_recipe(tmp: Path, model: Path, method: str, thresholds: str = "{}") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "recipe.yaml"
    path.write_text(RECIPE.format(model=model, method=method) + GATES.format(thresholds=thresholds))
    return path


def test_a_passing_gate_promotes_and_is_recorded_outside_the_digest(
    tiny_llama: Path, tmp_path: Path
) -> None:
    recipe = gated_recipe(tmp_path, tiny_llama, "fp8")
    db = str(tmp_path / "registry.db")
    code, stdout, stderr = kiln("compile", str(recipe), "--promote", "staging", "--registry", db,
                                "--json")  # fmt: skip
    assert code == 0, stderr
    result = json.loads(stdout)
    gate = result["gate"]
    assert gate["passed"] and not gate["cached"] and gate["baseline"]["kind"] == "source"
    path = Path(result["artifact"])
    manifest = artifact.load_manifest(path)
    assert manifest.gate is not None and manifest.gate.passed is True
    assert artifact.verify(path) == []  # the verdict lives in the manifest, not in the files
    reports = Path(gate["reports"])
    assert {"gate.json", "gate.md", "gate.html"} <= {p.name for p in reports.iterdir()}
    verdict = json.loads((reports / "gate.json").read_text())
    assert verdict["candidate"]["digest"] == manifest.digest
    with Registry(db) as registry:
        state = registry.channel("staging")
        assert state is not None and state.current_digest == manifest.digest
        assert len(registry.gate_runs(manifest.digest)) == 1
    # An unchanged re-run reuses the verdict and leaves the channel as it is.
    code, stdout, stderr = kiln("compile", str(recipe), "--promote", "staging", "--registry", db,
                                "--json")  # fmt: skip
    assert code == 0, stderr
    again = json.loads(stdout)["gate"]
    assert again["cached"] and again["promotion"] is None
    with Registry(db) as registry:
        assert len(registry.gate_runs(manifest.digest)) == 1


def test_a_failing_gate_exits_1_and_promotes_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    # 4-bit GPTQ on a random tiny model moves next-token distributions far more than this.
    recipe = gated_recipe(tmp_path, tiny_llama, "gptq", "{kl_mean: 0.00001}")
    db = str(tmp_path / "registry.db")
    code, _, stderr = kiln("compile", str(recipe), "--promote", "prod", "--registry", db)
    assert code == 1
    assert "gate failed" in stderr and "KL divergence mean" in stderr
    assert "prod was not promoted" in stderr
    # The artifact itself is complete and verifiable; its reports sit beside it.
    (path,) = [p for p in published(tmp_path / "out") if (p / artifact.MANIFEST).is_file()]
    assert artifact.verify(path) == []
    gate = artifact.load_manifest(path).gate
    assert gate is not None and gate.passed is False
    with Registry(db) as registry:
        state = registry.channel("prod")
        assert state is None or state.current_digest is None


def test_promote_gates_against_what_the_channel_serves(tiny_llama: Path, tmp_path: Path) -> None:
    db = str(tmp_path / "registry.db")
    first = gated_recipe(tmp_path / "a", tiny_llama, "fp8")
    code, stdout, stderr = kiln("compile", str(first), "--promote", "prod", "--registry", db,
                                "--json")  # fmt: skip
    assert code == 0, stderr
    serving = json.loads(stdout)["digest"]
    second = gated_recipe(tmp_path / "b", tiny_llama, "fp8_dynamic")
    code, stdout, stderr = kiln("compile", str(second), "--promote", "prod", "--registry", db,
                                "--json")  # fmt: skip
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["gate"]["baseline"]["kind"] == "artifact"
    assert result["gate"]["baseline"]["digest"] == serving
    assert result["gate"]["promotion"]["previous_digest"] == serving


def test_promote_without_a_gate_is_refused_before_any_work(
    tiny_llama: Path, tmp_path: Path
) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=tiny_llama, method="fp8"))
    code, _, stderr = kiln("compile", str(recipe), "--promote", "prod",
                           "--registry", str(tmp_path / "r.db"))  # fmt: skip
    assert code == 2 and "no `gates:` section" in stderr
    gated = gated_recipe(tmp_path / "g", tiny_llama, "fp8")
    code, _, stderr = kiln("compile", str(gated), "--promote", "prod", "--no-gate")
    assert code == 2 and "--no-gate" in stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "g" / "out").exists()


def test_a_gate_on_an_engine_this_machine_lacks_is_refused_before_any_work(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KILN_TRTLLM_SERVE", raising=False)
    gated = gated_recipe(tmp_path, tiny_llama, "fp8")
    gated.write_text(gated.read_text() + "  engine: trtllm\n")
    code, _, stderr = kiln("compile", str(gated))
    assert code == 2
    assert "gates.engine: --engine trtllm: TensorRT-LLM is not installed here" in stderr
    assert "compile with --no-gate" in stderr and f"{gated}:" in stderr
    assert not (tmp_path / "out").exists()


def test_one_layer_with_corrupted_scales_fails_a_gate_with_tightened_kl_and_top1(
    tiny_llama: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from kiln.gates.run import run_gate
    from kiln.gates.settings import load_gates
    from tests.gates.conftest import build_artifact

    # Not the default thresholds: a random tiny model's next-token distributions are nearly
    # flat, so perplexity, task accuracy and the default KL bound barely move; KL and top-1
    # agreement do (FP8: ~0.0007 and ~0.84 here), so this gate tightens exactly those two.
    strict = "{kl_mean: 0.003, top1_agreement: 0.5}"
    recipe = gated_recipe(tmp_path / "fp8", tiny_llama, "fp8", strict)
    code, stdout, stderr = kiln("compile", str(recipe), "--registry", str(tmp_path / "r.db"),
                                "--json")  # fmt: skip
    assert code == 0 and json.loads(stdout)["gate"]["passed"], stderr
    model = tmp_path / "corrupt-model"
    shutil.copytree(Path(json.loads(stdout)["artifact"]) / artifact.MODEL_DIR, model)
    weights = load_file(model / "model.safetensors")
    (name,) = [k for k in weights if k.endswith("layers.0.mlp.down_proj.weight_scale")]
    weights[name] = weights[name] * 16
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    corrupt = build_artifact(tmp_path / "arts", name="corrupt", model_dir=model)
    gates = load_gates(
        {"tasks": ["kiln_mc"], "limit": 8, "thresholds": {"kl_mean": 0.003, "top1_agreement": 0.5}},
        "test",
    )
    verdict = run_gate(str(corrupt), str(tiny_llama), gates, tmp_path / "out").verdict
    assert not verdict.passed
    failed = {c.name for c in verdict.failed_checks}
    assert {"KL divergence mean", "top-1 agreement"} <= failed, failed


@pytest.mark.parametrize("registry_after", ["same", "fresh"])
def test_a_rerun_does_not_trust_a_gate_json_edited_to_pass(
    tiny_llama: Path, tmp_path: Path, registry_after: str
) -> None:
    # gate.json lies outside the digest: edited to pass, it is neither reused nor recorded.
    recipe = gated_recipe(tmp_path, tiny_llama, "gptq", "{kl_mean: 0.00001}")
    db = str(tmp_path / "registry.db")
    code, _, stderr = kiln("compile", str(recipe), "--registry", db)
    assert code == 1, stderr
    (path,) = [p for p in published(tmp_path / "out") if (p / artifact.MANIFEST).is_file()]
    gate_json = Path(artifact.load_manifest(path).gate.reports) / "gate.json"  # type: ignore[union-attr]
    verdict = json.loads(gate_json.read_text())
    verdict["passed"] = True
    for check in verdict["checks"]:
        check["passed"] = True
    gate_json.write_text(json.dumps(verdict))
    again = db if registry_after == "same" else str(tmp_path / "fresh.db")
    code, stdout, stderr = kiln("compile", str(recipe), "--promote", "prod", "--registry", again,
                                "--json")  # fmt: skip
    assert code == 1 and "prod was not promoted" in stderr
    gate = json.loads(stdout)["gate"]
    assert not gate["cached"] and not gate["passed"]
    with Registry(again) as registry:
        assert all(not run["passed"] for run in registry.gate_runs())
        state = registry.channel("prod")
        assert state is None or state.current_digest is None


# --- the gate step against other writers: the manifest, and the channel ---------------------


@dataclass
class Compiled:
    recipe: Recipe
    result: CompileResult


@pytest.fixture(scope="module")
def serving_and_candidate(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path
) -> tuple[Compiled, Compiled]:
    """Two gated recipes of one tiny model, compiled once: a release and a candidate."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("gate-races")
    out = []
    for method in ("fp8", "fp8_dynamic"):
        recipe = gated_recipe(tmp / method, tiny_llama, method)
        out.append(Compiled(load_recipe(recipe), compile_recipe(recipe)))
    return out[0], out[1]


def passing(candidate: Path, baseline: str, kind: str) -> dict[str, Any]:
    """A passing verdict of `candidate` against `baseline` (what `kiln gate` records)."""
    return {
        "passed": True,
        "candidate": {"kind": "artifact", "digest": artifact.load_manifest(candidate).digest},
        "baseline": {"kind": kind, "digest": baseline},
        "checks": [],
    }


def test_the_gate_step_keeps_a_manifest_update_made_while_it_ran(
    serving_and_candidate: tuple[Compiled, Compiled], tmp_path: Path
) -> None:
    _, candidate = serving_and_candidate
    path = candidate.result.artifact

    def another_writer(_: str) -> None:  # records something on the manifest mid-gate
        manifest = artifact.load_manifest(path)
        manifest.extra["written_meanwhile"] = manifest.extra.get("written_meanwhile", 0) + 1
        artifact.write_manifest(path, manifest)

    with Registry(tmp_path / "registry.db") as registry:
        step = gate_compiled(candidate.result, candidate.recipe, registry=registry, force=True,
                             progress=another_writer)  # fmt: skip
    assert step is not None and step.run_id is not None
    manifest = artifact.load_manifest(path)
    assert manifest.gate is not None and manifest.gate.run_id == step.run_id
    assert manifest.extra["written_meanwhile"] >= 1
    assert artifact.verify(path) == []


def test_a_verdict_against_what_served_does_not_promote_once_the_channel_moved(
    serving_and_candidate: tuple[Compiled, Compiled], tmp_path: Path
) -> None:
    serving, candidate = serving_and_candidate
    x, c = serving.result.artifact, candidate.result.artifact
    db = tmp_path / "registry.db"
    y = build_artifact(tmp_path / "arts", name="hotfix")  # promoted by someone else mid-gate
    x_digest, y_digest = artifact.load_manifest(x).digest, artifact.load_manifest(y).digest
    with Registry(db) as registry:
        registry.record_gate_run(passing(x, "f" * 64, "source"), x)
        registry.promote(x, "prod")
        registry.record_gate_run(passing(y, x_digest, "artifact"), y)
        # An older pass of the candidate against y: it must not stand in for this verdict.
        registry.record_gate_run(passing(c, y_digest, "artifact"), c)
        promoted: list[dict[str, Any]] = []

        def someone_promotes(_: str) -> None:
            if not promoted:
                with Registry(db) as other:
                    promoted.append(other.promote(y, "prod"))

        with pytest.raises(UsageError) as caught:
            gate_compiled(candidate.result, candidate.recipe, registry=registry, promote="prod",
                          force=True, progress=someone_promotes)  # fmt: skip
        message = caught.value.message
        assert "prod" in message and x_digest[:12] in message and y_digest[:12] in message
        assert "kiln compile --promote prod" in message
        state = registry.channel("prod")
        assert state is not None and state.current_digest == y_digest
        (run,) = [r for r in registry.gate_runs(artifact.load_manifest(c).digest)
                  if r["baseline"] == x_digest]  # fmt: skip
        assert run["passed"]  # the gate passed; the promotion was refused all the same


def test_the_channel_baseline_is_identified_by_its_digest_not_its_path(
    serving_and_candidate: tuple[Compiled, Compiled], tmp_path: Path
) -> None:
    _, candidate = serving_and_candidate
    db = tmp_path / "registry.db"
    x = build_artifact(tmp_path / "arts", b"release", name="release")
    x_digest = artifact.load_manifest(x).digest
    with Registry(db) as registry:
        registry.record_gate_run(passing(x, "f" * 64, "source"), x)
        registry.promote(x, "prod")
    # The directory the registry recorded for what serves now holds another artifact.
    shutil.rmtree(x)
    shutil.copytree(build_artifact(tmp_path / "other", b"other", name="release"), x)
    with Registry(db) as registry, pytest.raises(ArtifactError) as caught:
        gate_compiled(candidate.result, candidate.recipe, registry=registry, promote="prod")
    message = caught.value.message
    assert "--promote prod" in message and x_digest[:12] in message and str(x) in message
    with Registry(db) as registry:
        assert registry.gate_runs(artifact.load_manifest(candidate.result.artifact).digest) == []


@pytest.mark.parametrize("fixture", ["tiny_phi3", "tiny_gemma3", "tiny_mixtral", "tiny_qwen3_moe"])
def test_the_gate_runs_on_each_architecture_kiln_compiles(
    fixture: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Phi-3 (fused projections), Gemma 3 (sliding windows) and the two MoE families are
    gated like Llama: the candidate and its float source both served by kiln's runtime on the
    task, the divergence measured, a verdict written."""
    recipe = gated_recipe(tmp_path, request.getfixturevalue(fixture), "fp8")
    db = str(tmp_path / "registry.db")
    code, stdout, stderr = kiln("compile", str(recipe), "--json", "--registry", db)
    assert code == 0, stderr
    gate = json.loads(stdout)["gate"]
    assert gate["passed"] and gate["baseline"]["kind"] == "source"
    verdict = json.loads((Path(gate["reports"]) / "gate.json").read_text())
    assert verdict["tasks"] and verdict["divergence"]
    assert any(c["name"].startswith("kiln_mc: acc") for c in verdict["checks"])
