"""TensorRT-LLM 1.2.x engine builds: the `trtllm-build` plan and its pre-checks.

`build_plan` turns recipe + planner into exact `trtllm-build` arguments and refuses, before
any GPU time is spent, what trtllm-build would refuse; builder.py runs them only where
TensorRT-LLM 1.2.x and a GPU of the target's compute capability are present, and otherwise
says `planned` with the command and a `build.sh` for a builder machine. No library plans or
stamps TensorRT-LLM builds, so this is ours. Facts, from TensorRT-LLM's sources (1.x):
- tensorrt_llm/commands/build.py `main`: RuntimeError for gather_context_logits with
  max_draft_len > 0, and for multiple_profiles with opt_num_tokens; `--workers` is the
  number of parallel build processes (tp comes from the checkpoint's mapping).
- tensorrt_llm/plugin/plugin.py `PluginConfig.validate`: on SM 100 gemm_swiglu_plugin,
  fp8_rowwise_gemm_plugin, low_latency_gemm_plugin and low_latency_gemm_swiglu_plugin raise
  NotImplementedError. Defaults: tokens_per_block 32, use_paged_context_fmha and
  use_fp8_context_fmha on.
- tensorrt_llm/builder.py `build`: FP8 context FMHA is kept only for FP8, W4A8_AWQ or NVFP4
  weights with an FP8 KV cache on sm89+; paged context FMHA (KV reuse, chunked context) is
  dropped with an FP8 KV cache under any other scheme and with an INT8 KV cache; on SM
  100-119 INT8/INT4 weight-only, INT8 KV, SmoothQuant and per-channel/per-token scaling raise
  RuntimeError; with speculation max_seq_len grows by max_draft_len and max_num_tokens is
  raised to max_batch_size × (max_draft_len + 1).
- docs "useful build-time flags": the GEMM plugin helps FP16/BF16; on FP8 it is best
  disabled, except `--gemm_plugin fp8` for batches ≤ 4 (latency).
- examples/draft_target_model/README.md: both engines need paged context FMHA (KV reuse);
  the target takes `--speculative_decoding_mode draft_tokens_external --max_draft_len K`.
"""

from __future__ import annotations

import json
import shlex
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.compiler.trtllm.capacity import DeploySpec, Plan, tp_valid
from kiln.compiler.trtllm.rules.support import check_target
from kiln.compiler.trtllm.targets import TargetProfile
from kiln.quant.registry import Problem
from kiln.quant.schemes import FLOAT_SCHEME
from kiln.quant.spec import Scheme
from kiln.runtime.base.errors import PreflightError
from kiln.runtime.formats.model_info import ModelInfo

TRTLLM_LINE = "1.2"  # the last TensorRT-LLM line with trtllm-build
FP8_FMHA_ALGOS = frozenset({"FP8", "W4A8_AWQ", "NVFP4"})
SM100_PLUGINS = ("--gemm_swiglu_plugin", "--fp8_rowwise_gemm_plugin",
                 "--low_latency_gemm_plugin", "--low_latency_gemm_swiglu_plugin")  # fmt: skip
# A checkpoint declares W4A16_AWQ for GPTQ sources (CHECKPOINT_ALGO,
# compiler/trtllm/export/writer.py).
CHECKPOINT_SAME = {"W4A16_GPTQ": "W4A16_AWQ"}
Args = dict[str, str | None]  # flag → value; None for a bare switch such as --gather_context_logits
# tensorrt_llm/llmapi/llm_args.py: DraftTarget and NGram decoding configs `supports_backend`
# only "pytorch", so nothing but the C++ Executor API drives an engine's external drafts.
ENGINE_SPECULATION = (
    "speculation on this engine needs draft tokens passed through the C++ Executor API "
    "(ExternalDraftTokensConfig); trtllm-serve and the LLM API run DraftTarget and NGram on "
    "the PyTorch backend only and serve this engine as plain decoding — to speculate, serve "
    "the model on the PyTorch backend with a speculative_config"
)


@dataclass(frozen=True, slots=True)
class DraftBuild:
    """The draft model of draft-target speculative decoding: K tokens per step, its dirs."""

    max_draft_len: int
    checkpoint_dir: Path
    engine_dir: Path
    tp_size: int = 1
    scheme: Scheme = FLOAT_SCHEME  # how the draft was quantised
    info: ModelInfo | None = None  # its shapes, to check tp_size


