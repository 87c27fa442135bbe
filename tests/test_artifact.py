"""The artifact format: atomic publication, content digests, verification."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.formats import artifact


def build(root: Path, payload: bytes = b"weights") -> Path:
    manifest = artifact.Manifest(name="demo", recipe={"name": "demo"})
    with artifact.assemble(root, manifest) as staging:
        (staging.dir / "model").mkdir()
        (staging.dir / "model" / "w.bin").write_bytes(payload)
    assert staging.path is not None
    return staging.path


def test_assemble_publishes_under_the_content_digest(tmp_path: Path) -> None:
    path = build(tmp_path)
    manifest = artifact.load_manifest(path)
    assert path.name == f"demo-{manifest.digest[:12]}"
    assert list(manifest.files) == ["model/w.bin"]
    assert artifact.verify(path) == []
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_same_content_gives_the_same_artifact(tmp_path: Path) -> None:
    assert build(tmp_path) == build(tmp_path)
    assert build(tmp_path, b"other") != build(tmp_path)


def test_a_failure_while_assembling_leaves_nothing_behind(tmp_path: Path) -> None:
    manifest = artifact.Manifest(name="demo")
    with pytest.raises(RuntimeError), artifact.assemble(tmp_path, manifest) as staging:
        (staging.dir / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_verify_reports_changed_missing_and_unrecorded_files(tmp_path: Path) -> None:
    path = build(tmp_path)
    (path / "model" / "w.bin").write_bytes(b"tampered")
    (path / "extra.txt").write_text("?")
    problems = artifact.verify(path)
    assert problems[0].startswith("model/w.bin: sha256")
    assert problems[1] == "extra.txt: not recorded in the manifest"
    (path / "model" / "w.bin").unlink()
    assert artifact.verify(path)[0] == "model/w.bin: missing"


def test_manifest_round_trip_keeps_unknown_keys(tmp_path: Path) -> None:
    path = build(tmp_path)
    data = json.loads((path / artifact.MANIFEST).read_text())
    data["future_field"] = {"x": 1}
    (path / artifact.MANIFEST).write_text(json.dumps(data))
    assert artifact.load_manifest(path).to_dict()["future_field"] == {"x": 1}


def test_a_newer_format_version_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = build(tmp_path)
    data = json.loads((path / artifact.MANIFEST).read_text())
    data["format_version"] = artifact.FORMAT_VERSION + 1
    (path / artifact.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="upgrade kiln"):
        artifact.load_manifest(path)


def test_a_format_version_1_manifest_still_reads(tmp_path: Path) -> None:
    path = build(tmp_path)
    data = json.loads((path / artifact.MANIFEST).read_text())
    data.update(
        format_version=1,
        stages={"draft-package": {"status": "ran", "key": "k"}},  # v1 drafts had no timings
        scheme={"scheme": "FP8", "label": "FP8", "backend": "llmcompressor",
                "format": "compressed-tensors", "trtllm_quant_algo": "FP8",
                "trtllm_kv_cache_quant_algo": None, "group_size": None, "symmetric": True,
                "activations": "fp8_static", "kv_cache": "none", "calibration": None},
        speculative={"method": "ngram", "max_draft_len": 3, "chosen_by": "recipe",
                     "max_matching_ngram_size": 2},
    )  # fmt: skip
    (path / artifact.MANIFEST).write_text(json.dumps(data))
    manifest = artifact.load_manifest(path)
    assert manifest.scheme is not None and manifest.scheme.trtllm_quant_algo == "FP8"
    assert manifest.stages["draft-package"].seconds == 0.0
    assert manifest.speculative is not None and manifest.speculative.max_draft_len == 3


def test_a_manifest_field_of_the_wrong_type_is_refused_naming_it(tmp_path: Path) -> None:
    path = build(tmp_path)
    data = json.loads((path / artifact.MANIFEST).read_text())
    data["files"]["model/w.bin"]["size"] = "big"
    (path / artifact.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=r"manifest.json: files\.model/w\.bin\.size: "):
        artifact.load_manifest(path)


def test_an_unknown_format_version_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = build(tmp_path)
    data = json.loads((path / artifact.MANIFEST).read_text())
    data["format_version"] = 0
    (path / artifact.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="recompile the artifact"):
        artifact.load_manifest(path)


def test_identical_files_are_stored_once(tmp_path: Path) -> None:
    manifest = artifact.Manifest(name="twins", recipe={})
    with artifact.assemble(tmp_path, manifest) as staging:
        for folder in ("model", "trtllm/hf", "draft/model"):
            (staging.dir / folder).mkdir(parents=True)
            (staging.dir / folder / "tokenizer.json").write_text('{"vocab": [1, 2, 3]}')
        (staging.dir / "model" / "config.json").write_text('{"other": true}')
    assert staging.path is not None
    copies = [staging.path / f / "tokenizer.json" for f in ("model", "trtllm/hf", "draft/model")]
    assert len({p.stat().st_ino for p in copies}) == 1 and copies[0].stat().st_nlink == 3
    assert (staging.path / "model" / "config.json").stat().st_nlink == 1
    assert artifact.verify(staging.path) == []


def _with_report(root: Path, figures: str) -> Path:
    manifest = artifact.Manifest(name="reported", recipe={})
    with artifact.assemble(root, manifest) as staging:
        (staging.dir / "model").mkdir()
        (staging.dir / "model" / "w.bin").write_bytes(b"weights")
        (staging.dir / "reports").mkdir()
        (staging.dir / "reports" / "quantization.json").write_text(figures)
    assert staging.path is not None
    return staging.path


def test_the_digest_names_what_is_deployed_not_the_reports_figures(tmp_path: Path) -> None:
    """Two hosts' compiles of the same weights differ in the report's last digits: one name."""
    one = _with_report(tmp_path / "a", '{"kl_mean": 0.14878618717193604}')
    two = _with_report(tmp_path / "b", '{"kl_mean": 0.14878618717193611}')
    assert one.name == two.name
    assert artifact.verify(one) == [] and artifact.verify(two) == []
    (one / "reports" / "quantization.json").write_text('{"kl_mean": 0.0}')
    assert artifact.verify(one) == ["reports/quantization.json: sha256 " + _short(one)]


def _short(root: Path) -> str:
    recorded = artifact.load_manifest(root).files["reports/quantization.json"].sha256
    actual = artifact.sha256_file(root / "reports" / "quantization.json")
    return f"{actual[:12]}… != recorded {recorded[:12]}…"


def test_an_artifact_of_format_version_2_still_verifies_with_its_digest(tmp_path: Path) -> None:
    """Before format_version 3 the digest covered the reports too."""
    root = _with_report(tmp_path, "{}")
    data = json.loads((root / "manifest.json").read_text())
    files = {rel: artifact.FileEntry(**entry) for rel, entry in data["files"].items()}
    data["format_version"] = 2
    data["digest"] = artifact.content_digest(files)
    (root / "manifest.json").write_text(json.dumps(data))
    assert artifact.verify(root) == []
    data["digest"] = artifact.artifact_digest(files)  # a v2 manifest with a v3 digest lies
    (root / "manifest.json").write_text(json.dumps(data))
    assert artifact.verify(root) == ["manifest digest does not match its file list"]


def test_files_are_hashed_together_each_as_alone(tmp_path: Path) -> None:
    """sha256_each gives every path its own file's sha256, in order, hard links and repeats
    included, files hashed on several threads."""
    from kiln.runtime.formats.artifact import sha256_each, sha256_file

    paths = []
    for i in range(5):
        paths.append(tmp_path / f"f{i}.bin")
        paths[-1].write_bytes(bytes([i]) * (3 << 20 if i % 2 else 17))
    os.link(paths[1], tmp_path / "linked.bin")
    asked = [paths[3], tmp_path / "linked.bin", *paths, paths[0]]
    assert sha256_each(asked) == [sha256_file(p) for p in asked]
    assert sha256_each([]) == []


def test_a_file_is_hashed_alike_in_any_number_of_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sha256_file reads a file in pieces into one buffer (large ones, so hashing beside a
    Python-busy thread is not held up each piece by the GIL): any piece size gives the file's
    sha256, an empty file included."""
    import hashlib

    from kiln.runtime.formats import artifact as module

    data = bytes(range(256)) * 41 + b"tail"
    (tmp_path / "f.bin").write_bytes(data)
    (tmp_path / "empty.bin").write_bytes(b"")
    for piece in (7, 256, len(data), 1 << 25):
        monkeypatch.setattr(module, "_CHUNK", piece)
        assert module.sha256_file(tmp_path / "f.bin") == hashlib.sha256(data).hexdigest()
        assert module.sha256_file(tmp_path / "empty.bin") == hashlib.sha256(b"").hexdigest()


