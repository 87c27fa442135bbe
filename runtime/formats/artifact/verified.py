"""Checking an artifact against its manifest before it is served, gated, promoted or rolled
back to, with a fast path for a directory that has not changed since its last full check.

The full check (`verify`) re-reads every byte. After one that found nothing, a stamp
records each file's (size, mtime_ns, ctime_ns, inode, device) and the manifest's digest; a
later check that finds the very same files with the very same facts trusts that pass. The
ctime is the kernel's and no owner can set it, so a file rewritten and given its old size
and mtime back no longer matches. A file whose ctime lay within `RACY_S` of the pass is not
stamped (a change in the same clock tick would keep its ctime), so the next check hashes
again. The stamps live in the verifying user's cache ($XDG_CACHE_HOME/kiln/verified/), off
the artifact, outside its digest and out of reach of whoever else may write the artifact.

Ours because no library keeps such a stamp; losing one only costs a full pass.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kiln.runtime.base.atomic import replace_text
from kiln.runtime.base.cache import cache_home
from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.base.files import irregular_entries
from kiln.runtime.formats.artifact import (
    Manifest,
    artifact_digest,
    content_digest,
    engine_file,
    load_manifest,
    member_files,
    verify,
)

Mode = Literal["fast", "full"]
MODES: tuple[Mode, ...] = ("fast", "full")
RACY_S = 2.0  # wider than any filesystem's timestamp granularity kiln runs on

Facts = dict[str, list[int]]


@dataclass(frozen=True, slots=True)
class Verified:
    """An artifact that matched its manifest, and how that was known."""

    manifest: Manifest
    hashed: bool  # True: every file re-hashed now; False: unchanged since a full pass
    built_later: tuple[str, ...] = ()  # engine folders built after publication: unverified

    def describe(self) -> str:
        how = "every file re-hashed" if self.hashed else "unchanged since its last full check"
        return f"verified {self.manifest.name} {self.manifest.digest[:12]} ({how})"


def verify_artifact(
    path: str | Path,
    *,
    mode: Mode = "fast",
    expect_digest: str | None = None,
    action: str = "use it",
) -> Verified:
    """The artifact at `path`, checked; ArtifactError naming each mismatching file, why
    `action` is refused and the fix. `expect_digest` is what a registry recorded for it."""
    root = Path(path)
    manifest = load_manifest(root)
    refusal = f"{root}: refusing to {action}"
    if expect_digest is not None and manifest.digest != expect_digest:
        raise ArtifactError(
            f"{refusal}: the registry records it as {expect_digest[:12]} but its manifest says "
            f"{manifest.digest[:12]}; the directory was replaced or its manifest rewritten after "
            f"it was registered; put artifact {expect_digest[:12]} back there, or gate and "
            "promote the one that is there"
        )
    stamp = _stamp_path(root)
    files = _files(root)
    later = tuple(sorted({f.rsplit("/", 1)[0] for f in files if built_later(f, manifest)}))
    facts = _facts(root, [f for f in files if not built_later(f, manifest)])
    # The stamp names what was checked: the digest, and the engines recorded since.
    key = manifest.digest + (f"+{content_digest(manifest.engines)}" if manifest.engines else "")
    unchanged = _read_stamp(stamp) == {"digest": key, "files": facts}
    unchanged = unchanged and not irregular_entries(root, links=False)
    digest = artifact_digest(manifest.files, manifest.format_version)
    if mode == "fast" and unchanged and digest == manifest.digest:
        return Verified(manifest, hashed=False, built_later=later)
    problems = verify(root, lambda rel: built_later(rel, manifest))
    if problems:
        raise ArtifactError(
            f"{refusal}: the artifact does not verify: {len(problems)} file(s) differ from "
            f"its manifest ({manifest.name} {manifest.digest[:12]}):\n  "
            + "\n  ".join(problems)
            + "\nthe artifact changed after it was built; restore those files (or rebuild it "
            f"with `kiln compile`), then retry; `kiln inspect {root} --verify` re-checks it"
        )
    _write_stamp(stamp, key, facts)
    return Verified(manifest, hashed=True, built_later=later)


def built_later(rel: str, manifest: Manifest) -> bool:
    """A file of an engine that `build.sh` wrote on a builder after the artifact was
    published (`engines/<target>/engine/...`) and that nobody recorded since (`kiln inspect
    --record-engines`): outside the digest and unrecorded, so not verified; the engine's own
    stamp says what it was built for. A recorded one is verified like every other file."""
    return engine_file(rel) and rel not in manifest.files and rel not in manifest.engines


def _files(root: Path) -> list[str]:
    """The files the digest can cover: every regular one under `root` but the manifest."""
    return member_files(root)


def _facts(root: Path, files: list[str]) -> Facts:
    """What the stamp is keyed by, for each of `files`; a file changed within RACY_S of now
    gets no facts, so it can never match a stamp."""
    now = time.time_ns()
    facts: Facts = {}
    for rel in files:
        st = (root / rel).stat()
        racy = now - st.st_ctime_ns < RACY_S * 1e9
        facts[rel] = [] if racy else [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                                      st.st_dev]  # fmt: skip
    return facts


def _stamp_path(root: Path) -> Path:
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]
    return cache_home() / "verified" / f"{key}.json"


def _read_stamp(stamp: Path) -> object:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


def _write_stamp(stamp: Path, digest: str, facts: Facts) -> None:
    try:
        if any(not f for f in facts.values()):
            stamp.unlink(missing_ok=True)
            return
        stamp.parent.mkdir(parents=True, exist_ok=True)
        replace_text(stamp, json.dumps({"digest": digest, "files": facts}))
    except OSError:
        pass  # a read-only cache only costs a full pass next time
