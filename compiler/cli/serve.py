"""`kiln serve ARTIFACT | registry://CHANNEL`: the OpenAI-compatible server (runtime/server)
over what compiler/serving.py resolves, on the backend it picks. The command line becomes one
`ServeOptions`; `run_server` builds the engine(s), the app and runs it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kiln.compiler.cli.exits import handle_errors
from kiln.compiler.cli.options import (
    JSON_OPTION,
    REGISTRY_OPTION,
    VERIFY_OPTION,
    KilnCommand,
    old_spellings,
)
from kiln.compiler.serving import (
    SERVE_CPU_BATCHED_TOKENS,
    ServedModel,
    choose_backend,
    config_len,
    parse_size,
    resolve_model,
    serve_budget,
)
from kiln.runtime.base.errors import UsageError
from kiln.runtime.server.body_limits import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    from kiln.runtime.formats.artifact.verified import Mode
    from kiln.runtime.server.mirror import Mirror
    from kiln.runtime.server.record import TrafficRecorder


# The mirror's options were once spelled --shadow...; old scripts keep working, unlisted.
_OLD_SPELLINGS = {
    "shadow": "mirror",
    "shadow-fraction": "mirror-fraction",
    "shadow-log": "mirror-log",
    "shadow-queue": "mirror-queue",
}


@click.command("serve", cls=KilnCommand, context_settings=old_spellings(_OLD_SPELLINGS))
@click.argument("artifact")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0: every interface).",
)
@click.option("--port", default=8000, show_default=True, type=int, help="Port to listen on.")
@click.option(
    "--backend",
    type=click.Choice(["auto", "native", "trtllm"]),
    default="auto",
    show_default=True,
    help="What runs the model: kiln's native engine, or TensorRT-LLM on an engine built for "
    "this GPU; auto takes TensorRT-LLM where such an engine is there.",
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
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Native engine: the torch device to run on (cpu, cuda, cuda:1, ...).",
)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    help="Native engine: the compute dtype (auto, bfloat16, float16, float32); auto is the "
    "checkpoint's on a GPU and bfloat16 on a CPU that computes it fast, else float32 "
    "($KILN_DTYPE overrides auto).",
)
@click.option("--num-threads", type=int, help="torch CPU threads.")
@click.option(
    "--record",
    "record_path",
    type=click.Path(path_type=Path),
    help="Append each request as a traffic line (runtime/formats/traffic.py format).",
)
@click.option(
    "--record-sample-rate",
    default=1.0,
    show_default=True,
    type=float,
    help="Share of requests --record keeps, in [0, 1].",
)
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
    "--max-request-bytes",
    default=DEFAULT_MAX_BYTES,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest request body accepted; a larger one is answered 413.",
)
@click.option(
    "--body-timeout",
    "body_timeout_s",
    default=DEFAULT_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True, max=3600),
    help="Seconds a request body may stall before it is answered 408.",
)
@click.option(
    "--drain-timeout",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds SIGTERM waits for in-flight requests.",
)
@REGISTRY_OPTION
@VERIFY_OPTION
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    help="Least severe log messages shown: debug, info, warning, error.",
)
@JSON_OPTION
@handle_errors
def serve(**given: Any) -> None:
    """Serve ARTIFACT (or registry://CHANNEL) with an OpenAI-compatible API.

    With --json, one JSON object on stdout says what is served where (url, model, digest,
    backend) once the model is loaded; logs go to stderr.

    \b
    Example:
      kiln serve artifacts/m-0c7038bf902e --port 8000
      kiln serve registry://prod --host 0.0.0.0 --device cuda --api-key "$KEY"
    """
    run_server(ServeOptions(**given))


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """`kiln serve`'s command line, as click parsed it."""

    artifact: str
    host: str
    port: int
    backend: str
    served_model_name: str | None
    api_keys: tuple[str, ...]
    max_waiting: int
    max_num_seqs: int | None
    kv_cache_memory: str | None
    max_model_len: int | None
    long_prefill_tokens: int
    max_num_batched_tokens: int | None
    device: str
    dtype: str
    num_threads: int | None
    record_path: Path | None
    record_sample_rate: float
    record_prompts: bool
    record_responses: bool
    mirror_spec: str | None
    mirror_fraction: float
    mirror_log: Path | None
    mirror_queue: int
    max_request_bytes: int
    body_timeout_s: float
    drain_timeout: float
    registry_spec: str | None
    verify: Mode
    log_level: str
    as_json: bool


def run_server(opts: ServeOptions) -> None:
    """Resolve the model, build its backend (and the mirror's candidate), serve until told
    to stop."""
    from kiln.runtime.server.app import create_app
    from kiln.runtime.server.runner import serve as run
    from kiln.runtime.server.state import ServerConfig

    logging.basicConfig(level=opts.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if opts.mirror_spec and opts.mirror_log is None:
        raise UsageError("--mirror needs --mirror-log FILE (where both answers go)")
    recorder = _recorder(opts)
    options = _engine_options(opts)
    model = resolve_model(opts.artifact, opts.registry_spec, verify=opts.verify)
    served, max_running, kind = _backend(opts, model, options)
    mirror = _mirror(opts, options)
    config = ServerConfig(
        model_name=opts.served_model_name or model.name,
        max_running=max_running,
        max_waiting=opts.max_waiting,
        api_keys=ServerConfig.keys_from(opts.api_keys),
        model_root=str(model.path),
        store_prompts=opts.record_prompts,
        max_request_bytes=opts.max_request_bytes,
        body_timeout_s=opts.body_timeout_s,
    )
    app = create_app(served, config, recorder, mirror, opts.drain_timeout, digest=model.digest)
    url = f"http://{opts.host}:{opts.port}/v1"
    click.echo(f"serving {config.model_name} on {url}", err=True)
    if opts.as_json:
        served_as = {"url": url, "model": config.model_name, "digest": model.digest or None,
                     "path": str(model.path), "backend": kind}  # fmt: skip
        click.echo(json.dumps(served_as))
    run(app, opts.host, opts.port, opts.drain_timeout, opts.log_level)


def _engine_options(opts: ServeOptions) -> dict[str, Any]:
    """The native engine's settings from the command line (those given)."""
    from kiln.runtime.engine.config import EngineConfig

    seqs = opts.max_num_seqs or EngineConfig().max_num_seqs
    budget = opts.max_num_batched_tokens
    if budget is not None and budget < seqs:
        raise UsageError(
            f"--max-num-batched-tokens {budget} is below --max-num-seqs {seqs}: "
            "a step must fit one decode per running sequence; raise the budget or lower "
            "--max-num-seqs"
        )
    given = {
        "max_num_seqs": opts.max_num_seqs,
        "kv_cache_memory_bytes": parse_size(opts.kv_cache_memory) if opts.kv_cache_memory else None,
        "max_model_len": opts.max_model_len,
        "long_prefill_token_threshold": opts.long_prefill_tokens or None,
        "max_num_batched_tokens": budget or serve_budget(opts.device, opts.max_num_seqs),
        "num_threads": opts.num_threads,
        "device": opts.device,
        "dtype": opts.dtype,
    }
    return {k: v for k, v in given.items() if v is not None}


def _backend(
    opts: ServeOptions, model: ServedModel, options: dict[str, Any]
) -> tuple[Any, int, str]:
    """The backend serving `model`, how many requests it runs at once, and its kind."""
    kind, engine_dir, why = choose_backend(opts.backend, model)
    click.echo(f"backend: {kind} ({why})", err=True)
    if kind == "trtllm":
        from kiln.runtime.server.backends.trtllm import TrtllmBackend

        assert engine_dir is not None
        limit = opts.max_model_len or config_len(model.model_dir)
        return TrtllmBackend(engine_dir, model.model_dir, limit), opts.max_num_seqs or 64, kind
    from kiln.runtime.engine.core import Engine
    from kiln.runtime.server.backends.native import NativeBackend

    engine = Engine.load(model.path, **options)
    click.echo(f"dtype: {engine.model.dtype} ({engine.model.dtype_reason})", err=True)
    click.echo(f"step budget: {engine.config.max_num_batched_tokens} tokens", err=True)
    return NativeBackend(engine), engine.config.max_num_seqs, kind


def _recorder(opts: ServeOptions) -> TrafficRecorder | None:
    """`--record`'s recorder, or None."""
    from kiln.runtime.server.record import RecordSettings, TrafficRecorder

    if opts.record_path is None:
        return None
    return TrafficRecorder(
        RecordSettings(
            opts.record_path, opts.record_sample_rate, opts.record_prompts, opts.record_responses
        )
    )


def _mirror(opts: ServeOptions, options: dict[str, Any]) -> Mirror | None:
    """`--mirror`'s candidate engine and log, or None."""
    if not opts.mirror_spec:
        return None
    from kiln.runtime.engine.core import Engine
    from kiln.runtime.server.mirror import Mirror

    assert opts.mirror_log is not None
    candidate = resolve_model(opts.mirror_spec, opts.registry_spec, "--mirror", opts.verify)
    return Mirror(
        Engine.load(candidate.path, **options),
        opts.mirror_log,
        opts.mirror_fraction,
        candidate.name,
        candidate.digest,
        max_queue=opts.mirror_queue,
    )
