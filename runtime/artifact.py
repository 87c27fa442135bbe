"""The kiln artifact format: the single definition every package reads and writes through.

An artifact is one directory named `<name>-<digest12>` holding:

    manifest.json             what this is: digests, resolved recipe, source, scheme, tools,
                              stage status and timings, targets, gate verdict
    model/                    the quantised Hugging Face checkpoint (compressed-tensors or
                              ModelOpt HF export) with its tokenizer
    reports/quantization.json per-layer weight error, KL divergence and top-1 agreement

The digest is the sha256 over the digests of every file but the manifest, so two artifacts
with the same content have the same name. An artifact is assembled in a hidden temporary
directory beside its final place and renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.runtime.errors import ArtifactError

FORMAT = "kiln-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_DIR = "model"
REPORTS_DIR = "reports"
QUANT_REPORT = f"{REPORTS_DIR}/quantization.json"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(root: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {sha256, size}} for every file under root except the manifest."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        out[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return out


def content_digest(files: dict[str, dict[str, Any]]) -> str:
    """The artifact digest: sha256 over the sorted `sha256  path` lines of its files."""
    lines = "".join(f"{files[rel]['sha256']}  {rel}\n" for rel in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


@dataclass
class Manifest:
    """manifest.json, as a typed record. Unknown keys survive a load/save round trip."""

    name: str
    digest: str = ""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    recipe: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    scheme: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    gate: dict[str, Any] | None = None
    created_at: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)


def load_manifest(path: str | Path) -> Manifest:
    """Read an artifact's manifest; raises ArtifactError naming the path when it cannot."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactError(
            f"{root}: not a kiln artifact (no {MANIFEST}); pass the directory that "
            "`kiln compile` printed as `artifact`"
        )
    try:
        data = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(
            f"{manifest_path}: invalid JSON ({exc}); the artifact is damaged"
        ) from exc
    if data.get("format") != FORMAT:
        raise ArtifactError(
            f"{manifest_path}: format is {data.get('format')!r}, expected {FORMAT!r}"
        )
    if data.get("format_version", 0) > FORMAT_VERSION:
        raise ArtifactError(
            f"{manifest_path}: format_version {data['format_version']} is newer than this kiln "
            f"reads ({FORMAT_VERSION}); upgrade kiln"
        )
    return Manifest.from_dict(data)


def verify(path: str | Path) -> list[str]:
    """Re-hash every file; return one line per problem (empty when the artifact is intact)."""
    root = Path(path)
    manifest = load_manifest(root)
    problems: list[str] = []
    actual = file_digests(root)
    for rel, want in sorted(manifest.files.items()):
        got = actual.get(rel)
        if got is None:
            problems.append(f"{rel}: missing")
        elif got["sha256"] != want["sha256"]:
            problems.append(
                f"{rel}: sha256 {got['sha256'][:12]}… != recorded {want['sha256'][:12]}…"
            )
    for rel in sorted(set(actual) - set(manifest.files)):
        problems.append(f"{rel}: not recorded in the manifest")
    if not problems and content_digest(manifest.files) != manifest.digest:
        problems.append("manifest digest does not match its file list")
    return problems


def json_dumps(data: Any) -> str:
    """The one JSON style of every file kiln writes into an artifact: sorted, indented."""
    return json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Write manifest.json atomically (temp file + rename)."""
    text = json_dumps(manifest.to_dict())
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(text)
    os.replace(tmp, root / MANIFEST)


@dataclass
class Staging:
    """A directory being assembled (`dir`) and, once published, its final place (`path`)."""

    dir: Path
    path: Path | None = None


@contextmanager
def assemble(parent: str | Path, manifest: Manifest) -> Iterator[Staging]:
    """Yield a hidden staging directory; on success hash it and rename it into place.

    The caller fills `staging.dir`; `manifest.digest`, `files` and `created_at` are set here
    and `staging.path` receives the final directory. On any exception the staging directory
    is removed, so nothing half-written is ever visible.
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{manifest.name}-", suffix=".partial", dir=parent))
    handle = Staging(dir=staging)
    try:
        yield handle
        manifest.files = file_digests(staging)
        manifest.digest = content_digest(manifest.files)
        manifest.created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_manifest(staging, manifest)
        final = parent / f"{manifest.name}-{manifest.digest[:12]}"
        if final.exists():
            # Same content already published: keep the existing directory, refresh its manifest.
            write_manifest(final, manifest)
            shutil.rmtree(staging)
        else:
            os.replace(staging, final)
        handle.path = final
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
