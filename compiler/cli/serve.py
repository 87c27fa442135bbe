"""`kiln serve ARTIFACT | registry://CHANNEL`: the OpenAI-compatible server (runtime/server).

This layer resolves what to serve (an artifact, a Hugging Face directory, or the artifact a
registry channel points at), picks the backend, and refuses at start a TensorRT-LLM engine
built for another GPU or TensorRT version (compiler.trtllm.build owns the engine stamp;
runtime imports nothing of ours, so the check lives here).

`--backend auto` takes TensorRT-LLM when `tensorrt_llm` imports and the artifact holds an
engine built for this GPU and TensorRT, and the native engine otherwise (saying why).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from kiln.compiler.cli.exits import handle_errors
from kiln.compiler.cli.gate import VERIFY_OPTION
from kiln.runtime.base.errors import UsageError

log = logging.getLogger("kiln.serve")

if TYPE_CHECKING:
    from kiln.runtime.formats.artifact.verified import Mode

REGISTRY_SCHEME = "registry://"
# kiln serve's step budget on CPU, where a step's time grows with its tokens: a burst of
# 128-token prompts prefilled 4 per step gets its median first token ~2x sooner than 16 per
# step, at the same output rate under load (README, "kiln vs vLLM-CPU and llama.cpp on one
# CPU"). Offline runs (the gates, `Engine.load`) keep the engine's 2048: prefill alone is
# 3-9% faster in big steps.
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
    from kiln.compiler.trtllm.build.plan import check_engine_compatible, read_engine_stamp

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
    from kiln.compiler.trtllm.build.plan import ENGINE_STAMP, detect_environment
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


def _engine_options(**given: Any) -> dict[str, Any]:
    return {k: v for k, v in given.items() if v is not None}


# The mirror's options were once spelled --shadow...; old scripts keep working, unlisted.
_OLD_SPELLINGS = {
    "shadow": "mirror",
    "shadow-fraction": "mirror-fraction",
    "shadow-log": "mirror-log",
    "shadow-queue": "mirror-queue",
}


def _old_spelling(name: str) -> str:
    return _OLD_SPELLINGS.get(name, name)


@click.command("serve", context_settings={"token_normalize_func": _old_spelling})
@click.argument("artifact")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--backend", type=click.Choice(["auto", "native", "trtllm"]), default="auto", show_default=True
)
@click.option("--served-model-name", help="Model id clients send (default: the artifact name).")
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help="Require `Authorization: Bearer KEY` (repeatable; default $KILN_API_KEY).",
)
@click.option(
    "--max-waiting",
    default=64,
    show_default=True,
    type=int,
    help="Requests queued beyond the running batch before answering 429.",
)
@click.option("--max-num-seqs", type=int, help="Sequences in the running batch.")
@click.option("--kv-cache-memory", help="KV-cache budget, e.g. 2GiB.")
@click.option("--max-model-len", type=int, help="Context limit (default: the model's).")
@click.option(
    "--long-prefill-tokens",
    default=256,
    show_default=True,
    type=click.IntRange(min=0),
    help="Most prompt tokens one request prefills per step, so a long prompt interleaves "
    "with other requests' decodes and prefills (0: a chunk may take the whole step).",
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    help=f"Native engine: tokens one step computes at most, prefill chunks and decodes "
    f"together, at least --max-num-seqs (default: {SERVE_CPU_BATCHED_TOKENS} on CPU, or "
    "--max-num-seqs if more: smaller steps give a burst of prompts its first tokens sooner; "
    "the engine's 2048 on GPU).",
)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--num-threads", type=int, help="torch CPU threads.")
@click.option(
    "--record",
    "record_path",
    type=click.Path(path_type=Path),
    help="Append each request as a traffic line (runtime/formats/traffic.py format).",
)
@click.option("--record-sample-rate", default=1.0, show_default=True, type=float)
@click.option("--record-prompts", is_flag=True, help="Store prompt text (default: hash + count).")
@click.option("--record-responses", is_flag=True, help="Store responses too.")
@click.option(
    "--mirror",
    "mirror_spec",
    metavar="CANDIDATE",
    help="Candidate artifact to mirror a fraction of requests to.",
)
@click.option(
    "--mirror-fraction",
    default=0.1,
    show_default=True,
    type=float,
    help="Share of requests mirrored, in (0, 1].",
)
@click.option(
    "--mirror-log",
    type=click.Path(path_type=Path),
    help="Where both answers to each mirrored request go (judge with kiln gate --mirror-log).",
)
@click.option(
    "--mirror-queue",
    default=16,
    show_default=True,
    type=int,
    help="Mirrored requests waiting for the candidate before new ones are dropped.",
)
@click.option(
    "--drain-timeout",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds SIGTERM waits for in-flight requests.",
)
@click.option(
    "--registry",
    "registry_spec",
    envvar="KILN_REGISTRY",
    help="Registry for registry://CHANNEL (default: $KILN_REGISTRY).",
)
@VERIFY_OPTION
@click.option("--log-level", default="info", show_default=True)
@handle_errors
def serve(
    artifact: str,
    host: str,
    port: int,
    backend: str,
    served_model_name: str | None,
    api_keys: tuple[str, ...],
    max_waiting: int,
    max_num_seqs: int | None,
    kv_cache_memory: str | None,
    max_model_len: int | None,
    long_prefill_tokens: int,
    max_num_batched_tokens: int | None,
    device: str,
    dtype: str,
    num_threads: int | None,
    record_path: Path | None,
    record_sample_rate: float,
    record_prompts: bool,
    record_responses: bool,
    mirror_spec: str | None,
    mirror_fraction: float,
    mirror_log: Path | None,
    mirror_queue: int,
    drain_timeout: float,
    registry_spec: str | None,
    verify: Mode,
    log_level: str,
) -> None:
    """Serve ARTIFACT (or registry://CHANNEL) with an OpenAI-compatible API."""
    from kiln.runtime import Engine
    from kiln.runtime.engine.config import EngineConfig
    from kiln.runtime.server import NativeBackend, ServerConfig, create_app
    from kiln.runtime.server import serve as run
    from kiln.runtime.server.mirror import Mirror
    from kiln.runtime.server.record import RecordSettings, TrafficRecorder

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if mirror_spec and mirror_log is None:
        raise UsageError("--mirror needs --mirror-log FILE (where both answers go)")
    recorder = None
    if record_path is not None:
        recorder = TrafficRecorder(
            RecordSettings(record_path, record_sample_rate, record_prompts, record_responses)
        )
    seqs = max_num_seqs or EngineConfig().max_num_seqs
    if max_num_batched_tokens is not None and max_num_batched_tokens < seqs:
        raise UsageError(
            f"--max-num-batched-tokens {max_num_batched_tokens} is below --max-num-seqs {seqs}: "
            "a step must fit one decode per running sequence; raise the budget or lower "
            "--max-num-seqs"
        )
    model = resolve_model(artifact, registry_spec, verify=verify)
    options = _engine_options(
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=parse_size(kv_cache_memory) if kv_cache_memory else None,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_tokens or None,
        max_num_batched_tokens=max_num_batched_tokens or serve_budget(device, max_num_seqs),
        num_threads=num_threads,
        device=device,
        dtype=dtype,
    )
    kind, engine_dir, why = choose_backend(backend, model)
    click.echo(f"backend: {kind} ({why})", err=True)
    served: Any
    if kind == "trtllm":
        from kiln.runtime.server.backends.trtllm import TrtllmBackend

        assert engine_dir is not None
        limit = max_model_len or _config_len(model.model_dir)
        served = TrtllmBackend(engine_dir, model.model_dir, limit)
        max_running = max_num_seqs or 64
    else:
        engine = Engine.load(model.path, **options)
        click.echo(f"dtype: {engine.model.dtype} ({engine.model.dtype_reason})", err=True)
        click.echo(f"step budget: {engine.config.max_num_batched_tokens} tokens", err=True)
        served = NativeBackend(engine)
        max_running = engine.config.max_num_seqs
    mirror = None
    if mirror_spec:
        assert mirror_log is not None
        candidate = resolve_model(mirror_spec, registry_spec, "--mirror", verify)
        mirror = Mirror(
            Engine.load(candidate.path, **options),
            mirror_log,
            mirror_fraction,
            candidate.name,
            candidate.digest,
            max_queue=mirror_queue,
        )
    config = ServerConfig(
        model_name=served_model_name or model.name,
        max_running=max_running,
        max_waiting=max_waiting,
        api_keys=ServerConfig.keys_from(api_keys),
        model_root=str(model.path),
        store_prompts=record_prompts,
    )
    app = create_app(served, config, recorder, mirror, drain_timeout, digest=model.digest)
    click.echo(f"serving {config.model_name} on http://{host}:{port}/v1", err=True)
    run(app, host, port, drain_timeout, log_level)


def _config_len(model_dir: Path) -> int:
    import json

    from kiln.runtime.formats.model_info import ModelInfo

    config = json.loads((model_dir / "config.json").read_text())
    return ModelInfo.from_hf_config(config).max_position_embeddings


COMMANDS = [serve]