def test_a_file_hashed_before_publishing_is_not_read_again_unless_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KnownDigests: a stage file hashed while the report ran is taken for its hard link in
    the artifact; one changed since (its size or time) is read again, and verification never
    takes a digest it did not read."""
    from kiln.runtime.formats.artifact import KnownDigests

    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "a.bin").write_bytes(b"a" * 100)
    (stage / "b.bin").write_bytes(b"b" * 100)
    known = KnownDigests()
    known.add([stage / "a.bin", stage / "b.bin"])
    (stage / "b.bin").write_bytes(b"c" * 101)  # changed after it was hashed
    read: list[str] = []
    real = artifact.sha256_file
    monkeypatch.setattr(artifact, "sha256_file", lambda p: read.append(Path(p).name) or real(p))

    manifest = artifact.Manifest(name="demo")
    with artifact.assemble(tmp_path / "out", manifest, known=known) as staging:
        for name in ("a.bin", "b.bin"):
            os.link(stage / name, staging.dir / name)
        (staging.dir / "new.bin").write_bytes(b"n")
    assert sorted(read) == ["b.bin", "new.bin"]  # a.bin's digest was known
    assert staging.path is not None and artifact.verify(staging.path) == []

    os.utime(stage / "a.bin", ns=(1, 1))  # same size, another time: read again
    assert known.get(stage / "a.bin") is None
    read.clear()
    assert artifact.verify(staging.path) == [] and "a.bin" in read