class BuildProblem(Problem):
    """One thing trtllm-build would refuse: the flag or setting (`key`), why, and the fix."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{self.key}: {self.problem} — fix: {self.allowed}"


class BuildPlanError(PreflightError):
    """A build plan trtllm-build would refuse; `problems` lists each with its fix."""

    def __init__(self, target: str, problems: list[BuildProblem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"engine build for {target} would fail:\n{lines}")


@dataclass(frozen=True)
class BuildPlan:
    """The exact `trtllm-build` invocation for one engine (and its draft's, if any)."""

    target: TargetProfile
    role: str  # "target" or "draft"
    argv: list[str]
    checkpoint_dir: Path
    engine_dir: Path
    world_size: int  # engines (rank{N}.engine) it writes
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    draft: BuildPlan | None = None

    @property
    def command(self) -> str:
        """The argv as one shell-quoted line."""
        return shlex.join(self.argv)

    def plans(self) -> list[BuildPlan]:
        """This plan, then the draft's: everything `run_build` runs."""
        return [self] + (self.draft.plans() if self.draft else [])

    def to_dict(self) -> dict[str, Any]:
        """JSON-able plan, for the manifest."""
        return {
            "target": self.target.name,
            "sm": self.target.sm,
            "role": self.role,
            "argv": list(self.argv),
            "command": self.command,
            "checkpoint_dir": str(self.checkpoint_dir),
            "engine_dir": str(self.engine_dir),
            "world_size": self.world_size,
            "env": dict(self.env),
            "notes": list(self.notes),
            "draft": self.draft.to_dict() if self.draft else None,
        }

    def relative_to(self, root: Path) -> BuildPlan:
        """This plan with paths under `root` made relative to it (for a relocatable build.sh)."""

        def rel(value: str) -> str:
            path = Path(value)
            return str(path.relative_to(root)) if path.is_relative_to(root) else value

        return replace(
            self,
            argv=[rel(a) for a in self.argv],
            checkpoint_dir=Path(rel(str(self.checkpoint_dir))),
            engine_dir=Path(rel(str(self.engine_dir))),
            draft=self.draft.relative_to(root) if self.draft else None,
        )

    def write_script(
        self, path: Path, *, cd: str | None = None, pytorch_command: str | None = None
    ) -> Path:
        """Write an executable `build.sh` that checks the GPU and the TensorRT-LLM version,
        then runs every build.

        `cd`: a directory, relative to the script, to enter first (for relative paths);
        `pytorch_command`: what to run instead on a TensorRT-LLM that builds no engines.
        """
        major, minor = self.target.compute_capability
        want = f"{major}.{minor}"
        gpus = max(p.world_size for p in self.plans())
        lines = [
            "#!/usr/bin/env bash",
            f"# kiln engine build for {self.target.name} ({self.target.marketing_name}, "
            f"{self.target.sm}) with TensorRT-LLM {TRTLLM_LINE}.x",
            "set -euo pipefail",
            'command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: no NVIDIA '
            'driver here" >&2; exit 1; }',
            # An engine runs only on the compute capability it was built on.
            'found="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d " ")"',
            f'if [ "$(grep -cx "{want}" <<<"$found" || true)" -lt {gpus} ]; then',
            f'  echo "this plan needs {gpus} GPU(s) of compute capability {want} '
            f'({self.target.sm}); found: ${{found:-none}}" >&2',
            "  exit 1",
            "fi",
            *_version_check(pytorch_command),
        ]
        if cd is not None:
            lines.append(f'cd "$(dirname "$0")/{cd}"')
        lines += [f"# note: {note}" for plan in self.plans() for note in plan.notes]
        for plan in self.plans():
            lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(plan.env.items())]
            lines.append(plan.command)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return path


