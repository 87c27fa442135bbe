"""`kiln search`: candidates compiled and gated like `kiln compile`, priced per target, the
frontier and the winner; mixed precision from measured sensitivity; the early look; resume;
what it refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from kiln.compiler.search.early import decided_fail
from kiln.compiler.search.pareto import frontier, winner
from kiln.compiler.search.price import price
from kiln.compiler.search.space import SCHEMES, linear_groups, quantization_section
from kiln.compiler.trtllm.capacity import DeploySpec
from kiln.compiler.trtllm.targets import get_profile
from kiln.quant.schemes import resolve
from kiln.quant.spec import QuantSpec
from kiln.runtime.formats.model_info import ModelInfo
from tests.compiler.test_compile import kiln
from tests.tiny_models import make_tiny_model

DAMAGED = "model.layers.1.mlp.down_proj"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer tiny Llama whose layer 1 down_proj has one large input column per group of
    128: 4-bit groups scaled to it round the rest of that layer to nearly nothing."""
    root = tmp_path_factory.mktemp("damaged")
    model = make_tiny_model(root / "model", num_layers=4)
    weights = load_file(model / "model.safetensors")
    w = weights[f"{DAMAGED}.weight"]
    w[:, 0], w[:, 128] = 3.0, -3.0
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def search_recipe(tmp: Path, model: Path, kl_max: float, limit: int = 8, extra: str = "") -> Path:
    path = tmp / "recipe.yaml"
    path.write_text(
        f"name: planted\nmodel:\n  source: {model}\n"
        "calibration: {dataset: builtin:licenses, num_samples: 8, max_seq_len: 64}\n"
        "report: {num_samples: 2, max_seq_len: 32}\ntargets: [h100-sxm]\n"
        "deploy: {gpu_price_per_hour: 3.0}\noutput: out\n"
        f"gates:\n  tasks: [kiln_mc]\n  limit: {limit}\n"
        "  divergence: {num_texts: 4, max_seq_len: 64, top_k: 512}\n"
        f"  thresholds: {{kl_mean: {kl_max:.15f}}}\n{extra}"
    )
    return path


def search(recipe: Path, *args: str) -> tuple[int, dict, str]:
    db = str(recipe.parent / "registry.db")
    code, stdout, stderr = kiln("search", str(recipe), "--json", "--registry", db, *args)
    return code, json.loads(stdout) if stdout.strip() else {}, stderr


def test_the_mixed_candidate_keeps_exactly_the_damaged_layer_float_and_wins(
    damaged: Path, tmp_path: Path
) -> None:
    """Uniform W4A16 fails the gate's KL bound (the damaged layer); the sensitivity the
    report measured ranks that layer first, so the first mixed candidate keeps exactly it
    float, passes, and is the cheapest passing deployment; its recipe compiles and passes the
    same gate on its own."""
    recipe = search_recipe(tmp_path, damaged, kl_max=0.17)
    code, answer, stderr = search(recipe, "--schemes", "w4a16", "--kv-cache", "none",
                                  "--no-measure")  # fmt: skip
    assert code == 0, stderr
    rows = {r["id"]: r for r in answer["targets"]["h100-sxm"]["rows"]}
    assert not rows["w4a16"]["passed"] and "KL divergence mean" in rows["w4a16"]["failed_checks"]
    mixed = next(c for c in answer["candidates"] if c["id"] == "w4a16-keep1")
    assert mixed["kept_float"] == [DAMAGED] and mixed["parent"] == "w4a16"
    assert rows["w4a16-keep1"]["passed"]
    target = answer["targets"]["h100-sxm"]
    assert target["winner"] == "w4a16-keep1" and "w4a16-keep1" in target["frontier"]
    assert rows["w4a16"]["price"] < rows["w4a16-keep1"]["price"]  # float costs a little
    out = tmp_path / "out" / "search-planted"
    assert {"search.json", "search.md", "search.html", "winner-h100-sxm.yaml"} <= {
        p.name for p in out.iterdir()
    }
    assert "<svg" in (out / "search.html").read_text()
    winner_recipe = yaml.safe_load((out / "winner-h100-sxm.yaml").read_text())
    assert DAMAGED in winner_recipe["quantization"]["ignore"]
    code, stdout, stderr = kiln("compile", str(out / "winner-h100-sxm.yaml"), "--json",
                                "--registry", str(tmp_path / "registry.db"))  # fmt: skip
    assert code == 0, stderr
    assert json.loads(stdout)["gate"]["passed"]


