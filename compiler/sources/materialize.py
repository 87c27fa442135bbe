"""Materialising a source: a local float Hugging Face checkpoint directory the quantisers load.

A directory that already has safetensors weights is used in place. A GGUF is dequantised to
float32 and a pytorch_model.bin checkpoint re-saved as safetensors: into a compile stage's own
directory (`float_checkpoint`), or once into a content-addressed cache entry
`cache_dir/<kind>-<digest[:16]>/` written through a temporary directory and a rename
(`materialize`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kiln.compiler.leftovers import holding, sweep_unheld
from kiln.compiler.sources.digest import source_digest
from kiln.compiler.sources.metadata import CAUSAL_LM_CLASSES, inspect_source
from kiln.compiler.sources.reference import BUILTIN, GGUF, HF_DIR, HUB_CACHE, SourceRef
from kiln.quant.prequantized import detect as prequantized
from kiln.runtime.base.errors import SourceError, StageFailure
from kiln.runtime.formats.safetensors_writer import SHARD_BYTES
from kiln.runtime.formats.tokenizer_files import save_tokenizer

PROVENANCE_FILE = "kiln_source.json"


def float_checkpoint(ref: SourceRef, out: Path) -> Path:
    """The local float HF directory for `ref`: `ref.path` itself, or a conversion into `out`.

    A directory with safetensors weights, or a pre-quantised AWQ/GPTQ one (not float: the
    quantise stage converts it with quant.prequantized), is used in place and `out` is not
    created. A GGUF is dequantised and a pytorch_model.bin checkpoint re-saved as
    safetensors into `out` (created here; the caller makes that atomic: a compile stage's
    own directory, or `materialize`'s temporary entry).
    """
    if used_in_place(ref):
        return ref.path
    out.mkdir(parents=True)
    if ref.kind in (GGUF, BUILTIN):
        _dequantise_gguf(ref, out)
    else:
        _convert_to_safetensors(ref, out)
    provenance = {"spec": ref.spec, "kind": ref.kind, "path": str(ref.path),
                  "digest": source_digest(ref)}  # fmt: skip
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    # mkdtemp makes directories owner-only (and safetensors its file); a converted checkpoint
    # is read by whoever runs kiln next, so give it a checkpoint's usual modes.
    out.chmod(0o755)
    for file in out.iterdir():
        file.chmod(0o644)
    return out


def materialize(ref: SourceRef, cache_dir: Path) -> Path:
    """`float_checkpoint` through a content-addressed cache of its own (for `kiln draft`).

    A source used in place is returned as is. Anything else is converted once into
    `cache_dir/<kind>-<digest[:16]>/`; an interrupted run leaves no half-written entry, and
    a second call returns the entry at once.
    """
    if used_in_place(ref):
        return ref.path
    entry = cache_dir / f"{ref.kind}-{source_digest(ref)[:16]}"
    if entry.is_dir():
        return entry
    sweep_unheld(cache_dir)  # temporaries of killed runs, unless a live run holds the folder
    with holding(cache_dir):
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".tmp", dir=cache_dir))
        try:
            converted = float_checkpoint(ref, tmp / "model")
            try:
                os.rename(converted, entry)  # atomic within one filesystem
            except OSError:
                if not entry.is_dir():
                    raise
                # another run finished the same entry first; theirs is identical
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry


def used_in_place(ref: SourceRef) -> bool:
    """Whether `ref` is already a checkpoint the quantisers read (safetensors, or AWQ/GPTQ)."""
    return ref.kind in (HF_DIR, HUB_CACHE) and (
        any(ref.path.glob("*.safetensors")) or _pre_quantised(ref.path)
    )


def _pre_quantised(path: Path) -> bool:
    try:
        return prequantized.detect(prequantized.read_config(path)) is not None
    except (OSError, ValueError, SourceError):
        return False


def _dequantise_gguf(ref: SourceRef, out: Path) -> None:
    """Load the GGUF dequantised to float32 and save it as an ordinary HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(ref.path.parent), ref.path.name
    try:
        # dequantize=True unpacks every block at load time, then drops the GGUF quantizer and the
        # quantization_config: what is left is a plain dense model that save_pretrained accepts.
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, KeyError, IndexError, TypeError, NotImplementedError,
            RuntimeError) as exc:  # fmt: skip
        raise StageFailure(
            f"model.source {ref.spec!r}: transformers could not load {ref.path} ({exc}); "
            f"kiln compiles GGUFs of architecture {', '.join(sorted(CAUSAL_LM_CLASSES))}"
        ) from exc
    # transformers' GGUF tokenizer converter (5.17, integrations/ggml.py) takes both the BOS and
    # the EOS token from the BOS id; set the special tokens from the file's own ids instead.
    metadata = inspect_source(ref).config
    for attr in ("bos_token", "eos_token", "pad_token"):
        token_id = metadata.get(f"{attr}_id")
        if token_id is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(token_id)))
    # The converter also asks for clean_up_tokenization_spaces, which strips the space before
    # punctuation when decoding: wrong for a byte-level BPE (transformers 5 ignores it, with a
    # warning on every load; 4.x applies it).
    tokenizer.clean_up_tokenization_spaces = False
    model.save_pretrained(out, max_shard_size=SHARD_BYTES)  # transformers 5 defaults to 50 GB
    save_tokenizer(tokenizer, out)


def _convert_to_safetensors(ref: SourceRef, out: Path) -> None:
    """Re-save a pytorch_model.bin checkpoint as safetensors, with its tokenizer files."""
    from transformers import AutoModelForCausalLM

    if not any(ref.path.glob("pytorch_model*.bin")):
        raise SourceError(
            f"model.source {ref.spec!r}: {ref.path} has no weights (no *.safetensors and no "
            "pytorch_model*.bin); copy the complete checkpoint there"
        )
    try:
        # dtype="auto" keeps the checkpoint's own dtype: this converts the format, not the values.
        model = AutoModelForCausalLM.from_pretrained(ref.path, dtype="auto")
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise StageFailure(
            f"model.source {ref.spec!r}: transformers could not load {ref.path} ({exc})"
        ) from exc
    model.save_pretrained(out, max_shard_size=SHARD_BYTES)  # transformers 5 defaults to 50 GB
    for src in sorted(ref.path.iterdir()):
        weights = src.name.startswith("pytorch_model")
        if src.is_file() and not weights and not (out / src.name).exists():
            shutil.copy2(src, out / src.name)
