"""The quantisation error report: per-layer weight error and next-token agreement.

Everything about the quantised model is read back from the saved checkpoint, never from the
in-memory model that produced it, so the report describes what ships:

- compressed-tensors: transformers loads it, compressed-tensors decompresses the integer or
  fp8 codes, and the forward keeps its activation and KV cache quantisation;
- ModelOpt HF export: transformers cannot load it (it has no "modelopt" quantizer), so
  `quant.backends.modelopt.load_checkpoint` rebuilds the model from the codes and scales the
  runtime's checkpoint reader decodes (the values kiln serves) and applies the exported
  activation and KV scales with hooks.

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
from pathlib import Path
from typing import Any

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


def load_quantised(path: Path) -> tuple[Any, dict[str, Any]]:
    """(model, {linear name: dequantised effective weight}) read from a saved checkpoint."""
    fmt = checkpoint_format(path)
    if fmt == "compressed-tensors":
        from kiln.quant.backends.llmcompressor import load_checkpoint

        return load_checkpoint(Path(path))
    if fmt == "modelopt":
        from kiln.quant.backends.modelopt import load_checkpoint as load_modelopt

        return load_modelopt(Path(path))
    return _load_float(Path(path)), {}


def _load_float(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


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
        ref = float_state[f"{name}.weight"].clone()
        if name in col:
            ref = ref * col[name][None, :]
        if name in row:
            ref = ref * row[name][:, None]
        err = float(((weight - ref) ** 2).sum() / (ref**2).sum().clamp_min(1e-30))
        out.append(
            {
                "name": name,
                "shape": list(weight.shape),
                "rel_mse": err,
                "smoothing_corrected": name in col or name in row,
            }
        )
    return out


def next_token_agreement(
    float_model: Any, quant_model: Any, samples: list[list[int]]
) -> dict[str, Any]:
    """KL(float ‖ quantised) per next-token position, top-1 agreement and both perplexities."""
    import torch

    kls, agree, nll_f, nll_q, count = [], 0, 0.0, 0.0, 0
    with torch.no_grad():
        for ids in samples:
            x = torch.tensor([ids])
            lf = float_model(x).logits[0, :-1].float().log_softmax(-1)
            lq = quant_model(x).logits[0, :-1].float().log_softmax(-1)
            target = x[0, 1:, None]
            kls.append((lf.exp() * (lf - lq)).sum(-1).clamp_min(0))
            agree += int((lf.argmax(-1) == lq.argmax(-1)).sum())
            nll_f -= float(lf.gather(-1, target).sum())
            nll_q -= float(lq.gather(-1, target).sum())
            count += target.shape[0]
    kl = torch.cat(kls) if kls else torch.zeros(1)
    return {
        "tokens": count,
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "top1_agreement": agree / max(count, 1),
        "perplexity_float": math.exp(nll_f / max(count, 1)),
        "perplexity_quantized": math.exp(nll_q / max(count, 1)),
    }


def quantization_report(
    float_dir: Path,
    quant_dir: Path,
    texts: list[str],
    max_seq_len: int = 256,
    smoothing: bool = True,
) -> dict[str, Any]:
    """Per-layer weight error and next-token KL, top-1 agreement and perplexity on `texts`
    (`smoothing`: whether the method moved scales between layers, see weight_errors)."""
    from transformers import AutoTokenizer

    from kiln.quant.calibration import tokenize

    float_dir, quant_dir = Path(float_dir), Path(quant_dir)
    float_model = _load_float(float_dir)
    quant_model, weights = load_quantised(quant_dir)
    layers = weight_errors(float_model.state_dict(), quant_model.state_dict(), weights, smoothing)
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    samples = [s for s in tokenize(texts, tokenizer, max_seq_len) if len(s) >= 2]
    worst = max(layers, key=lambda layer: layer["rel_mse"], default=None)
    return {
        "format": checkpoint_format(quant_dir),
        "texts": len(samples),
        "max_seq_len": max_seq_len,
        **next_token_agreement(float_model, quant_model, samples),
        "weight_rel_mse_mean": sum(x["rel_mse"] for x in layers) / len(layers) if layers else 0.0,
        "weight_rel_mse_max": worst["rel_mse"] if worst else 0.0,
        "worst_layer": worst["name"] if worst else None,
        "layers": layers,
    }
