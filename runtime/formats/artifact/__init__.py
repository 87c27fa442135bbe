"""The kiln artifact format: the single definition every package reads and writes through.

An artifact is one directory named `<name>-<digest12>` holding:

    manifest.json             what this is: digests, resolved recipe, source, scheme, tools,
                              stage status and timings, targets, gate verdict, and the
                              digests of engines built into it after publication
    model/                    the quantised Hugging Face checkpoint (compressed-tensors or
                              ModelOpt HF export) with its tokenizer
    reports/quantization.json per-layer weight error, KL divergence and top-1 agreement
    reports/quantization.html the same as a page, with a per-linear error plot

The digest is the sha256 over the digests of every file but the manifest, so two artifacts
with the same content have the same name. An artifact is assembled in a hidden temporary
directory beside its final place and renamed into place only when complete.

A published artifact's manifest is rewritten (a gate recorded, a manifest refreshed) only
under its manifest lock, an exclusive flock on the artifact directory itself (no file is
added to the artifact): `update_manifest` reads, changes and writes it under the lock, so
two processes never lose each other's update. Each write goes through a temporary of its
own (`.manifest.json.<pid>.<random>.tmp`) and one rename, so a reader sees the old manifest
or the new one, never half of one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.runtime.base.atomic import replace_text
from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.base.files import irregular_entries, open_regular
from kiln.runtime.formats.artifact.manifest import (
    FORMAT,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    REPORTS_NOT_DIGESTED,
    BuildRecord,
    CalibrationRecord,
    ExportRecord,
    FileEntry,
    GateRecord,
    Manifest,
    SchemeRecord,
    SourceRecord,
    SpeculativeRecord,
    StageRecord,
    TargetRecord,
    TargetSpeculation,
    member_problem,
)

__all__ = [
    "ENGINES_DIR",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "MANIFEST_TEMPORARIES",
    "MODEL_DIR",
    "QUANT_REPORT",
    "READABLE_VERSIONS",
    "REPORTS_DIR",
    "BuildRecord",
    "CalibrationRecord",
    "ExportRecord",
    "FileEntry",
    "GateRecord",
    "KnownDigests",
    "Manifest",
    "SchemeRecord",
    "SourceRecord",
    "SpeculativeRecord",
    "StageRecord",
    "Staging",
    "TargetRecord",
    "TargetSpeculation",
    "assemble",
    "content_digest",
    "engine_file",
    "file_digests",
    "json_dumps",
    "load_manifest",
    "manifest_lock",
    "record_engines",
    "sha256_each",
    "sha256_file",
    "update_manifest",
    "verify",
    "write_manifest",
]

MANIFEST = "manifest.json"
MODEL_DIR = "model"
ENGINES_DIR = "engines"
REPORTS_DIR = "reports"
QUANT_REPORT = f"{REPORTS_DIR}/quantization.json"
# What a manifest rewrite leaves behind if killed mid-way (also the old fixed name).
MANIFEST_TEMPORARIES = f".{MANIFEST}*.tmp"
# A rewrite holds the lock for milliseconds; this long means the holder is stuck.
MANIFEST_LOCK_WAIT_S = 30.0
# Bytes read and hashed at a time. Each read and each update gives up the GIL and must take it
# back, which waits out the interpreter's switch interval (5 ms) wherever another thread runs
# Python: with 1 MiB chunks, a 2 GB shard hashed beside a Python-busy thread took 21 s instead
# of 1.5 s; with 32 MiB, 2.4 s.
_CHUNK = 32 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of one file, read in _CHUNK pieces into one buffer."""
    digest = hashlib.sha256()
    with open_regular(path, ArtifactError) as handle:
        size = os.fstat(handle.fileno()).st_size
        buffer = bytearray(max(1, min(_CHUNK, size)))
        view = memoryview(buffer)
        while count := os.readv(handle.fileno(), [buffer]):
            digest.update(view[:count])
    return digest.hexdigest()


# Threads hashing at once: hashlib releases the GIL while it hashes, so each is a core's worth.
HASH_THREADS = 8


