"""manifest.json's schema: typed records of what an artifact is and how it was made.

Every record reads from and writes to the JSON an artifact carries (`from_dict` / `to_dict`);
parsing checks types, so a damaged or hand-edited manifest is refused naming the field.
The top-level `Manifest` keeps keys it does not know (a newer kiln's additions survive a
load/save round trip); the records inside it are this version's.

format_version 3 (this one) leaves `reports/` out of the digest: the report's figures move in
their last bits with the CPU's kernels, and the digest names what is deployed (the reports
are still recorded per file and verified). format_version 2 types every section; its digest
covers every file. format_version 1 artifacts (kiln before the typed schema) read unchanged:
their JSON has the same shape, with a nested draft's stages lacking timings and the
speculative section unvalidated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from kiln.runtime.base.errors import ArtifactError

FORMAT = "kiln-artifact"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
REPORTS_NOT_DIGESTED = 3  # the format_version from which reports/ is left out of the digest

R = TypeVar("R")


def parse(kind: type[R], data: Any, where: str) -> R:
    """`data` as a `kind` record; ArtifactError naming `where` and the field when it is not."""
    try:
        return TypeAdapter(kind).validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field_path = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ArtifactError(
            f"{where}: {field_path}: {first['msg']}; the manifest is damaged or was written by "
            "an incompatible kiln (recompile the artifact)"
        ) from None


class Record:
    """to_dict / from_dict for the dataclass records below."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any], where: str = "manifest") -> R:
        return parse(cls, data, where)


@dataclass(slots=True)
class FileEntry(Record):
    """One file of the artifact: its sha256 and size in bytes."""

    sha256: str
    size: int


@dataclass(slots=True)
class SourceRecord(Record):
    """The model the artifact was compiled from."""

    spec: str  # as the recipe wrote it
    kind: str  # hf_dir | gguf | builtin | hub_cache
    digest: str  # sha256 of the source's content
    architecture: str
    parameters: int


@dataclass(slots=True)
class CalibrationRecord(Record):
    """The calibration data a quantiser saw."""

    dataset: str
    digest: str
    num_samples: int
    tokens: int
    max_seq_len: int
    seed: int


@dataclass(slots=True)
class SchemeRecord(Record):
    """What the quantise stage produced: scheme, backend, format and TensorRT-LLM names."""

    scheme: str  # e.g. W4A16_GPTQ, FP8, NO_QUANT
    label: str  # scheme plus KV cache mode, e.g. FP8+KV_FP8
    backend: str  # llmcompressor | modelopt | import
    format: str  # compressed-tensors | modelopt | float
    trtllm_quant_algo: str | None
    trtllm_kv_cache_quant_algo: str | None
    group_size: int | None
    symmetric: bool
    activations: str
    kv_cache: str
    ignore: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    calibration: CalibrationRecord | None = None
    source_format: str | None = None  # an imported checkpoint's own format
    seconds: float = 0.0


@dataclass(slots=True)
class StageRecord(Record):
    """How one stage went in the compile that made the artifact."""

    status: str  # ran | cached
    key: str  # the hash of its inputs
    seconds: float = 0.0


@dataclass(slots=True)
class ExportRecord(Record):
    """A TensorRT-LLM checkpoint (`trtllm/tp<N>/`), or why the scheme has none."""

    tp_size: int
    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    source_quant_algo: str | None = None
    source_format: str | None = None
    dtype: str | None = None
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unsupported: str | None = None  # set: nothing was written, and this says why


@dataclass(slots=True)
class BuildRecord(Record):
    """An engine build: the exact commands, the script, and what happened."""

    status: str  # built | planned | failed
    target: str
    sm: str | None = None
    commands: list[str] = field(default_factory=list)
    script: str | None = None
    reason: str | None = None
    stderr_tail: str | None = None
    stamps: list[str] = field(default_factory=list)


@dataclass(slots=True)
class TargetSpeculation(Record):
    method: str  # draft | ngram
    max_draft_len: int


@dataclass(slots=True)
class TargetRecord(Record):
    """What the artifact holds for one GPU target, per TensorRT-LLM path."""

    engine: str  # built | planned | failed: ... | unsupported: ... | skipped: ...
    pytorch: str  # ready | unsupported: ... | skipped: ...
    plan: str  # artifact-relative plan.json
    tp_size: int
    export: ExportRecord | None = None
    build: BuildRecord | None = None
    serve_config: str | None = None
    speculative: TargetSpeculation | None = None


