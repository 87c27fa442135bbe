"""The quantisation error report: per-layer weight error and next-token agreement.

Everything about the quantised model is read back from the saved checkpoint, never from the
in-memory model that produced it, so the report describes what ships: the codes and scales
kiln's checkpoint reader decodes (the values kiln serves), compressed-tensors' or ModelOpt's,
with the checkpoint's activation and KV-cache quantisation applied by hooks
(quant/streamed_model.py). Memory is bounded by a layer: both models stream their weights a
module at a time and run one after the other (the float one's log-probabilities kept in a
file meanwhile), and weights are compared a decoder layer at a time, in float32. Where a GPU
is present the forwards run there.

Weight error is the relative MSE ‖W_deq − W_ref‖² / ‖W_ref‖² per quantised linear. AWQ and
SmoothQuant fold per-channel smoothing scales into neighbouring weights and norms, so W_ref is
the float weight with the same smoothing applied: columns of q/k/v and gate/up scaled by the
ratio float norm / saved norm (exact), and columns of o_proj/down_proj scaled by a per-column
least-squares fit, with the producing v_proj/up_proj rows divided by it — used only when
that fit is clearly not 1 (median |log s| > 0.05), as after AWQ. The fit absorbs a
1/out_features share of the error, so those layers read slightly optimistic.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


SMOOTHED_BY_NORM = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
SMOOTHED_BY_LINEAR = {"self_attn.o_proj": "self_attn.v_proj", "mlp.down_proj": "mlp.up_proj"}
FIT_THRESHOLD = 0.05
# Methods that move scales between layers (into norms and the preceding linear).
SMOOTHING_METHODS = frozenset({"awq", "smoothquant"})


def checkpoint_format(path: Path) -> str:
    """`compressed-tensors`, `modelopt` or `float`, from the checkpoint's config."""
    config = json.loads((Path(path) / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method == "compressed-tensors":
        return "compressed-tensors"
    if method == "modelopt" or (Path(path) / "hf_quant_config.json").is_file():
        return "modelopt"
    return "float"


def load_quantised(
    path: Path, device: Any = "cpu", dtype: Any = None, seen: Any = None
) -> tuple[Any, Mapping[str, Any]]:
    """(model, {linear name: dequantised effective weight}) read from a saved checkpoint: a
    streamed model (quant/streamed_model.py) that computes as the checkpoint ships, in `dtype`
    (float32 when None); `seen(name, first row, rows)` hears each quantised linear's effective
    weight as the forward decodes it, a block of rows at a time."""
    import torch

    from kiln.quant.streamed_model import float_model, quantised_model

    dtype = dtype or torch.float32
    if checkpoint_format(path) == "float":
        return float_model(Path(path), device, dtype), {}
    return quantised_model(Path(path), device, dtype, seen)


def weight_errors(
    float_state: dict[str, Any],
    quant_state: dict[str, Any],
    weights: dict[str, Any],
    smoothing: bool = True,
) -> list[dict[str, Any]]:
    """Relative MSE of each dequantised weight against its float reference, corrected for the
    scales a smoothing method (AWQ, SmoothQuant) moved between layers; `smoothing=False` for
    a method that moves none (GPTQ, FP8), where a layer's own large error would otherwise be
    read as smoothing and charged to its neighbour."""
    import torch

    col: dict[str, Any] = {}  # linear name -> per-input-column scale of the reference
    row: dict[str, Any] = {}  # linear name -> per-output-row scale of the reference
    for name, weight in weights.items() if smoothing else ():
        local = name.rpartition(".layers.")[2].partition(".")[2]  # e.g. self_attn.q_proj
        prefix = name[: len(name) - len(local)]  # e.g. model.layers.0.
        for norm, users in SMOOTHED_BY_NORM.items():
            if local in users and f"{prefix}{norm}.weight" in float_state:
                saved = quant_state[f"{prefix}{norm}.weight"]
                ratio = float_state[f"{prefix}{norm}.weight"] / torch.where(
                    saved.abs() > 1e-12, saved, torch.ones_like(saved)
                )
                col[name] = ratio
        if local in SMOOTHED_BY_LINEAR:
            ref = float_state[f"{name}.weight"]
            fit = (weight * ref).sum(0) / (ref * ref).sum(0).clamp_min(1e-30)
            if fit.clamp_min(1e-12).log().abs().median() > FIT_THRESHOLD:
                col[name] = fit
                row[prefix + SMOOTHED_BY_LINEAR[local]] = 1 / fit.clamp_min(1e-12)
    out = []
    for name, weight in weights.items():
        ref = float_state[f"{name}.weight"]
        if name in col:
            ref = ref * col[name][None, :]
        if name in row:
            ref = ref * row[name][:, None]
        diff = (weight - ref).reshape(-1)
        flat = ref.reshape(-1)
        err = float(torch.dot(diff, diff) / torch.dot(flat, flat).clamp_min(1e-30))
        out.append(error_row(name, list(weight.shape), err, name in col or name in row))
    return out


def error_row(
    name: str, shape: list[int], rel_mse: float, corrected: bool = False
) -> dict[str, Any]:
    """One linear's line of the report's `layers`."""
    return {"name": name, "shape": shape, "rel_mse": rel_mse, "smoothing_corrected": corrected}


def layer_weight_errors(
    float_dir: Path,
    quant_dir: Path,
    names: list[str],
    smoothing: bool = True,
    progress: Progress = _quiet,
) -> list[dict[str, Any]]:
    """`weight_errors` of the quantised linears `names` (in the model's order), a decoder layer
    at a time: only that layer's float and dequantised weights are ever held, in float32.
    `progress` hears "layers' weights compared (done/total)" after each (nothing where
    `names` is empty: the report's forward compared them all)."""
    if not names:
        return []
    import torch

    from kiln.runtime.base.heap import trim_freed
    from kiln.runtime.formats.checkpoint import TensorFiles, open_checkpoint
    from kiln.runtime.formats.weights import effective_weight

    floats, ckpt = TensorFiles(Path(float_dir)), open_checkpoint(Path(quant_dir))
    out: list[dict[str, Any]] = []
    groups = _by_layer(names)
    progress(f"layers' weights compared (0/{len(groups)})")
    for done, group in enumerate(groups, 1):
        prefix = group[0][: len(group[0]) - len(_local(group[0]))]
        float_state, quant_state = {}, {}
        for norm in SMOOTHED_BY_NORM if smoothing and prefix else ():
            key = f"{prefix}{norm}.weight"
            if key in floats and key in ckpt:
                float_state[key] = floats.get(key).to(torch.float32)
                quant_state[key] = ckpt.tensor(key).to(torch.float32)
        for name in group:
            float_state[f"{name}.weight"] = floats.get(f"{name}.weight").to(torch.float32)
        weights = {n: effective_weight(ckpt.served_linear(n), torch.float32) for n in group}
        out += weight_errors(float_state, quant_state, weights, smoothing)
        del float_state, quant_state, weights
        trim_freed()
        progress(f"layers' weights compared ({done}/{len(groups)})")
    return out


def _local(name: str) -> str:
    """A linear's name within its decoder layer (e.g. self_attn.q_proj), or the whole name."""
    return name.rpartition(".layers.")[2].partition(".")[2] if ".layers." in name else name


def _by_layer(names: list[str]) -> list[list[str]]:
    """Consecutive names of one decoder layer together (a linear outside the layers alone)."""
    groups: list[list[str]] = []
    for name in names:
        prefix = name[: len(name) - len(_local(name))]
        if groups and prefix and groups[-1][0].startswith(prefix):
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


# Logits one forward may hold (the samples run in batches of one length within it), and the
# rows of log-probabilities compared at once: a large vocabulary makes both the report's peak.
LOGITS_BYTES = 256 * 2**20
ROWS = 128


def _batches(samples: list[list[int]], vocab: int, itemsize: int) -> list[list[int]]:
    """Indices of samples run together (each batch reads every weight once): one length each,
    within LOGITS_BYTES of logits."""
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(samples):
        by_length.setdefault(len(ids), []).append(i)
    out = []
    for length, members in by_length.items():
        size = max(1, LOGITS_BYTES // (itemsize * vocab * length))
        out += [members[i : i + size] for i in range(0, len(members), size)]
    return out


REFERENCE_FILE = "float-logprobs.f32"
REFERENCE_RECORD = "float-logprobs.json"


def samples_digest(samples: list[list[int]]) -> str:
    """What names the token ids a reference was computed on."""
    import hashlib

    return hashlib.sha256(json.dumps(samples).encode()).hexdigest()


def _chunks(
    model: Any, which: str, samples: list[list[int]], device: Any, progress: Progress
) -> Iterator[tuple[Any, Any]]:
    """(log-probabilities [rows, vocab] in float32, the next tokens) of `model` on `samples`,
    ROWS positions at a time, in an order that depends only on the samples and the vocabulary
    (so the float and the quantised model's rows line up)."""
    import torch

    vocab = int(model.config.vocab_size)
    batches = _batches(samples, vocab, model.dtype.itemsize)
    progress(f"{which} model batches run (0/{len(batches)})")
    for done, batch in enumerate(batches, 1):
        x = torch.tensor([samples[i] for i in batch], device=device)
        logits = model(x).logits[:, :-1].reshape(-1, vocab)
        targets = x[:, 1:].reshape(-1, 1).cpu()
        for start in range(0, len(logits), ROWS):
            rows = logits[start : start + ROWS].float().log_softmax(-1).cpu()
            yield rows, targets[start : start + ROWS]
        progress(f"{which} model batches run ({done}/{len(batches)})")


def float_reference(
    float_model: Any,
    samples: list[list[int]],
    out_dir: Path,
    device: Any = "cpu",
    progress: Progress = _quiet,
) -> Path:
    """The float model's log-probabilities of every next token of `samples`, written to
    `out_dir`/REFERENCE_FILE (float32 rows, ROWS at a time) with REFERENCE_RECORD (the
    samples' digest, the rows and the float negative log-likelihood); returns `out_dir`."""
    import torch

    nll, count = 0.0, 0
    with torch.no_grad(), (Path(out_dir) / REFERENCE_FILE).open("wb") as sink:
        # written, not mapped: the pages are not ours to hold
        for lf, target in _chunks(float_model, "float", samples, device, progress):
            sink.write(lf.numpy().tobytes())
            nll -= float(lf.gather(-1, target).sum())
            count += len(lf)
    record = {"samples": samples_digest(samples), "rows": count, "nll": nll,
              "vocab": int(float_model.config.vocab_size)}  # fmt: skip
    (Path(out_dir) / REFERENCE_RECORD).write_text(json.dumps(record))
    return Path(out_dir)


def reference_problem(reference: Path, samples: list[list[int]], vocab: int) -> str | None:
    """Why `reference` (a float_reference directory) cannot stand for `samples`, or None."""
    try:
        record = json.loads((reference / REFERENCE_RECORD).read_text())
        size = (reference / REFERENCE_FILE).stat().st_size
    except (OSError, ValueError) as exc:
        return f"{reference}: unreadable ({exc})"
    if record.get("samples") != samples_digest(samples) or record.get("vocab") != vocab:
        return f"{reference}: computed on other samples or another vocabulary"
    if size != int(record.get("rows", -1)) * vocab * 4:
        return f"{reference}: {size} bytes where {record.get('rows')} rows were recorded"
    return None


def next_token_agreement(
    float_model: Any,
    quant_model: Any,
    samples: list[list[int]],
    scratch: Path,
    device: Any = "cpu",
    progress: Progress = _quiet,
    reference: Path | None = None,
) -> dict[str, Any]:
    """KL(float ‖ quantised) per next-token position, top-1 agreement and both perplexities:
    the float model's log-probabilities are read from `reference` (a float_reference made
    beforehand, e.g. beside the quantisation), or computed first into `scratch`, then the
    quantised model's are compared with them, one model running at a time and ROWS positions
    of log-probabilities in memory at once. `progress` hears each model's "... batches run
    (done/total)"."""
    import numpy as np
    import torch

    if reference is None:
        reference = float_reference(float_model, samples, Path(scratch), device, progress)
    record = json.loads((reference / REFERENCE_RECORD).read_text())
    nll_f, count = float(record["nll"]), int(record["rows"])
    nll_q, agree, kls = 0.0, 0, []
    with torch.no_grad(), (reference / REFERENCE_FILE).open("rb") as source:
        for lq, target in _chunks(quant_model, "quantised", samples, device, progress):
            lf = torch.from_numpy(np.fromfile(source, np.float32, lq.numel()))
            lf = lf.view(lq.shape)
            kls.append((lf.exp() * (lf - lq)).sum(-1).clamp_min(0))
            agree += int((lf.argmax(-1) == lq.argmax(-1)).sum())
            nll_q -= float(lq.gather(-1, target).sum())
    if count == 0:
        return {"tokens": 0, "kl_mean": 0.0, "kl_p99": 0.0, "top1_agreement": 0.0,
                "perplexity_float": 1.0, "perplexity_quantized": 1.0}  # fmt: skip
    kl = torch.cat(kls)
    return {
        "tokens": count,
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "top1_agreement": agree / count,
        "perplexity_float": math.exp(nll_f / count),
        "perplexity_quantized": math.exp(nll_q / count),
    }


def report_device() -> str:
    """Where the report runs its forwards: the GPU where there is one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def report_samples(float_dir: Path, texts: list[str], max_seq_len: int) -> list[list[int]]:
    """The token ids the report runs: each text tokenised by the float model's tokenizer, cut
    to `max_seq_len`, those with a next token to predict."""
    from transformers import AutoTokenizer

    from kiln.quant.calibration import tokenize

    tokenizer = AutoTokenizer.from_pretrained(Path(float_dir))
    return [s for s in tokenize(texts, tokenizer, max_seq_len) if len(s) >= 2]


def report_dtype(float_dir: Path) -> Any:
    """The dtype the report computes in: the float checkpoint's (as it was calibrated and is
    deployed)."""
    import torch

    from kiln.quant.spec import calibration_dtype

    config = json.loads((Path(float_dir) / "config.json").read_text())
    return getattr(torch, calibration_dtype(str(config.get("torch_dtype") or config.get("dtype"))))


def quantization_report(
    float_dir: Path,
    quant_dir: Path,
    texts: list[str],
    max_seq_len: int = 256,
    smoothing: bool = True,
    scratch: Path | None = None,
    progress: Progress | None = None,
    reference: Path | None = None,
) -> dict[str, Any]:
    """Per-layer weight error and next-token KL, top-1 agreement and perplexity on `texts`
    (`smoothing`: whether the method moved scales between layers, see weight_errors). Both
    models stream their weights a module at a time (quant/streamed_model.py), one runs at a
    time, in the float checkpoint's dtype (report_dtype), and the weights are compared a
    decoder layer at a time in float32: memory is bounded by a layer, not by the model. The
    float model's log-probabilities come from `reference` (a float_reference of the same
    samples, made beforehand) where it stands for them, else they are computed into `scratch`
    first; `progress` hears the layers compared and the batches run, counted
    ("... (done/total)")."""
    import tempfile
    import threading

    import torch

    from kiln.quant.streamed_model import float_model
    from kiln.runtime.base.heap import reuse_within_layers
    from kiln.runtime.formats.checkpoint import TensorFiles

    reuse_within_layers()  # modules are loaded and freed one after another, layer by layer
    float_dir, quant_dir = Path(float_dir), Path(quant_dir)
    device = report_device()
    samples = report_samples(float_dir, texts, max_seq_len)
    dtype = report_dtype(float_dir)
    float_side = float_model(float_dir, device, dtype)
    say = progress or _quiet
    if reference is not None:
        problem = reference_problem(reference, samples, int(float_side.config.vocab_size))
        if problem is not None:
            say(f"report: the float model's log-probabilities made beforehand do not serve "
                f"({problem}); computing them now")  # fmt: skip
            reference = None
    # Without smoothing each linear is compared alone: as the quantised model's forward decodes
    # it, a block of rows at a time, rather than decoding every weight a second time.
    # The blocks of a weight are heard from several threads in no fixed order: each block's
    # sums are kept by its first row and added in row order once all are in, so the figure is
    # the same however the blocks were scheduled.
    floats = TensorFiles(float_dir)
    compared: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    # name -> (float weight, {first row: (‖diff‖², ‖ref‖²)}, [rows heard])
    partial: dict[str, tuple[Any, dict[int, tuple[float, float]], list[int]]] = {}

    def seen(name: str, start: int, rows: Any) -> None:
        if smoothing or name not in wanted or name in compared:
            return
        with lock:
            if name not in partial:
                partial[name] = (floats.get(f"{name}.weight"), {}, [0])
            full, blocks, heard = partial[name]
        ref = full[start : start + len(rows)].to(rows.device, torch.float32).reshape(-1)
        diff = rows.reshape(-1) - ref
        sums = (float(torch.dot(diff, diff)), float(torch.dot(ref, ref)))
        with lock:
            blocks[start] = sums
            heard[0] += len(rows)
            if heard[0] < len(full):
                return
            del partial[name]
        errors, norms = 0.0, 0.0
        for first in sorted(blocks):
            errors += blocks[first][0]
            norms += blocks[first][1]
        compared[name] = error_row(name, list(full.shape), errors / max(norms, 1e-30))

    quant_model, weights = load_quantised(quant_dir, device, dtype, seen)
    wanted = set(weights)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="kiln-report-") as tmp:
        agreement = next_token_agreement(float_side, quant_model, samples, Path(tmp), device,
                                         say, reference)  # fmt: skip
    missed = [name for name in weights if name not in compared]
    found = layer_weight_errors(float_dir, quant_dir, missed, smoothing, say)
    compared |= {row["name"]: row for row in found}
    layers = [compared[name] for name in weights]
    worst = max(layers, key=lambda layer: layer["rel_mse"], default=None)
    return {
        "format": checkpoint_format(quant_dir),
        "texts": len(samples),
        "max_seq_len": max_seq_len,
        **agreement,
        "weight_rel_mse_mean": sum(x["rel_mse"] for x in layers) / len(layers) if layers else 0.0,
        "weight_rel_mse_max": worst["rel_mse"] if worst else 0.0,
        "worst_layer": worst["name"] if worst else None,
        "layers": layers,
    }