def sha256_each(paths: list[Path], known: KnownDigests | None = None) -> list[str]:
    """`sha256_file` of each path, in order: several files at once on as many cores, a file
    reached by several hard links (an artifact stores identical files once) read once, and
    one `known` hashed unchanged (publishing only, never verifying) not read again."""
    from concurrent.futures import ThreadPoolExecutor

    inodes = [_identity(path) for path in paths]
    first = {inode: path for inode, path in zip(inodes, paths, strict=True)}
    digests = {inode: known.get(path) if known else None for inode, path in first.items()}
    todo = {inode: path for inode, path in first.items() if digests[inode] is None}
    workers = max(1, min(HASH_THREADS, os.cpu_count() or 1, len(todo)))
    with ThreadPoolExecutor(workers, thread_name_prefix="kiln-sha256") as pool:
        digests |= dict(zip(todo, pool.map(sha256_file, todo.values()), strict=True))
    return [str(digests[inode]) for inode in inodes]


class KnownDigests:
    """The sha256 of files this process hashed, each while its (device, inode, size, mtime_ns)
    held before and after: `kiln compile` hashes the stage files an artifact will hard-link
    while its report runs, and publishing takes those for the links rather than reading every
    file again. Only ever given where an artifact is published, never to a verification
    (`--verify full` reads every file: a changed byte need not change the file's times)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int, int, int], str] = {}

    def add(self, paths: list[Path]) -> None:
        before = [_facts(path) for path in paths]
        digests = sha256_each(paths)
        for path, facts, digest in zip(paths, before, digests, strict=True):
            if facts is not None and facts == _facts(path):
                self._known[facts] = digest

    def get(self, path: Path) -> str | None:
        facts = _facts(path)
        return None if facts is None else self._known.get(facts)


def _facts(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _identity(path: Path) -> tuple[int, int] | Path:
    """A file's (device, inode); the path itself where it cannot be read (the hash says why)."""
    try:
        st = os.stat(path)
    except OSError:
        return path
    return (st.st_dev, st.st_ino)


