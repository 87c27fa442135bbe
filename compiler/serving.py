"""What `kiln serve` serves: an artifact, a Hugging Face directory, or the artifact a registry
channel points at, checked against its manifest first; and on which backend.

`--backend auto` takes TensorRT-LLM when `tensorrt_llm` imports and the artifact holds an
engine built for this GPU and TensorRT, and the native engine otherwise (saying why). An
engine built for another GPU or TensorRT version is refused at start (compiler/trtllm/build
owns the engine stamp; runtime imports nothing of ours, so the check lives here).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.runtime.base.errors import UsageError

log = logging.getLogger("kiln.serve")

if TYPE_CHECKING:
    from kiln.runtime.formats.artifact.verified import Mode


REGISTRY_SCHEME = "registry://"


# kiln serve's step budget on CPU, where a step's time grows with its tokens: a burst of
# 128-token prompts prefilled 4 per step gets its median first token ~2x sooner than 16 per
# step, at the same output rate under load (docs/benchmarks.md, "kiln vs vLLM-CPU and llama.cpp on
# one CPU"). Offline runs (the gates, `Engine.load`) keep the engine's 2048: prefill alone is 3-9%
# faster in big steps.
SERVE_CPU_BATCHED_TOKENS = 512


_SIZE = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}  # fmt: skip


@dataclass(slots=True)
class ServedModel:
    """What a model spec resolved to."""

    spec: str
    path: Path
    name: str
    digest: str
    is_artifact: bool

    @property
    def model_dir(self) -> Path:
        from kiln.runtime.formats.artifact import MODEL_DIR

        return self.path / MODEL_DIR if self.is_artifact else self.path


def parse_size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1.5GB' or a plain number."""
    match = _SIZE.match(text)
    if not match:
        raise UsageError(f"--kv-cache-memory {text!r}: not a size; write e.g. 2GiB or 512MiB")
    number, unit = match.groups()
    unit = (unit or "").upper().removesuffix("B")
    return int(float(number) * _UNITS[unit])


def resolve_model(
    spec: str, registry_spec: str | None, role: str = "ARTIFACT", verify: Mode = "fast"
) -> ServedModel:
    """An artifact directory, a Hugging Face model directory, or registry://CHANNEL. An
    artifact is checked against its manifest (`verify`), and a channel's against the digest
    the channel recorded, before anything of it is loaded."""
    from kiln.runtime.formats.artifact import MANIFEST
    from kiln.runtime.formats.artifact.verified import verify_artifact

    original, expect = spec, None
    if spec.startswith(REGISTRY_SCHEME):
        from kiln.gates.releases import Registry

        channel = spec[len(REGISTRY_SCHEME) :]
        with Registry(registry_spec) as registry:
            state = registry.channel(channel)
            where = registry.path
        if state is None or not state.current_path:
            raise UsageError(
                f"{role} {spec}: channel {channel!r} serves nothing in {where}; promote an "
                f"artifact first (kiln promote ARTIFACT --channel {channel})"
            )
        spec, expect = state.current_path, state.current_digest
    path = Path(spec).expanduser()
    if (path / MANIFEST).is_file():
        action = f"serve it as {original}" if expect else "serve it"
        checked = verify_artifact(path, mode=verify, expect_digest=expect, action=action)
        manifest = checked.manifest
        log.info("%s", checked.describe())
        for engine in checked.built_later:
            log.warning("%s: %s was built after publication; its files lie outside the digest "
                        "and are not verified: record them with `kiln inspect --record-engines "
                        "%s`", path, engine, path)  # fmt: skip
        return ServedModel(original, path.resolve(), manifest.name, manifest.digest, True)
    if expect is not None:
        raise UsageError(
            f"{role} {original}: channel serves {expect[:12]} at {path}, which holds no kiln "
            "artifact now; restore the artifact there or promote another"
        )
    if (path / "config.json").is_file():
        return ServedModel(original, path.resolve(), path.resolve().name, "", False)
    raise UsageError(
        f"{role} {original}: not a kiln artifact (no {MANIFEST}), not a Hugging Face model "
        "directory (no config.json) and not registry://CHANNEL"
    )


def engine_problems(engine_dir: Path, env: Any) -> list[str]:
    """Why a built TensorRT-LLM engine cannot run here (empty: it can)."""
    from kiln.compiler.trtllm.build.stamp import check_engine_compatible, read_engine_stamp

    if not env.gpus:
        stamp = read_engine_stamp(engine_dir) or {}
        return [
            f"engine {engine_dir} built for {stamp.get('sm', '?')} with TensorRT "
            f"{stamp.get('tensorrt_version', '?')}; this machine has no NVIDIA GPU — "
            "serve with --backend native"
        ]
    problems: list[str] = []
    for gpu in env.gpus:
        found = check_engine_compatible(engine_dir, gpu.compute_capability, env.tensorrt)
        if not found:
            return []
        problems = found
    return problems


def choose_backend(kind: str, model: ServedModel, env: Any = None) -> tuple[str, Path | None, str]:
    """(`native` or `trtllm`, the engine directory for trtllm, why). Raises UsageError when
    `--backend trtllm` cannot run here, with built-for vs found and the rebuild command."""
    from kiln.compiler.trtllm.build.host import detect_environment
    from kiln.compiler.trtllm.build.stamp import ENGINE_STAMP
    from kiln.runtime.server.backends.trtllm import trtllm_available

    if kind == "native":
        return "native", None, "--backend native"
    pattern = f"engines/*/engine/{ENGINE_STAMP}"
    engines = sorted(model.path.glob(pattern)) if model.is_artifact else []
    if not engines:
        why = f"{model.spec} holds no built TensorRT-LLM engine (engines/<target>/engine/)"
        if kind == "trtllm":
            raise UsageError(f"--backend trtllm: {why}; build one with the artifact's "
                             "engines/<target>/build.sh on a machine with that GPU")  # fmt: skip
        return "native", None, why
    env = env or detect_environment()
    problems: list[str] = []
    for stamp in engines:
        found = engine_problems(stamp.parent, env)
        if not found:
            if not trtllm_available():
                problems.append(f"{stamp.parent} fits this GPU but tensorrt_llm does not import")
                continue
            return "trtllm", stamp.parent, f"engine {stamp.parent} fits this GPU"
        problems += found
    if kind == "trtllm":
        raise UsageError("--backend trtllm: refusing the engine(s):\n  " + "\n  ".join(problems))
    return "native", None, "; ".join(problems)


def serve_budget(device: str, max_num_seqs: int | None) -> int | None:
    """kiln serve's default step budget: on CPU SERVE_CPU_BATCHED_TOKENS, or one decode for
    each of `max_num_seqs` sequences where that is more; elsewhere the engine's."""
    if device.split(":")[0] != "cpu":
        return None
    return max(SERVE_CPU_BATCHED_TOKENS, max_num_seqs or 0)


def config_len(model_dir: Path) -> int:
    import json

    from kiln.runtime.formats.model_info import ModelInfo

    config = json.loads((model_dir / "config.json").read_text())
    return ModelInfo.from_hf_config(config).max_position_embeddings
