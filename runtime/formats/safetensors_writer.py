"""Safetensors files written tensor by tensor, byte for byte as `safetensors.torch.save_file`
writes them, and Hugging Face checkpoints sharded as transformers shards them.

Hand-written because no library writes safetensors incrementally: `save_file`, `save_model`
and huggingface_hub's `save_torch_state_dict` all take every tensor of a file in memory at
once, and TensorRT-LLM 1.2 reads exactly one `rank{N}.safetensors` per rank, so a rank of a
70B model cannot be cut into files small enough to hold. The format
(https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length, a
JSON header (`__metadata__` first, then {name: {dtype, shape, data_offsets}}) padded with
spaces to a multiple of 8 bytes, then the raw little-endian bytes of the tensors. save_file
lays the data out by dtype (its Rust `Dtype` enum, largest first) then by name, lists the
header in that order and aligns nothing else. That layout depends only on the names, dtypes
and shapes, so a writer told them first (`TensorSpec`s, from a first pass over the producer
that keeps nothing else) writes the header at once and each tensor at its own offset as it is
made, in any order: no header space is reserved and no byte is moved afterwards. The bytes are
save_file's (with several `__metadata__` keys save_file itself lists them in hash order; kiln
writes one or none).

`write_files` runs a producer of (file, name, tensor) twice, planning then writing, so at
most the tensors the producer holds are in memory; `save_sharded` does that for one Hugging
Face checkpoint: shards of at most 5 GB split as huggingface_hub splits a state dict (in the
producer's order), named `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`,
or one `model.safetensors` when everything fits in one, as transformers' `save_pretrained` does.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
from huggingface_hub import split_state_dict_into_shards_factory

from kiln.runtime.base.heap import trim_freed

# safetensors' name of each torch dtype it stores, in the order save_file lays the data out
# (its Rust `Dtype` enum, largest first: `prepare` sorts by dtype descending, then by name).
DTYPES: dict[torch.dtype, str] = {
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float32: "F32",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_RANK = {dtype: rank for rank, dtype in enumerate(DTYPES)}
SHARD_BYTES = 5 * 10**9  # the most one shard of a Hugging Face checkpoint kiln writes holds
INDEX_FILE = "model.safetensors.index.json"
_MAX_WRITE = 1 << 30  # bytes per pwrite call (Linux writes at most ~2 GiB at once)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a file's layout needs of one tensor: its dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        if tensor.dtype not in DTYPES:
            raise TypeError(f"safetensors stores no {tensor.dtype} tensors")
        return cls(tensor.dtype, tuple(int(d) for d in tensor.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def layout(
    specs: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, int], int]:
    """save_file's header for tensors `specs` (its 8-byte length first), each tensor's offset
    in the file and the file's size."""
    header: dict[str, object] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offsets, end = {}, 0
    for name in sorted(specs, key=lambda n: (_RANK[specs[n].dtype], n)):
        spec = specs[name]
        entry = {"dtype": DTYPES[spec.dtype], "shape": list(spec.shape)}
        header[name] = {**entry, "data_offsets": [end, end + spec.nbytes]}
        offsets[name] = end
        end += spec.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {name: len(head) + at for name, at in offsets.items()}, len(head) + end