def _version_check(pytorch_command: str | None) -> list[str]:
    """build.sh lines refusing a TensorRT-LLM other than TRTLLM_LINE.x, naming what to run
    instead (the engine builder left TensorRT-LLM after 1.3.0rc20). The version is read by
    $KILN_TRTLLM_PYTHON (default python3), the Python TensorRT-LLM is installed in."""
    instead = (
        f"serve the PyTorch path instead, from the artifact directory: {pytorch_command}"
        if pytorch_command
        else f"install tensorrt_llm=={TRTLLM_LINE}.* to build"
    )
    query = "from importlib.metadata import version; print(version('tensorrt_llm'))"
    return [
        f'trtllm_version="$("${{KILN_TRTLLM_PYTHON:-python3}}" -c "{query}" 2>/dev/null '
        '|| echo "not installed")"',
        'case "$trtllm_version" in',
        f"  {TRTLLM_LINE}.*) ;;",
        f'  *) echo "TensorRT-LLM $trtllm_version: this plan builds engines with '
        f'{TRTLLM_LINE}.x (trtllm-build left TensorRT-LLM after 1.3.0rc20); {instead}" >&2',
        "     exit 2 ;;",
        "esac",
    ]


def gemm_plugin(algo: str, target: TargetProfile, max_batch_size: int) -> str:
    """`--gemm_plugin` value: the checkpoint dtype (auto), or per TensorRT-LLM's FP8 advice."""
    if algo == "NVFP4":
        return "nvfp4"
    if algo == "FP8":
        small = max_batch_size <= 4 and target.compute_capability in ((8, 9), (9, 0))
        return "fp8" if small else "disable"
    return "auto"


def _engine_args(
    checkpoint_dir: Path,
    engine_dir: Path,
    algo: str,
    kv_algo: str | None,
    target: TargetProfile,
    deploy: DeploySpec,
    plan: Plan,
    workers: int,
    max_draft_len: int,
) -> tuple[Args, list[str]]:
    """The flags of one engine build, and notes on what trtllm-build will change."""
    notes: list[str] = []
    fp8_fmha = algo in FP8_FMHA_ALGOS and kv_algo == "FP8" and target.compute_capability >= (8, 9)
    paged_ctx = kv_algo is None or fp8_fmha  # builder.py drops it for every other KV cache
    if not paged_ctx:
        notes.append(f"{kv_algo} KV cache with {algo}: TensorRT-LLM disables paged context "
                     "FMHA, so no KV block reuse and no chunked context")  # fmt: skip
    gemm = gemm_plugin(algo, target, plan.recommended_max_batch_size)
    if gemm == "disable":
        notes.append("FP8 GEMMs without the GEMM plugin (TensorRT-LLM's advice above batch 4)")
    args: Args = {
        "--checkpoint_dir": str(checkpoint_dir),
        "--output_dir": str(engine_dir),
        "--max_batch_size": str(plan.recommended_max_batch_size),
        "--max_input_len": str(deploy.max_input_len or deploy.max_seq_len - 1),
        "--max_seq_len": str(deploy.max_seq_len),
        "--max_num_tokens": str(plan.recommended_max_num_tokens),
        "--kv_cache_type": "paged",
        "--tokens_per_block": str(deploy.tokens_per_block),
        "--use_paged_context_fmha": "enable" if paged_ctx else "disable",
        "--use_fp8_context_fmha": "enable" if fp8_fmha else "disable",
        "--gemm_plugin": gemm,
        "--multiple_profiles": "enable",
        "--workers": str(workers),
    }
    if max_draft_len:
        args["--speculative_decoding_mode"] = "draft_tokens_external"
        args["--max_draft_len"] = str(max_draft_len)
        raised = plan.recommended_max_batch_size * (max_draft_len + 1)
        notes.append(f"trtllm-build raises max_seq_len by {max_draft_len} (draft tokens)"
                     + (f" and max_num_tokens to {raised}"
                        if raised > plan.recommended_max_num_tokens else ""))  # fmt: skip
        notes.append(ENGINE_SPECULATION)
    return args, notes


def _argv(args: Args) -> list[str]:
    argv = ["trtllm-build"]
    for flag, value in args.items():
        argv += [flag] if value is None else [flag, value]
    return argv


