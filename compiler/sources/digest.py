"""The source digest: sha256 over the files a compile reads.

File hashes are remembered in the sidecar $XDG_CACHE_HOME/kiln/file-digests.json
(~/.cache/kiln/ by default) while a file's (path, size, mtime_ns) holds, so an unchanged 500 MB
checkpoint is not re-read on every run.
"""

from __future__ import annotations

from pathlib import Path

from kiln.compiler.sources.reference import BUILTIN, GGUF, SourceRef
from kiln.compiler.sources.sidecar import FileFacts
from kiln.runtime.base.errors import SourceError
from kiln.runtime.formats.artifact import content_digest, sha256_each

DIGEST_SIDECAR = "file-digests.json"

# What `source_digest` hashes in a checkpoint directory: config, weights, tokenizer. READMEs,
# licences and images change nothing the compiler reads.
CHECKPOINT_FILES = (
    "config.json",
    "quantize_config.json",  # AutoGPTQ's quantization settings (quant.prequantized reads them)
    "quant_config.json",  # early AutoAWQ's
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
    "tokenizer*",
    "vocab.*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.*",
)


def source_digest(ref: SourceRef) -> str:
    """sha256 of a source: a GGUF's own file sha256, or over a directory's checkpoint files.

    A directory's digest is `runtime.artifact.content_digest` over `checkpoint_files`, the same
    rule an artifact uses for its own files.
    """
    if ref.kind in (GGUF, BUILTIN):
        return sha256_files([ref.path])[ref.path]
    files = checkpoint_files(ref.path)
    if not files:
        raise SourceError(
            f"model.source {ref.spec!r}: {ref.path} holds no config, weight or tokenizer files"
        )
    digests = sha256_files([ref.path / rel for rel in files])
    return content_digest({rel: digests[ref.path / rel] for rel in files})


def digest_known(ref: SourceRef) -> bool:
    """Whether `source_digest(ref)` will answer from the sidecar, without reading a file."""
    if ref.kind in (GGUF, BUILTIN):
        paths = [ref.path]
    else:
        paths = [ref.path / rel for rel in checkpoint_files(ref.path)]
    known = FileFacts(DIGEST_SIDECAR)
    try:
        return bool(paths) and all(known.get(path) is not None for path in paths)
    except OSError:
        return False  # source_digest names what cannot be read


def checkpoint_files(root: Path) -> list[str]:
    """The config, weight and tokenizer files of a checkpoint directory, sorted."""
    names = {p.name for pattern in CHECKPOINT_FILES for p in root.glob(pattern) if p.is_file()}
    return sorted(names)


def sha256_files(paths: list[Path]) -> dict[Path, str]:
    """sha256 of each file, from the sidecar while the file is unchanged (the others hashed
    several at once)."""
    known = FileFacts(DIGEST_SIDECAR)
    out = {path: known.get(path) for path in paths}
    missing = [path for path, digest in out.items() if digest is None]
    for path, digest in zip(missing, sha256_each(missing), strict=True):
        known.put(path, digest)
        out[path] = digest
    known.save()
    return {path: str(digest) for path, digest in out.items()}