def member_files(root: Path) -> list[str]:
    """The regular files under `root` but the manifest, as artifact-relative paths; links are
    not followed (an artifact holds none: `irregular_entries` names what else is there)."""
    files = []
    for directory, _dirs, names in os.walk(root, followlinks=False):
        for name in names:
            path = Path(directory, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                files.append(path.relative_to(root).as_posix())
    return sorted(rel for rel in files if rel != MANIFEST)


def file_digests(root: Path, known: KnownDigests | None = None) -> dict[str, FileEntry]:
    """{relative path: (sha256, size)} for every regular file under root but the manifest
    (`known`: digests taken before, for publishing only)."""
    rels = member_files(root)
    digests = sha256_each([root / rel for rel in rels], known)
    return {
        rel: FileEntry(d, (root / rel).stat().st_size) for rel, d in zip(rels, digests, strict=True)
    }


def member_path(root: str | Path, rel: str, what: str) -> Path:
    """The one place a path a manifest names becomes a filesystem path: `root / rel`, refused
    (ArtifactError naming `what`) where `rel` or a link on the way leads outside `root`."""
    root = Path(root)
    why = member_problem(rel)
    if why is None and not (root / rel).resolve().is_relative_to(root.resolve()):
        why = "leads outside the artifact through a symbolic link"
    if why is not None:
        raise ArtifactError(f"{root}/{MANIFEST}: {what}: {rel!r} {why}; recompile the artifact")
    return root / rel


def engine_file(rel: str) -> bool:
    """A file of a TensorRT-LLM engine directory, `engines/<target>/engine/...`: what a
    builder's `build.sh` writes into the artifact after it was published."""
    parts = rel.split("/")
    return len(parts) > 3 and parts[0] == ENGINES_DIR and parts[2] == "engine"


def artifact_digest(files: dict[str, FileEntry], format_version: int = FORMAT_VERSION) -> str:
    """An artifact's digest: `content_digest` of its files but its reports (from format
    version 3: a report's figures move with the CPU's kernels while what is deployed does
    not), so the same weights and recipe give the same name on any machine."""
    if format_version >= REPORTS_NOT_DIGESTED:
        files = {rel: e for rel, e in files.items() if not rel.startswith(f"{REPORTS_DIR}/")}
    return content_digest(files)


def content_digest(files: dict[str, FileEntry] | dict[str, str]) -> str:
    """The artifact digest: sha256 over the sorted `sha256  path` lines of its files (given
    as file entries, or as their sha256s)."""
    sha256s = {rel: e if isinstance(e, str) else e.sha256 for rel, e in files.items()}
    lines = "".join(f"{sha256s[rel]}  {rel}\n" for rel in sorted(sha256s))
    return hashlib.sha256(lines.encode()).hexdigest()


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
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ArtifactError(
            f"{manifest_path}: not a kiln manifest (format is "
            f"{data.get('format') if isinstance(data, dict) else data!r}, expected {FORMAT!r})"
        )
    version = data.get("format_version", 0)
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ArtifactError(
            f"{manifest_path}: format_version {version} is newer than this kiln reads "
            f"({FORMAT_VERSION}); upgrade kiln"
        )
    if version not in READABLE_VERSIONS:
        raise ArtifactError(
            f"{manifest_path}: format_version {version!r} is not one this kiln reads "
            f"({', '.join(map(str, READABLE_VERSIONS))}); recompile the artifact"
        )
    return Manifest.from_dict(data, str(manifest_path))


def verify(path: str | Path, outside: Callable[[str], bool] | None = None) -> list[str]:
    """Re-hash every file; return one line per problem (empty when the artifact is intact).
    `outside` names files the manifest does not record and that are no problem."""
    root = Path(path)
    manifest = load_manifest(root)
    problems: list[str] = []
    recorded = {**manifest.files, **manifest.engines}
    actual = file_digests(root)
    if outside is not None:
        actual = {rel: e for rel, e in actual.items() if rel in recorded or not outside(rel)}
    for rel, want in sorted(recorded.items()):
        got = actual.get(rel)
        if got is None:
            problems.append(f"{rel}: missing")
        elif got.sha256 != want.sha256:
            problems.append(f"{rel}: sha256 {got.sha256[:12]}… != recorded {want.sha256[:12]}…")
    for rel in sorted(set(actual) - set(recorded)):
        hint = " (an engine built later: `kiln inspect --record-engines` records it)"
        problems.append(f"{rel}: not recorded in the manifest{hint if engine_file(rel) else ''}")
    # What kiln never writes and no reader may open: a FIFO would hang it, a link point away.
    problems += irregular_entries(root, links=False)
    if not problems and artifact_digest(manifest.files, manifest.format_version) != manifest.digest:
        problems.append("manifest digest does not match its file list")
    return problems


def json_dumps(data: Any) -> str:
    """The one JSON style of every file kiln writes into an artifact: sorted, indented."""
    return json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Write manifest.json atomically: a temporary of this writer's own, then one rename.
    A published artifact's manifest is rewritten under `manifest_lock` (update_manifest)."""
    replace_text(root / MANIFEST, json_dumps(manifest.to_dict()), fsync=True)


@contextmanager
def manifest_lock(root: str | Path, wait_s: float = MANIFEST_LOCK_WAIT_S) -> Iterator[None]:
    """Hold the artifact's manifest lock, waiting up to `wait_s` for another writer; then an
    ArtifactError naming the artifact, and the manifest is left as it is."""
    root = Path(root)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ArtifactError(
            f"{root}: cannot lock the artifact to rewrite its manifest ({exc.strerror}); "
            "pass the artifact directory that `kiln compile` printed"
        ) from None
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ArtifactError(
                        f"{root}: another kiln process has held the artifact's manifest lock "
                        f"for {wait_s:g} s (a `kiln compile` recording its gate, or `kiln "
                        "inspect --record-engines`); the manifest was left as it is: wait for "
                        "that process to finish, then retry"
                    ) from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def update_manifest(
    root: str | Path, change: Callable[[Manifest], None], wait_s: float = MANIFEST_LOCK_WAIT_S
) -> Manifest:
    """Apply `change` to the manifest as it is on disk now and write it back, all under the
    artifact's manifest lock: no concurrent writer's update is lost. Returns what was written."""
    root = Path(root)
    with manifest_lock(root, wait_s):
        manifest = load_manifest(root)
        change(manifest)
        write_manifest(root, manifest)
    return manifest


def record_engines(root: str | Path) -> Manifest:
    """Record the sha256 of every engine file built into the published artifact after
    publication in its manifest's `engines` (under the manifest lock), so `verify` checks
    them from then on; the artifact's digest, and so its name, stays what it was."""
    root = Path(root)
    files = load_manifest(root).files
    # Engines run to gigabytes: hashed before the lock is taken, never while holding it.
    found = {
        path.relative_to(root).as_posix(): path
        for path in sorted((root / ENGINES_DIR).glob("*/engine/**/*"))
        if path.is_file() and not path.is_symlink()
    }
    new = {rel: path for rel, path in found.items() if rel not in files}
    digests = sha256_each(list(new.values()))
    engines = {
        rel: FileEntry(d, path.stat().st_size)
        for (rel, path), d in zip(new.items(), digests, strict=True)
    }
    return update_manifest(root, lambda manifest: setattr(manifest, "engines", engines))


def _recorded_engines(root: Path) -> dict[str, FileEntry]:
    try:
        return load_manifest(root).engines
    except ArtifactError:
        return {}  # a damaged manifest: the refresh replaces it


def _holds(root: Path, files: dict[str, FileEntry]) -> bool:
    """Whether `root` holds exactly `files` (engines built into it later aside), re-hashed."""
    if irregular_entries(root, links=False):
        return False
    found = {rel: e for rel, e in file_digests(root).items() if not engine_file(rel)}
    return found == files


@dataclass
class Staging:
    """A directory being assembled (`dir`) and, once published, its final place (`path`)."""

    dir: Path
    path: Path | None = None


def link_duplicates(root: Path, files: dict[str, FileEntry]) -> int:
    """Store identical files of an artifact once: each file with the content of one before it
    becomes a hard link to that one (a tokenizer in model/ and trtllm/hf/, say). The digests do
    not change; returns the bytes saved. Where a link cannot be made (another filesystem under
    the artifact), the copy stays."""
    first: dict[tuple[str, int], Path] = {}
    saved = 0
    for rel, entry in sorted(files.items()):
        path = root / rel
        kept = first.setdefault((entry.sha256, entry.size), path)
        if kept == path or os.path.samefile(kept, path):
            continue
        temporary = path.with_name(f".{path.name}.link")
        try:
            os.link(kept, temporary)
        except OSError:
            continue
        os.replace(temporary, path)
        saved += entry.size
    return saved


@contextmanager
def assemble(
    parent: str | Path,
    manifest: Manifest,
    *,
    stamp: bool = True,
    known: KnownDigests | None = None,
) -> Iterator[Staging]:
    """Yield a hidden staging directory; on success hash it (`known`: digests of linked files
    taken beforehand, see KnownDigests) and rename it into place.

    The caller fills `staging.dir`; `manifest.digest`, `files` and `created_at` are set here
    and `staging.path` receives the final directory. On any exception the staging directory
    is removed, so nothing half-written is ever visible. `stamp=False` leaves `created_at`
    empty: a nested artifact's manifest is one of its parent's files, and a time in it would
    change the parent's digest on every rebuild.
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{manifest.name}-", suffix=".partial", dir=parent))
    handle = Staging(dir=staging)
    try:
        yield handle
        manifest.files = file_digests(staging, known)
        link_duplicates(staging, manifest.files)
        manifest.digest = artifact_digest(manifest.files)
        if stamp:
            manifest.created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_manifest(staging, manifest)
        final = parent / f"{manifest.name}-{manifest.digest[:12]}"
        if final.exists() and _holds(final, manifest.files):
            # Same content already published: keep the existing directory, refresh its
            # manifest, and keep the engines recorded on it since (they are still there).
            with manifest_lock(final):
                manifest.engines = _recorded_engines(final)
                write_manifest(final, manifest)
            shutil.rmtree(staging)
        elif final.exists():  # damaged since it was published: replace it whole
            damaged = parent / f".{final.name}.damaged-{os.getpid()}"
            os.replace(final, damaged)
            os.replace(staging, final)
            shutil.rmtree(damaged, ignore_errors=True)
        else:
            os.replace(staging, final)
        handle.path = final
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