def check_build_args(args: Args, target: TargetProfile) -> list[BuildProblem]:
    """What trtllm-build 1.2.x would refuse in `args` for `target`, each with its fix."""
    problems: list[BuildProblem] = []
    draft_len = int(args.get("--max_draft_len") or 0)
    gathers = [f for f in ("--gather_context_logits", "--gather_all_token_logits") if f in args]
    if gathers and draft_len > 0:
        problems.append(BuildProblem(gathers[0], "trtllm-build refuses to gather context "
                                     f"logits with max_draft_len {draft_len} > 0",
                                     f"drop {gathers[0]}; --gather_generation_logits gives "
                                     "the accepted tokens' logits"))  # fmt: skip
    if args.get("--multiple_profiles") == "enable" and "--opt_num_tokens" in args:
        problems.append(BuildProblem("--opt_num_tokens", "cannot be set with "
                                     "--multiple_profiles enable (trtllm-build refuses both)",
                                     "drop --opt_num_tokens, or --multiple_profiles "
                                     "disable"))  # fmt: skip
    if target.compute_capability == (10, 0):
        for flag in SM100_PLUGINS:
            if args.get(flag, "disable") != "disable":
                problems.append(BuildProblem(flag, f"not implemented on SM 100 "
                                             f"({target.name})", f"drop {flag}"))  # fmt: skip
    input_len, seq_len = int(args["--max_input_len"] or 0), int(args["--max_seq_len"] or 0)
    if input_len > seq_len:
        problems.append(
            BuildProblem(
                "--max_input_len",
                f"{input_len} > max_seq_len {seq_len}",
                f"max_input_len ≤ {seq_len} (e.g. {seq_len - 1})",
            )
        )
    num_tokens = int(args["--max_num_tokens"] or 0)
    if num_tokens < input_len and args.get("--use_paged_context_fmha") != "enable":
        problems.append(BuildProblem("--max_num_tokens", f"{num_tokens} < max_input_len "
                                     f"{input_len} without chunked context (paged context "
                                     "FMHA is off): longer prompts cannot be scheduled",
                                     f"max_num_tokens ≥ {input_len}, or a KV cache that keeps "
                                     "paged context FMHA (none, or fp8 with an FP8 "
                                     "scheme)"))  # fmt: skip
    if draft_len > 0 and args.get("--use_paged_context_fmha") != "enable":
        problems.append(BuildProblem("--use_paged_context_fmha", "draft-target speculation "
                                     "needs KV block reuse, i.e. paged context FMHA",
                                     "kv_cache: none, or fp8 with an FP8 scheme"))  # fmt: skip
    return problems


def _quant_problems(scheme: Scheme, target: TargetProfile, who: str) -> list[BuildProblem]:
    """The support matrix's engine-path verdict (it holds builder.py's SM 100 refusals too)."""
    return [BuildProblem(f"{who}{p.key}", p.problem, p.allowed)
            for p in check_target(scheme, target.name, path="engine")]  # fmt: skip


def _tp_problems(info: ModelInfo, tp: int, who: str) -> list[BuildProblem]:
    if tp_valid(info, tp) and info.intermediate_size % tp == 0:
        return []
    works = [t for t in (1, 2, 4, 8) if tp_valid(info, t) and info.intermediate_size % t == 0]
    return [BuildProblem(f"{who}tp_size", f"{tp} does not split {info.num_heads} heads, "
                         f"{info.num_kv_heads} KV heads and {info.intermediate_size} MLP columns",
                         " or ".join(map(str, works)))]  # fmt: skip


def _checkpoint_problems(
    checkpoint_dir: Path, world: int, algo: str, kv_algo: str | None, who: str
) -> list[BuildProblem]:
    """An already exported checkpoint must match the plan: trtllm-build takes tp from it."""
    config_path = Path(checkpoint_dir) / "config.json"
    if not config_path.is_file():
        return []
    config = json.loads(config_path.read_text())
    problems = []
    found_world = int(config.get("mapping", {}).get("world_size", 1))
    if found_world != world:
        problems.append(BuildProblem(f"{who}checkpoint_dir", f"{config_path} was exported for "
                                     f"world_size {found_world}; the plan needs {world}",
                                     f"re-export with tp_size {world}"))  # fmt: skip
    quant = config.get("quantization") or {}
    found = (quant.get("quant_algo") or "NO_QUANT", quant.get("kv_cache_quant_algo"))
    if found != (CHECKPOINT_SAME.get(algo, algo), kv_algo):
        problems.append(BuildProblem(f"{who}checkpoint_dir", f"{config_path} holds "
                                     f"{found[0]} (KV {found[1]}); the recipe resolves to "
                                     f"{algo} (KV {kv_algo})", "re-export the checkpoint "
                                     "from this recipe's quantised model"))  # fmt: skip
    return problems