@dataclass(slots=True)
class SpeculativeRecord(Record):
    """Speculative decoding shipped with the artifact: the draft (or n-gram) and its K."""

    method: str = "draft"  # draft | ngram
    max_draft_len: int | None = None  # None only while auto has not measured yet
    chosen_by: str = "recipe"  # recipe | auto
    max_matching_ngram_size: int | None = None  # ngram
    draft: str | None = None  # artifact-relative nested draft artifact
    draft_digest: str | None = None
    draft_source: str | None = None
    draft_scheme: str | None = None
    disable_by_batch_size: int | None = None
    # max_draft_len auto: what was measured, on which machine.
    alpha: float | None = None
    alpha_per_position: list[float] = field(default_factory=list)
    cost_ratio: float | None = None
    draft_ms_per_token: float | None = None
    target_ms_per_token: float | None = None
    num_drafts: int | None = None
    expected_speedup: float | None = None  # the formula's, from alpha and cost_ratio
    # Timed on the build machine: target + draft vs the target alone; `pays` is speedup > 1.
    measured_speedup: float | None = None
    plain_tokens_per_s: float | None = None
    speculative_tokens_per_s: float | None = None
    pays: bool | None = None
    measured_on: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Only what applies: an n-gram section has no draft, a fixed K no measurement."""
        return {k: v for k, v in asdict(self).items() if v is not None and v != [] and v != {}}


@dataclass(slots=True)
class GateRecord(Record):
    """The gate `kiln compile` ran on this artifact (outside the content digest)."""

    key: str
    passed: bool
    baseline: dict[str, Any]
    failed_checks: list[str] = field(default_factory=list)
    reports: str | None = None
    seconds: float | None = None
    run_id: int | None = None


@dataclass
class Manifest:
    """manifest.json. Unknown top-level keys survive a load/save round trip (`extra`)."""

    name: str
    digest: str = ""
    files: dict[str, FileEntry] = field(default_factory=dict)
    recipe: dict[str, Any] = field(default_factory=dict)  # the resolved recipe, as data
    source: SourceRecord | None = None
    scheme: SchemeRecord | None = None
    tools: dict[str, str] = field(default_factory=dict)
    stages: dict[str, StageRecord] = field(default_factory=dict)
    targets: dict[str, TargetRecord] = field(default_factory=dict)
    speculative: SpeculativeRecord | None = None
    gate: GateRecord | None = None
    # Engine files built into the published artifact later (engines/<target>/engine/...):
    # outside the digest like the gate, and checked by `verify` once recorded.
    engines: dict[str, FileEntry] = field(default_factory=dict)
    created_at: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        if not self.engines:
            data.pop("engines")  # nor one without later engines (a nested manifest is hashed)
        if self.speculative is None:
            data.pop("speculative")  # an artifact without a draft says nothing about one
        else:
            data["speculative"] = self.speculative.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "manifest.json") -> Manifest:
        """The manifest in `data`; ArtifactError naming the field where a value has the wrong
        type or a path it names lies outside the artifact."""
        known = {f.name for f in fields(cls)} - {"extra"}
        typed = {k: v for k, v in data.items() if k in known}
        manifest = parse(cls, {**typed, "extra": {k: v for k, v in data.items()
                                                  if k not in known}}, where)  # fmt: skip
        for key, rel in manifest.member_paths():
            why = member_problem(rel)
            if why is not None:
                raise ArtifactError(
                    f"{where}: {key}: {rel!r} {why}; a manifest names only paths inside its "
                    "artifact, so this one was edited after `kiln compile` wrote it — "
                    "recompile the artifact"
                )
        return manifest

    def member_paths(self) -> list[tuple[str, str]]:
        """(field, path) for every artifact-relative path the manifest names."""
        out = [(f"files.{rel}", rel) for rel in self.files]
        out += [(f"engines.{rel}", rel) for rel in self.engines]
        for name, target in self.targets.items():
            out.append((f"targets.{name}.plan", target.plan))
            if target.serve_config is not None:
                out.append((f"targets.{name}.serve_config", target.serve_config))
            if target.build is not None:
                if target.build.script is not None:
                    out.append((f"targets.{name}.build.script", target.build.script))
                out += [(f"targets.{name}.build.stamps", s) for s in target.build.stamps]
        if self.speculative is not None and self.speculative.draft is not None:
            out.append(("speculative.draft", self.speculative.draft))
        return out


def member_problem(rel: str) -> str | None:
    """Why `rel` is not a path inside an artifact (None: it is): absolute, empty, climbing out
    with `..`, or holding a NUL or a backslash."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return "is not a relative path inside the artifact"
    if any(part in ("", ".", "..") for part in parts):
        return "climbs out of the artifact (or has empty or '.' parts)"
    return None
