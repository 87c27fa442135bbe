"""Speculative decoding in `kiln compile`: check the draft, compile it, pick K.

A recipe's `speculative:` section names a draft model (any `model.source`) with its own
quantisation, or `method: ngram` (prompt lookup, no draft). Preflight (`check_speculative`)
refuses, before any calibration, a draft whose tokenizer differs from the target's
(vocabulary, merges, special tokens), and checks the draft's scheme, data and targets like
the model's own. `compile_draft` then runs the draft's stages — source, quantize, export,
package — into a nested artifact of the same format (installed at `<artifact>/draft/`) and,
for `max_draft_len: auto`, measures per-position acceptance α and the draft/target cost
ratio c of what ships (the quantised target and draft, on this machine) and picks the K
that maximises (1 − α^(K+1)) / ((1 − α)(K·c + 1)) (runtime.speculative). Whether
speculation pays is not that formula's word (it takes a K+1-token verify to cost one plain
step, which a CPU does not honour): a short timed run of the target alone and of target +
draft at that K, on the same prompts and machine, decides it (`measure_speedup`), and the
manifest records both rates beside the machine.

TensorRT-LLM spellings this feeds (compiler/trtllm/build/plan.py and serve_config.py), checked
in its sources. What speculates by default is the LLM API / trtllm-serve YAML `speculative_config:
{decoding_type: DraftTarget | NGram, max_draft_len, speculative_model_dir,
max_matching_ngram_size}` (tensorrt_llm/llmapi/llm_args.py `DecodingBaseConfig.from_dict`,
docs/source/features/speculative-decoding.md): 1.2's LLM API runs DraftTarget and NGram on
the PyTorch backend only, so the engine is planned for plain decoding unless the recipe sets
`speculative.external_draft_engine: true`, which plans `trtllm-build
--speculative_decoding_mode draft_tokens_external --max_draft_len K` for the target plus a
plain draft engine (examples/draft_target_model/README.md; prompt lookup builds only the
target, examples/prompt_lookup/README.md) for a C++ Executor API client that passes draft
tokens itself.

The tokenizer comparison itself is compiler/draft/tokenizer_match.py.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.compiler.draft.check import SpeculativePlan
from kiln.compiler.pipeline import (
    ModelBuild,
    ModelJob,
    Progress,
    build_model,
    fill_artifact,
    link_tree,
)
from kiln.compiler.recipe.recipe import Recipe
from kiln.compiler.stages import StageCache, StageResult, input_key
from kiln.compiler.trtllm.deploy import SpeculativeTarget
from kiln.quant import calibration
from kiln.quant.spec import CalibrationSpec
from kiln.runtime.base.machine import cpu_name
from kiln.runtime.formats import artifact
from kiln.runtime.formats.artifact import SpeculativeRecord

DRAFT_DIR = "draft"  # the nested artifact's place inside the target's artifact
TIMED_PROMPTS = 4  # prompts of the timed plain-vs-speculative run: a short one


@dataclass
class Speculation:
    """What `compile_draft` produced: stages, the nested artifact, and the manifest section."""

    stages: list[StageResult]
    key: str  # everything the section and the nested artifact depend on
    section: SpeculativeRecord  # manifest.json `speculative`
    target: SpeculativeTarget  # what engine plans and serve options need
    draft_artifact: Path | None = None

    def install(self, staging: Path) -> None:
        """Hard-link the nested draft artifact into an artifact being assembled."""
        if self.draft_artifact is not None:
            link_tree(self.draft_artifact, staging / DRAFT_DIR)


def device_facts() -> dict[str, Any]:
    """Where a cost ratio was measured: it holds for this device only."""
    import torch

    return {
        "device": "cpu",
        "name": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


@dataclass(frozen=True)
class MeasuredSpeedup:
    """Single-stream greedy decode rates of the target alone and of target + draft."""

    plain_tokens_per_s: float
    speculative_tokens_per_s: float

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.plain_tokens_per_s

    def to_dict(self) -> dict[str, float]:
        return {
            "measured_speedup": round(self.speedup, 4),
            "plain_tokens_per_s": round(self.plain_tokens_per_s, 3),
            "speculative_tokens_per_s": round(self.speculative_tokens_per_s, 3),
        }


def measure_speedup(
    target_dir: Path,
    draft_dir: Path,
    prompts: list[str],
    k: int,
    max_tokens: int,
    *,
    rounds: int = 2,
) -> MeasuredSpeedup:
    """Time single-stream greedy decoding of `prompts` (each alone, `max_tokens` each) by the
    target with and without the draft proposing `k` tokens, on this machine.

    One engine serves both (per-request `speculative=False` for plain decoding), so the two
    share weights, caches and kernels; after a warm-up of each, the best of `rounds`
    interleaved runs counts (another process's load only ever slows a run down).
    """
    from kiln.runtime import Engine, SamplingParams
    from kiln.runtime.engine.spec_decode.speculator import SpeculativeConfig

    engine = Engine.load(
        target_dir,
        device="cpu",
        speculative=SpeculativeConfig(draft=draft_dir, num_speculative_tokens=k),
    )

    def rate(speculative: bool, texts: list[str]) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                speculative=speculative)  # fmt: skip
        began = time.perf_counter()
        for text in texts:
            engine.generate([text], params)
        return len(texts) * max_tokens / (time.perf_counter() - began)

    rate(False, prompts[:1])
    rate(True, prompts[:1])
    plain = speculative = 0.0
    for _ in range(rounds):
        plain = max(plain, rate(False, prompts))
        speculative = max(speculative, rate(True, prompts))
    return MeasuredSpeedup(plain, speculative)


def draft_job(plan: SpeculativePlan, recipe: Recipe, tps: tuple[int, ...]) -> ModelJob:
    """The draft as a model to compile: its own source and scheme, the recipe's data."""
    assert plan.source is not None and plan.info is not None  # preflight resolved both
    return ModelJob(
        role="draft",
        name=f"{recipe.name}-draft",
        source=plan.source,
        info=plan.info,
        scheme=plan.scheme,
        calibration=recipe.calibration_spec(),
        report=None,
        imported=plan.imported,
        tps=tps,
        recipe={"speculative": {"draft": plan.recipe_section}, "target": recipe.name},
    )


def compile_draft(
    plan: SpeculativePlan,
    recipe: Recipe,
    target: ModelBuild,
    cache: StageCache,
    tools: dict[str, str],
    *,
    force: bool = False,
    progress: Progress = lambda _msg: None,
) -> Speculation:
    """Run the draft's stages (the model's pipeline) and, for auto, measure K; see module doc."""
    if plan.method == "ngram":
        k = int(plan.max_draft_len or 1)
        ngram = SpeculativeRecord(method="ngram", max_draft_len=k, chosen_by="recipe",
                                  max_matching_ngram_size=plan.max_matching_ngram_size)  # fmt: skip
        spec_target = SpeculativeTarget(
            "ngram",
            k,
            ngram_size=plan.max_matching_ngram_size,
            external_draft_engine=plan.external_draft_engine,
        )
        return Speculation([], input_key("speculative", ngram.to_dict()), ngram, spec_target)
    job = draft_job(plan, recipe, tuple(sorted(target.exports)))
    draft = build_model(job, cache, tools, force=force, progress=progress)
    stages = list(draft.stages)
    package_key = input_key("draft-package", draft.quant_key,
                            [draft.exports[t].key for t in job.tps], job.recipe, tools)  # fmt: skip

    def package(out: Path) -> dict[str, Any]:
        manifest = draft.manifest(tools)
        # No time stamp: the nested manifest is one of the target's files, hashed into its digest.
        with artifact.assemble(out, manifest, stamp=False) as staging:
            fill_artifact(draft, staging.dir)
        assert staging.path is not None
        return {"name": staging.path.name, "digest": manifest.digest}

    progress("draft: packaging the nested artifact")
    packaged = cache.run(job.stage("package"), package_key, package, force)
    stages.append(packaged)

    section = SpeculativeRecord(
        method="draft",
        max_draft_len=plan.max_draft_len,
        chosen_by="recipe",
        draft=DRAFT_DIR,
        draft_digest=packaged.record["digest"],
        draft_source=job.source.spec,
        draft_scheme=draft.scheme.scheme,
    )
    key = input_key("speculative", package_key, section.to_dict())
    if plan.max_draft_len is None:
        measured = _measure(plan, job.calibration, cache, target, draft, force, progress)
        stages.append(measured)
        section = SpeculativeRecord.from_dict(
            {**section.to_dict(), **measured.record, "chosen_by": "auto"}
        )
        key = input_key("speculative", key, measured.key)
    spec_target = SpeculativeTarget(
        "draft",
        int(section.max_draft_len or 1),
        draft_dir=DRAFT_DIR,
        scheme=plan.scheme,
        info=plan.info,
        exports={tp: draft.export(tp) for tp in job.tps},
        external_draft_engine=plan.external_draft_engine,
    )
    return Speculation(stages, key, section, spec_target, packaged.path / packaged.record["name"])


def _measure(
    plan: SpeculativePlan,
    calib: CalibrationSpec,
    cache: StageCache,
    target: ModelBuild,
    draft: ModelBuild,
    force: bool,
    progress: Progress,
) -> StageResult:
    """max_draft_len auto: α per position and c on this device, then the best K."""
    device = device_facts()
    settings = {
        "prompts": plan.auto_prompts,
        "max_tokens": plan.auto_max_tokens,
        "max_k": plan.auto_max_k,
    }
    prompts_spec = dataclasses.replace(calib, num_samples=plan.auto_prompts)
    key = input_key(
        "acceptance",
        "timed",  # pays from a timed run (a record without one is measured again)
        target.quant_key,
        draft.quant_key,
        settings,
        device,
        {
            **dataclasses.asdict(prompts_spec),
            "base_dir": None,
            "digest": calibration.dataset_digest(prompts_spec),
        },
    )

    def measure(out: Path) -> dict[str, Any]:
        from transformers import AutoTokenizer

        from kiln.compiler.draft.acceptance import measure_acceptance
        from kiln.runtime.engine.spec_decode.speculator import (
            choose_draft_len,
            expected_speedup,
        )

        tokenizer = AutoTokenizer.from_pretrained(target.model)
        # Calibration passages cut to a prompt's length: the text the deployment expects.
        texts = calibration.load_texts(prompts_spec, tokenizer)
        prompts = [
            str(tokenizer.decode(ids[:64]))
            for ids in calibration.tokenize(texts, tokenizer, calib.max_seq_len)
        ]
        progress(f"draft: measuring acceptance on {len(prompts)} calibration prompts")
        profile = measure_acceptance(
            str(target.model),
            str(draft.model),
            prompts,
            max_k=plan.auto_max_k,
            max_tokens=plan.auto_max_tokens,
            device="cpu",
        )
        k = choose_draft_len(profile.alpha, profile.cost_ratio, max_k=plan.auto_max_k)
        speedup = expected_speedup(profile.alpha, k, profile.cost_ratio)
        progress(f"draft: timing plain and speculative decoding at K={k}")
        measured = measure_speedup(target.model, draft.model, prompts[:TIMED_PROMPTS], k,
                                   plan.auto_max_tokens)  # fmt: skip
        record = {
            "max_draft_len": int(k),
            "alpha": float(profile.alpha),
            "alpha_per_position": [float(a) for a in profile.alpha_per_position],
            "cost_ratio": float(profile.cost_ratio),
            "draft_ms_per_token": float(profile.draft_ms_per_token),
            "target_ms_per_token": float(profile.target_ms_per_token),
            "num_drafts": int(profile.num_drafts),
            "expected_speedup": float(speedup),  # the formula's, for comparison
            **measured.to_dict(),
            # False: speculating was slower than plain decoding when timed on this device.
            "pays": measured.speedup > 1.0,
            "measured_on": {
                **device,
                "prompts": len(prompts),
                **settings,
                "timed_prompts": len(prompts[:TIMED_PROMPTS]),
            },
        }
        (out / "acceptance.json").write_text(artifact.json_dumps(record))
        return record

    return cache.run("acceptance", key, measure, force)