def attention_windows(info: ModelInfo, max_seq_len: int) -> list[int] | None:
    """The per-layer `max_attention_window` a sliding-window model's engine must be served
    with (None when no layer slides). In TensorRT-LLM 1.2 engines the window is a runtime
    setting (KvCacheConfig.max_attention_window; examples/models/core/gemma/README.md:
    `--max_attention_window_size 512 512 512 512 512 3100`), not read from the checkpoint."""
    windows = [info.layer_window(i) for i in range(info.num_layers)]
    if all(w is None for w in windows):
        return None
    return [max_seq_len if w is None else min(w, max_seq_len) for w in windows]


def build_plan(
    info: ModelInfo,
    scheme: Scheme,
    target: TargetProfile,
    deploy: DeploySpec,
    plan: Plan,
    checkpoint_dir: Path,
    engine_dir: Path,
    *,
    draft: DraftBuild | None = None,
    extra_args: Args | None = None,
) -> BuildPlan:
    """The `trtllm-build` arguments for `plan` on `target`; BuildPlanError if trtllm-build
    would refuse them.

    `extra_args` adds or overrides flags (`{"opt_num_tokens": "256"}`, leading dashes
    optional; None for a bare switch) and is pre-checked like the rest. With `draft`, the
    target is built for externally drafted tokens and a second plan builds the draft engine.
    """
    algo, kv_algo = scheme.trtllm_quant_algo, scheme.trtllm_kv_cache_quant_algo
    world = plan.tp_size * plan.pp_size
    problems = _quant_problems(scheme, target, "")
    problems += _tp_problems(info, plan.tp_size, "deploy.")
    if not plan.fits:
        problems.append(BuildProblem("deploy", f"the model does not fit {target.name} at "
                                     f"tp={plan.tp_size}", "; ".join(plan.suggestions)
                                     or "a larger GPU"))  # fmt: skip
    problems += _checkpoint_problems(checkpoint_dir, world, algo, kv_algo, "")
    k = draft.max_draft_len if draft else 0
    if draft and k < 1:
        problems.append(BuildProblem("draft.max_draft_len", f"{k} drafts nothing", "1 to 10"))
    args, notes = _engine_args(checkpoint_dir, engine_dir, algo, kv_algo, target, deploy,
                               plan, world, max(k, 0))  # fmt: skip
    args.update({f"--{k.removeprefix('--')}": v for k, v in (extra_args or {}).items()})
    problems += check_build_args(args, target)
    if (windows := attention_windows(info, deploy.max_seq_len)) is not None:
        notes.append(f"serve with kv_cache_config.max_attention_window {windows} (one entry a "
                     "layer): the engine attends the whole context on every layer otherwise, "
                     "and the sliding layers would see past their window")  # fmt: skip
    draft_plan = None
    if draft:
        d_algo, d_kv = draft.scheme.trtllm_quant_algo, draft.scheme.trtllm_kv_cache_quant_algo
        problems += _quant_problems(draft.scheme, target, "draft.")
        if draft.info is not None:
            problems += _tp_problems(draft.info, draft.tp_size, "draft.")
        problems += _checkpoint_problems(draft.checkpoint_dir, draft.tp_size, d_algo, d_kv,
                                         "draft.")  # fmt: skip
        d_args, d_notes = _engine_args(draft.checkpoint_dir, draft.engine_dir, d_algo, d_kv,
                                       target, deploy, plan, draft.tp_size, 0)  # fmt: skip
        # The draft keeps KV reuse like the target (examples/draft_target_model/README.md).
        problems += [BuildProblem(f"draft.{p.key}", p.problem, p.allowed)
                     for p in check_build_args(d_args, target)]  # fmt: skip
        if d_args["--use_paged_context_fmha"] != "enable":
            problems.append(BuildProblem("draft.quantization.kv_cache", "the draft engine needs "
                                         "KV block reuse (paged context FMHA)",
                                         "kv_cache: none, or fp8 with an FP8 scheme"))  # fmt: skip
        notes.append("serve target and draft with KV block reuse on; on one GPU give each "
                     "kv_cache_free_gpu_memory_fraction ≈ 0.5")  # fmt: skip
        draft_plan = BuildPlan(target, "draft", _argv(d_args), Path(draft.checkpoint_dir),
                               Path(draft.engine_dir), draft.tp_size, notes=d_notes)  # fmt: skip
    if problems:
        raise BuildPlanError(target.name, problems)
    return BuildPlan(target, "target", _argv(args), Path(checkpoint_dir), Path(engine_dir),
                     world, notes=notes, draft=draft_plan)  # fmt: skip