class SafetensorsWriter:
    """One safetensors file whose tensors are known (`specs`) before their data: the header is
    written at once and `write` puts each tensor at its place, in any order; `close` checks
    that every one was written."""

    def __init__(
        self, path: Path, specs: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None = None
    ) -> None:
        self.path = Path(path)
        self._specs = dict(specs)
        head, self._offsets, size = layout(self._specs, metadata)
        self._left = set(self._specs)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o644)
        try:
            os.ftruncate(self._fd, size)
            _pwrite(self._fd, memoryview(head), 0)
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor` (on the CPU) as `name`, which must match its planned dtype and shape."""
        if name not in self._left:
            why = "was written already" if name in self._specs else "was not planned"
            raise ValueError(f"{self.path}: tensor {name} {why}")
        if TensorSpec.of(tensor) != self._specs[name]:
            raise ValueError(
                f"{self.path}: tensor {name} is {TensorSpec.of(tensor)}, planned as "
                f"{self._specs[name]}; the producer must yield the same tensors on every pass"
            )
        if tensor.numel():
            data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data
            _pwrite(self._fd, data, self._offsets[name])
        self._left.discard(name)

    def close(self) -> None:
        """Close the file; ValueError where a planned tensor was never written."""
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        if self._left:
            missing = ", ".join(sorted(self._left)[:3])
            raise ValueError(f"{self.path}: {len(self._left)} tensors never written ({missing})")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        elif self._fd >= 0:  # failing already: the caller discards the file
            os.close(self._fd)
            self._fd = -1


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _MAX_WRITE], offset + done)


Tensors = Iterable[tuple[str, str, torch.Tensor]]  # (file, tensor name, tensor)


# Tensor bytes passed through between handing the heap's free memory back (runtime/base/heap
# `trim_freed`): about a decoder layer of a large model.
TRIM_BYTES = 256 << 20


def _trimming(tensors: Tensors) -> Tensors:
    """`tensors`, the heap trimmed after each TRIM_BYTES of them (producers read and convert a
    layer at a time under `reuse_within_layers`)."""
    passed = 0
    for file, name, tensor in tensors:
        passed += tensor.numel() * tensor.element_size()
        yield file, name, tensor
        del tensor
        if passed >= TRIM_BYTES:
            trim_freed()
            passed = 0


def plan(tensors: Tensors) -> dict[str, dict[str, TensorSpec]]:
    """file → {name: spec} of what `tensors` yields, keeping no tensor (the first pass)."""
    specs: dict[str, dict[str, TensorSpec]] = {}
    for file, name, tensor in _trimming(tensors):
        found = specs.setdefault(file, {})
        if name in found:
            raise ValueError(f"{file}: tensor {name} is yielded twice")
        found[name] = TensorSpec.of(tensor)
        del tensor  # not held while the producer makes the next one
    return specs


Unit = tuple[Hashable | None, str, Callable[[], Tensors]]  # (key, names' prefix, producer)


def plan_by_unit(units: Iterable[Unit]) -> dict[str, dict[str, TensorSpec]]:
    """`plan` of what the units yield, in order, each unit's producer run unless a unit with
    the same key (not None) ran before: that unit's plan is taken with its names' prefix
    replaced by this one's (a producer that is a function of what its key states, such as
    one decoder layer of a model whose layers are alike; where a name does not start with
    its unit's prefix, the unit runs). `write_files` then refuses any tensor that differs
    from the plan."""
    specs: dict[str, dict[str, TensorSpec]] = {}
    ran: dict[Hashable, tuple[str, dict[str, dict[str, TensorSpec]]]] = {}
    for key, prefix, produce in units:
        like = ran.get(key) if key is not None else None
        found = _renamed(*like, prefix) if like is not None else None
        if found is None:
            found = plan(produce())
            if key is not None:
                ran.setdefault(key, (prefix, found))
        for file, named in found.items():
            into = specs.setdefault(file, {})
            for name, spec in named.items():
                if name in into:
                    raise ValueError(f"{file}: tensor {name} is yielded twice")
                into[name] = spec
    return specs


def _renamed(
    old: str, specs: dict[str, dict[str, TensorSpec]], new: str
) -> dict[str, dict[str, TensorSpec]] | None:
    """`specs` with the prefix `old` of every name replaced by `new`; None where a name lacks
    it."""
    if not old:
        return None
    out: dict[str, dict[str, TensorSpec]] = {}
    for file, named in specs.items():
        if not all(name.startswith(old) for name in named):
            return None
        out[file] = {new + name[len(old) :]: spec for name, spec in named.items()}
    return out


def write_files(
    out_dir: Path,
    produce: Callable[[], Tensors],
    metadata: Mapping[str, str] | None = None,
    specs: dict[str, dict[str, TensorSpec]] | None = None,
) -> list[str]:
    """Write what `produce()` yields into safetensors files in `out_dir`, holding one tensor
    at a time: `produce` runs twice (plan, then write; once where `specs` is its plan) and
    must yield the same tensors both times. Returns the file names in the order planned."""
    specs = plan(produce()) if specs is None else specs
    with ExitStack() as stack:  # closing checks each file is whole; failing, only closes
        writers = {
            file: stack.enter_context(SafetensorsWriter(Path(out_dir) / file, found, metadata))
            for file, found in specs.items()
        }
        for file, name, tensor in _trimming(produce()):
            if file not in writers:
                raise ValueError(f"{out_dir}: file {file} was not planned")
            writers[file].write(name, tensor)
            del tensor  # not held while the producer makes the next one
    return list(specs)


def save_sharded(
    out_dir: Path,
    produce: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    metadata: Mapping[str, str] | None = None,
    max_shard_bytes: int = SHARD_BYTES,
    specs: dict[str, TensorSpec] | None = None,
) -> list[str]:
    """Write what `produce()` yields as a Hugging Face checkpoint's weights in `out_dir`:
    `model.safetensors` where it fits in one shard of `max_shard_bytes`, else numbered shards
    and their index. `produce` runs twice (see `write_files`; once where `specs` is its plan,
    {name: spec} in the order it yields them). Returns the files written."""
    if specs is None:
        specs = plan(in_file("", produce(), {})).get("", {})
    split = split_state_dict_into_shards_factory(
        specs,
        get_storage_size=lambda spec: spec.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_bytes,
    )
    where = split.tensor_to_filename
    files = {
        file: {n: specs[n] for n in names} for file, names in split.filename_to_tensors.items()
    }

    def routed() -> Tensors:
        return in_file("", produce(), where)

    written = write_files(out_dir, routed, metadata, files)
    if not split.is_sharded:
        return written
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (Path(out_dir) / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*written, INDEX_FILE]


def in_file(
    default: str, tensors: Iterable[tuple[str, torch.Tensor]], files: Mapping[str, str]
) -> Tensors:
    """(file, name, tensor): `files[name]`, else `default`; each tensor let go once yielded."""
    for name, tensor in tensors:
        yield files.get(name, default), name, tensor
        del tensor
