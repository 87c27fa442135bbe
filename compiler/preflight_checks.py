"""What preflight checks of a recipe against its model, before any compute: everything the
recipe and the model's files alone decide, so `kiln validate` refuses what `kiln compile`
would fail on after calibrating.

- every tensor the config's architecture reads present in every layer, with its shape, and no
  layer beyond it (checkpoint_checks.py, from the safetensors headers);
- weights and a tokenizer in a Hugging Face model directory (a compile reads both; `kiln plan`
  reads config.json alone, so a config-only directory plans);
- every `quantization.ignore` entry naming some linear, and some linear left to quantise;
- the lengths asked for (deploy, calibration, report) within the model's positions;
- every gate task known (kiln's own from its task files, lm-eval's from lm-eval's index).
"""

from __future__ import annotations

from kiln.compiler.checkpoint_checks import completeness_problems
from kiln.compiler.recipe.recipe import Recipe
from kiln.compiler.sources import BUILTIN, GGUF, HUB_CACHE, SourceRef
from kiln.gates.measure.divergence_texts import resolve_path
from kiln.gates.measure.tasks import BUILTIN_TASKS_DIR, task_problems
from kiln.quant.selection import is_ignored, quantised_linears
from kiln.quant.spec import QuantSpec
from kiln.runtime.base.files import irregular_entries
from kiln.runtime.formats.model_info import ModelInfo

# What a transformers tokenizer loads from: a fast tokenizer, SentencePiece, or BPE vocabularies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
# What a compile loads weights from (sources/materialize.py converts a .bin checkpoint).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def model_problems(recipe: Recipe, ref: SourceRef, info: ModelInfo) -> list[str]:
    """The model source's files against its config: every tensor and its shape."""
    if ref.kind in (GGUF, BUILTIN):
        return []  # one file holds config, tokenizer and tensors; its reader checked them
    unreadable = [f"{ref.path}/{line}" for line in irregular_entries(ref.path)]
    problems = [recipe.problem("model.source", p) for p in unreadable]
    return problems + [
        recipe.problem("model.source", p) for p in completeness_problems(ref.path, info)
    ]


def missing_files(recipe: Recipe, ref: SourceRef) -> list[str]:
    """What a compile reads that the model directory lacks: weights, a tokenizer (one line)."""
    if ref.kind in (GGUF, BUILTIN):
        return []
    missing = []
    if not any(any(ref.path.glob(pattern)) for pattern in WEIGHT_FILES):
        missing.append(f"no weights (no {' or '.join(WEIGHT_FILES)})")
    if not any((ref.path / name).exists() for name in TOKENIZER_FILES):
        missing.append(f"no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    if not missing:
        return []
    if ref.kind == HUB_CACHE:
        repo = ref.spec.strip().removeprefix("hf:")
        fix = (f"download the whole checkpoint on a machine with network (`hf download {repo}`) "
               "and copy that hub cache here")  # fmt: skip
    else:
        fix = ("copy the complete checkpoint into the directory: its weight files and the "
               "tokenizer files save_pretrained writes")  # fmt: skip
    problem = (f"{ref.path} holds {' and '.join(missing)}, which a compile reads "
               "(`kiln plan` needs config.json alone)")  # fmt: skip
    return [recipe.problem("model.source", problem, fix)]


def ignore_problems(recipe: Recipe, info: ModelInfo, spec: QuantSpec, key: str) -> list[str]:
    """`ignore` entries that match no linear of the model, and an ignore list that leaves
    nothing to quantise (`key`: the quantization section's place in the recipe)."""
    if spec.method == "none":
        return []
    names = list(quantised_linears(info, ()))
    problems = [
        recipe.problem(
            f"{key}.ignore",
            f"{entry!r} matches no linear of the model",
            f"name a module such as {names[0]} or {names[-1]}, or a re: pattern over such names",
        )
        for entry in spec.ignore
        if not any(is_ignored(name, (entry,)) for name in names)
    ]
    if not problems and not quantised_linears(info, spec.ignore):
        problems.append(
            recipe.problem(
                f"{key}.ignore",
                f"the ignore list keeps all {len(names)} linears "
                "float, so nothing would be quantised",
                "narrow the list, or use method: none",
            )
        )
    if not problems and info.moe is not None:
        problems += _float_expert_problems(recipe, info, spec, key)
    return problems


def _float_expert_problems(recipe: Recipe, info: ModelInfo, spec: QuantSpec, key: str) -> list[str]:
    """A MoE model's experts hold most of its weights: an ignore list that keeps every expert
    of a sparse layer float is refused, naming the layers (ModelOpt has shipped a recipe
    that skipped all expert quantizers silently)."""
    kept = []
    for layer in range(info.num_layers):
        if not info.is_sparse(layer):
            continue
        experts = [n for n in info.layer_linears(layer) if ".experts." in n]
        if all(is_ignored(f"model.layers.{layer}.{n}", spec.ignore) for n in experts):
            kept.append(f"model.layers.{layer}")
    if not kept:
        return []
    shown = ", ".join(kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
    return [
        recipe.problem(
            f"{key}.ignore",
            f"the ignore list keeps every expert of {shown} float "
            f"({info.num_experts} experts each), so the experts would not be quantised",
            "ignore single experts or projections, not all of them; or use method: none",
        )
    ]


def length_problems(recipe: Recipe, info: ModelInfo) -> list[str]:
    """Lengths the recipe sets beyond the model's positions (a default past them is the
    default's, not the recipe's: the planner notes it)."""
    limit = info.max_position_embeddings
    asked = {
        "deploy.max_seq_len": recipe.config.deploy.max_seq_len,
        "calibration.max_seq_len": recipe.config.calibration.max_seq_len,
        "report.max_seq_len": recipe.config.report.max_seq_len,
    }
    return [
        recipe.problem(
            key,
            f"{value} is past the model's {limit} positions (max_position_embeddings)",
            f"at most {limit}",
        )
        for key, value in asked.items()
        if value > limit and tuple(key.split(".")) in recipe.origins
    ]


def gate_problems(recipe: Recipe) -> list[str]:
    """Gate tasks no task file (nor lm-eval) defines."""
    gates = recipe.config.gates
    if gates is None or not gates.tasks:
        return []
    extra = resolve_path(gates.tasks_dir, recipe.base_dir("gates.tasks_dir"))
    dirs = [BUILTIN_TASKS_DIR] if extra is None else [BUILTIN_TASKS_DIR, extra]
    return [recipe.problem("gates.tasks", p) for p in task_problems(gates.tasks, dirs)]