def test_a_killed_search_resumes_from_its_finished_candidates(tiny_llama: Path, tmp_path) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    args = ("--schemes", "fp8,w8a16", "--kv-cache", "none", "--no-measure", "--no-mixed")
    code, first, stderr = search(recipe, *args, "--max-candidates", "1")
    assert code == 0, stderr
    assert len(first["candidates"]) == 1 and "--max-candidates 1 reached" in first["notes"][-1]
    code, second, stderr = search(recipe, *args)
    assert code == 0, stderr
    assert second["resumed"] == 1 and len(second["candidates"]) == 2
    assert second["candidates"][0] == first["candidates"][0]  # kept, not judged again


def test_nothing_passing_exits_1_naming_the_closest_candidate_and_its_check(
    tiny_llama: Path, tmp_path: Path
) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1e-12)
    code, answer, stderr = search(recipe, "--schemes", "w8a16", "--kv-cache", "none",
                                  "--no-measure", "--no-mixed")  # fmt: skip
    assert code == 1
    assert "no candidate passed the gate (closest w8a16 missed KL divergence mean)" in stderr
    assert answer["targets"]["h100-sxm"]["closest"]["id"] == "w8a16"


def test_the_early_look_fails_a_candidate_without_the_full_gate(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """With 32 task items the early look gates 8; a failed divergence check there is final
    (the same texts as the full gate), so the full gate never runs."""
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1e-12, limit=32)
    code, answer, _ = search(recipe, "--schemes", "w8a16", "--kv-cache", "none",
                             "--no-measure", "--no-mixed")  # fmt: skip
    assert code == 1
    assert answer["early_stop"] == {"screened_out": 1, "candidates": ["w8a16"]}
    row = answer["targets"]["h100-sxm"]["rows"][0]
    assert row["screened_out"] and not row["passed"]


def test_an_early_look_settles_only_a_fail() -> None:
    task = {"task": "kiln_mc", "decision": {"outcome": "inconclusive"}}
    checks = [{"name": "kiln_mc: acc (mcnemar)", "passed": True}]
    assert not decided_fail({"tasks": [task], "checks": checks})
    failing = {"task": "kiln_mc", "decision": {"outcome": "fail"}}
    assert decided_fail({"tasks": [failing], "checks": checks})
    kl = [*checks, {"name": "KL divergence mean", "passed": False}]
    assert decided_fail({"tasks": [task], "checks": kl})
    task_check = [{"name": "kiln_mc: acc (mcnemar)", "passed": False}]
    assert not decided_fail({"tasks": [task], "checks": task_check})  # inconclusive fails
    # a perplexity ratio on a quarter of the documents is not the full gate's
    ppl = [{"name": "kiln_ppl: word_perplexity ratio", "passed": False}]
    assert not decided_fail({"tasks": [], "perplexity": [{"task": "kiln_ppl"}], "checks": ppl})


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("targets: [h100-sxm]\n", "add a gates: section"),
        ("gates: {tasks: [kiln_mc]}\n", "give --target T"),
    ],
)
def test_what_search_cannot_run_is_refused_before_any_work(
    tiny_llama: Path, tmp_path: Path, text: str, why: str
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel:\n  source: {tiny_llama}\n{text}output: out\n")
    code, _, stderr = kiln("search", str(recipe))
    assert code == 2 and why in stderr
    assert not (tmp_path / "out").exists()


def test_an_unknown_scheme_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, _, stderr = kiln("search", str(recipe), "--schemes", "fp8,int3")
    assert code == 2 and "unknown schemes ['int3']" in stderr


LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072,
}  # fmt: skip


