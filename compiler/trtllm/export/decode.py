"""Read a TensorRT-LLM unified checkpoint back to float weights under Hugging Face names.

The round-trip check of the export: what `decode_checkpoint` returns is what the engine
will compute with (codes × scales, + zeros, × pre-quant scales, tensor-parallel shards
reassembled), so comparing it with the quantiser's own dequantised weights proves the
checkpoint carries the same values. Only the layouts `compiler.trtllm.export` writes are
read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.formats.checkpoint.modelopt import unpack_int4_rows
from kiln.runtime.formats.model_info import MOE_LAYOUTS
from kiln.runtime.formats.nvfp4 import unpack_e2m1

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HF_MLP = {"mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}


def read_checkpoint(ckpt_dir: Path) -> tuple[dict[str, Any], list[dict[str, torch.Tensor]]]:
    """config.json and every rank's tensors."""
    ckpt_dir = Path(ckpt_dir)
    try:
        config = json.loads((ckpt_dir / "config.json").read_text())
        world = int(config["mapping"]["world_size"])
    except (OSError, KeyError, ValueError) as err:
        raise ArtifactError(f"{ckpt_dir}: not a TensorRT-LLM checkpoint ({err})") from err
    ranks = []
    for rank in range(world):
        path = ckpt_dir / f"rank{rank}.safetensors"
        if not path.is_file():
            raise ArtifactError(f"{ckpt_dir}: {path.name} is missing (world_size {world})")
        with safe_open(str(path), "pt") as f:
            ranks.append({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return config, ranks


def dequantize_linear(
    t: dict[str, torch.Tensor], prefix: str, quant: dict[str, Any], dtype: torch.dtype
) -> torch.Tensor:
    """Float32 (out, in) weight of one linear of one rank, activation pre-scaling folded in.

    Group scales are rounded to the model `dtype` first, as trtllm-build stores them.
    """
    w = t[f"{prefix}.weight"]
    f32 = torch.float32
    if w.dtype == torch.float8_e4m3fn:  # FP8 per tensor, or rowwise per output channel
        scale = t.get(f"{prefix}.per_channel_scale")
        if scale is None:
            scale = t[f"{prefix}.weights_scaling_factor"]
        return w.to(f32) * scale.to(f32).reshape(-1, 1)
    if w.is_floating_point():
        return w.to(f32)
    if f"{prefix}.weights_scaling_factor_2" in t and w.dtype == torch.uint8:  # NVFP4
        block = t[f"{prefix}.weights_scaling_factor"].to(f32).repeat_interleave(16, dim=1)
        return unpack_e2m1(w) * block * t[f"{prefix}.weights_scaling_factor_2"].to(f32)
    algo = quant.get("quant_algo")
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        codes = unpack_int4_rows(w).to(f32)
        group = int(quant["group_size"])
        scale = t[f"{prefix}.weights_scaling_factor"].to(dtype).to(f32)
        scale = scale.repeat_interleave(group, dim=1)
        out = codes * scale
        if f"{prefix}.zero" in t:
            out = out + t[f"{prefix}.zero"].to(f32).t().repeat_interleave(group, dim=1)
    elif f"{prefix}.per_channel_scale" in t:  # SmoothQuant plugin layout
        out = w.to(f32) * t[f"{prefix}.per_channel_scale"].to(f32).reshape(-1, 1)
        if f"{prefix}.smoother" in t:
            out = out / t[f"{prefix}.smoother"].to(f32).reshape(1, -1)
        return out
    else:  # SmoothQuant "ootb" layout
        out = w.to(f32) * t[f"{prefix}.weights_scaling_factor"].to(f32).reshape(-1, 1)
    pqs = t.get(f"{prefix}.prequant_scaling_factor")
    return out * pqs.to(f32).reshape(1, -1) if pqs is not None else out


def _kv_ranks(kv_heads: int, tp: int) -> list[int]:
    """Ranks whose K/V heads are distinct (one per head when tp replicates them)."""
    return list(range(tp)) if kv_heads % tp == 0 else list(range(0, tp, tp // kv_heads))


def decode_checkpoint(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Float32 weights under HF names, tp shards reassembled; KV cache scales as
    `model.layers.N.self_attn.kv_scale`."""
    config, ranks = read_checkpoint(ckpt_dir)
    quant = config.get("quantization") or {}
    tp = int(config["mapping"]["tp_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_size") or int(config["hidden_size"]) // heads)
    q_rows = heads * head_dim // tp
    kv_rows = (kv_heads // tp if kv_heads % tp == 0 else 1) * head_dim
    dtype = DTYPES[config.get("dtype", "float16")]
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])

    def deq(t: dict[str, torch.Tensor], prefix: str, rows: int, cols: int) -> torch.Tensor:
        # Group-wise layers are stored padded (each rank's slice, zeros after): trim them.
        return dequantize_linear(t, prefix, quant, dtype)[:rows, :cols]

    def norm(weight: torch.Tensor) -> torch.Tensor:  # back to Gemma's x·(1 + w) convention
        return weight.float() - 1 if gemma else weight.float()

    gemma = config.get("architecture") == "Gemma3ForCausalLM"
    first = ranks[0]
    out = {
        "model.embed_tokens.weight": first["transformer.vocab_embedding.weight"].float(),
        "model.norm.weight": norm(first["transformer.ln_f.weight"]),
    }
    vocab = int(config["vocab_size"])
    lm_head = torch.cat([deq(r, "lm_head", -(-vocab // tp), hidden) for r in ranks])
    out["lm_head.weight"] = lm_head[:vocab]
    for i in range(int(config["num_hidden_layers"])):
        layer, hf = f"transformer.layers.{i}", f"model.layers.{i}"
        qkv = [deq(r, f"{layer}.attention.qkv", q_rows + 2 * kv_rows, hidden) for r in ranks]
        out[f"{hf}.self_attn.q_proj.weight"] = torch.cat([part[:q_rows] for part in qkv])
        for j, name in enumerate(("k_proj", "v_proj")):
            start = q_rows + j * kv_rows
            shards = [qkv[r][start : start + kv_rows] for r in _kv_ranks(kv_heads, tp)]
            out[f"{hf}.self_attn.{name}.weight"] = torch.cat(shards)
        if f"{layer}.attention.qkv.bias" in first:  # Qwen2
            bias = [r[f"{layer}.attention.qkv.bias"].float() for r in ranks]
            out[f"{hf}.self_attn.q_proj.bias"] = torch.cat([b[:q_rows] for b in bias])
            for j, name in enumerate(("k_proj", "v_proj")):
                start = q_rows + j * kv_rows
                parts = [bias[r][start : start + kv_rows] for r in _kv_ranks(kv_heads, tp)]
                out[f"{hf}.self_attn.{name}.bias"] = torch.cat(parts)
        out[f"{hf}.self_attn.o_proj.weight"] = torch.cat(
            [deq(r, f"{layer}.attention.dense", hidden, q_rows) for r in ranks], dim=1
        )
        mlp = HF_MLP
        if f"{layer}.mlp.router.weight" in first:
            out.update(_experts(config, ranks, layer, hf))
            mlp = {}
        elif f"{layer}.mlp.gate.weight" not in first:  # Phi-3: fc holds [up; gate] per rank
            width = inter // tp
            fc = [deq(r, f"{layer}.mlp.fc", 2 * width, hidden) for r in ranks]
            out[f"{hf}.mlp.up_proj.weight"] = torch.cat([part[:width] for part in fc])
            out[f"{hf}.mlp.gate_proj.weight"] = torch.cat([part[width:] for part in fc])
            mlp = {"mlp.proj": HF_MLP["mlp.proj"]}
        for trt, name in mlp.items():
            row = trt == "mlp.proj"
            rows, cols = (hidden, inter // tp) if row else (inter // tp, hidden)
            parts = [deq(r, f"{layer}.{trt}", rows, cols) for r in ranks]
            out[f"{hf}.{name}.weight"] = torch.cat(parts, dim=1 if row else 0)
        out[f"{hf}.input_layernorm.weight"] = norm(first[f"{layer}.input_layernorm.weight"])
        for qk in ("q", "k"):  # Qwen3, Gemma 3
            found = first.get(f"{layer}.attention.{qk}_layernorm.weight")
            if found is not None:
                out[f"{hf}.self_attn.{qk}_norm.weight"] = norm(found)
        out[f"{hf}.post_attention_layernorm.weight"] = norm(first[f"{layer}.post_layernorm.weight"])
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):  # Gemma 3
            if f"{layer}.{name}.weight" in first:
                out[f"{hf}.{name}.weight"] = norm(first[f"{layer}.{name}.weight"])
        kv = first.get(f"{layer}.attention.kv_cache_scaling_factor")
        if kv is not None:
            out[f"{hf}.self_attn.kv_scale"] = kv.float().reshape(())
    return out


def _experts(
    config: dict[str, Any],
    ranks: list[dict[str, torch.Tensor]],
    layer: str,
    hf: str,
) -> dict[str, torch.Tensor]:
    """A sparse layer's router and each expert's gate, up and down under HF names: fc rows
    [up; gate] of each rank, proj columns of each rank, FP8 codes × their expert's scale."""
    moe = MOE_LAYOUTS[config["architecture"]]  # the family's HF names
    block, router, gate, up, down = moe.block, moe.router, moe.gate, moe.up, moe.down
    first = ranks[0]
    out = {f"{hf}.{block}.{router}.weight": first[f"{layer}.mlp.router.weight"].float()}

    def stacked(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        w = t[f"{layer}.mlp.{name}.weight"]
        scale = t.get(f"{layer}.mlp.{name}.weights_scaling_factor")
        if scale is None:
            return w.to(torch.float32)
        return w.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1, 1)

    fcs = [stacked(r, "fc") for r in ranks]
    projs = [stacked(r, "proj") for r in ranks]
    width = fcs[0].shape[1] // 2
    for e in range(fcs[0].shape[0]):
        base = f"{hf}.{block}.experts.{e}"
        out[f"{base}.{up}.weight"] = torch.cat([fc[e, :width] for fc in fcs])
        out[f"{base}.{gate}.weight"] = torch.cat([fc[e, width:] for fc in fcs])
        out[f"{base}.{down}.weight"] = torch.cat([proj[e] for proj in projs], dim=1)
    return out