def test_a_smaller_scheme_is_priced_cheaper_at_the_same_traffic() -> None:
    """Llama 3 8B on one H100 at 4k: FP8 weights and KV read fewer bytes a step and hold more
    sequences than bf16, so a million tokens costs less; W4A16 less again in weight bytes."""
    info = ModelInfo.from_hf_config(LLAMA_8B)
    h100, deploy = get_profile("h100-sxm"), DeploySpec(gpu_price_per_hour=3.0)

    def priced(name: str, kv: str = "none"):
        section = quantization_section(name, kv, ["lm_head"]) if name != "none" else {}
        from kiln.compiler.recipe.schema import QuantizationSection, section_spec

        spec = section_spec(QuantizationSection(**section)) if section else QuantSpec()
        return price(info, resolve(spec), h100, deploy)

    bf16, fp8, fp8_kv, w4 = priced("none"), priced("fp8"), priced("fp8", "fp8"), priced("w4a16")
    assert fp8.per_million_tokens < bf16.per_million_tokens
    assert fp8_kv.max_concurrency > fp8.max_concurrency
    assert w4.weight_bytes_per_gpu < fp8.weight_bytes_per_gpu < bf16.weight_bytes_per_gpu
    assert fp8.unit == "$/M output tokens" and fp8.to_dict()["source"] == "modelled"


def test_the_frontier_and_winner() -> None:
    rows = [
        {"id": "a", "price": 1.0, "score": 0.5, "passed": False, "failed_checks": ["x"]},
        {"id": "b", "price": 2.0, "score": 0.1, "passed": True, "failed_checks": []},
        {"id": "c", "price": 3.0, "score": 0.2, "passed": True, "failed_checks": []},
        {"id": "d", "price": None, "score": 0.0, "passed": True, "failed_checks": []},
    ]
    assert frontier(rows) == ["b"]  # a failed; c costs more and diverges more than b
    assert frontier([*rows, {**rows[2], "id": "e", "score": 0.05}]) == ["b", "e"]
    assert winner(rows) == "b"


def test_groups_keep_what_tensorrt_llm_fuses_together(tiny_phi3: Path, tiny_mixtral) -> None:
    phi3 = ModelInfo.from_hf_config(json.loads((tiny_phi3 / "config.json").read_text()))
    assert linear_groups(phi3)[:4] == [
        ["model.layers.0.self_attn.qkv_proj"], ["model.layers.0.self_attn.o_proj"],
        ["model.layers.0.mlp.gate_up_proj"], ["model.layers.0.mlp.down_proj"],
    ]  # fmt: skip
    moe = ModelInfo.from_hf_config(json.loads((tiny_mixtral / "config.json").read_text()))
    sparse = linear_groups(moe)[2]
    assert len(sparse) == 4 * 3 + 1 and sparse[-1] == "model.layers.0.block_sparse_moe.gate"


def test_every_scheme_name_is_a_valid_quantization_section() -> None:
    for name in SCHEMES:
        for kv in ("none", "fp8"):
            assert quantization_section(name, kv, ["lm_head"])["kv_cache"] == kv


def test_a_search_directory_of_another_recipe_is_not_mixed_in(tiny_llama, tmp_path) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    out = tmp_path / "shared"
    out.mkdir()
    (out / "state.json").write_text(json.dumps({"recipe": "/elsewhere.yaml", "candidates": []}))
    code, _, stderr = kiln("search", str(recipe), "--output", str(out))
    said = " ".join(stderr.split())
    assert code == 2
    assert f"{out / 'state.json'}: is the state of a search of /elsewhere.yaml" in said
    shutil.rmtree(out)
