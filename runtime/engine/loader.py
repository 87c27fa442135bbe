"""Build the serving model from a Hugging Face checkpoint directory.

The checkpoint is read by `runtime.checkpoint` (float, compressed-tensors or ModelOpt's HF
export); here each projection gets the kernel that fits its encoding (kernels.make_linear)
and the KV cache's encoding is described. A ModelOpt scheme the kernels do not run is
refused up front, naming what is served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.engine.dtype import choose_dtype
from kiln.runtime.engine.layers.kernels import make_linear
from kiln.runtime.engine.model import CausalLM, DecoderLayer, Experts
from kiln.runtime.formats.checkpoint import Checkpoint, open_checkpoint, read_config
from kiln.runtime.formats.model_info import ModelInfo
from kiln.runtime.formats.weights import LinearWeights, WeightScheme

__all__ = ["KVCacheSpec", "load_model", "read_config"]

log = logging.getLogger("kiln.runtime")

PROJECTIONS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
# Phi-3's checkpoints store them stacked already, in the order the kernels stack them.
FUSED = {"qkv": ("self_attn.qkv_proj",), "gate_up": ("mlp.gate_up_proj",)}
# What the kernels serve of a ModelOpt export: FP8 per-tensor static (Fp8Linear), W4A16 AWQ
# (Int4Linear or DequantLinear), W8A8 SmoothQuant with static activations (Int8Linear),
# NVFP4 (Nvfp4Linear, emulated) and W4A8 AWQ (as the FP8 weights the GPU multiplies, on
# Fp8Linear: runtime/formats/w4a8.py), pre-quant scales applied to the input (PreScaledLinear); an
# FP8 KV cache or none.
MODELOPT_SERVED = ("FP8", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL", "NVFP4", "W4A8_AWQ")
MODELOPT_KV_SERVED = ("fp8",)


@dataclass(slots=True)
class KVCacheSpec:
    """How the checkpoint wants the KV cache stored: None (model dtype), "fp8" or "int8"."""

    quant: str | None = None
    k_scales: list[torch.Tensor] = field(default_factory=list)
    v_scales: list[torch.Tensor] = field(default_factory=list)


def check_servable(ckpt: Checkpoint) -> None:
    """Refuse a quantisation scheme the runtime's kernels do not run."""
    quant = ckpt.quant
    if ckpt.format != "modelopt" or quant.quant_algo is None:
        return
    if quant.quant_algo not in MODELOPT_SERVED or quant.kv_cache not in (
        None,
        *MODELOPT_KV_SERVED,
    ):
        kv = f" with a {quant.kv_cache} KV cache" if quant.kv_cache else ""
        raise ArtifactError(
            f"{ckpt.dir}: ModelOpt {quant.quant_algo}{kv} cannot be served by the kiln "
            f"runtime; it serves ModelOpt {', '.join(MODELOPT_SERVED)} with an FP8 KV cache "
            "or none. Serve this checkpoint with TensorRT-LLM, or quantise with one of those"
        )


def load_model(
    model_dir: Path, dtype: str, device: torch.device, max_model_len: int | None = None
) -> tuple[CausalLM, KVCacheSpec]:
    """Build the model and describe its KV-cache encoding from a checkpoint directory
    (rotary tables for `max_model_len` positions; None: the model's own limit)."""
    raw = read_config(model_dir)
    config = ModelInfo.for_runtime(raw, str(model_dir))
    choice = choose_dtype(dtype, raw, device)
    log.info("%s: computing in %s (%s)", model_dir, choice.name, choice.reason)
    compute = choice.dtype
    ckpt = open_checkpoint(model_dir)
    check_servable(ckpt)

    def linear(prefix: str, names: tuple[str, ...]) -> Any:
        parts = [ckpt.served_linear(f"{prefix}.{n}".lstrip(".")) for n in names]
        try:
            return make_linear(parts, compute, device)
        except ValueError as exc:
            raise ArtifactError(f"{model_dir}: {prefix}: {exc}") from exc

    def tensor(name: str) -> torch.Tensor:
        return ckpt.tensor(name).to(device=device, dtype=compute)

    def norm(name: str) -> torch.Tensor:
        """An RMSNorm's weight; Gemma's scale by (1 + weight), folded here in float32."""
        if not config.gemma:
            return tensor(name)
        return (ckpt.tensor(name).float() + 1.0).to(device=device, dtype=compute)

    def experts(p: str) -> Experts:
        """A sparse layer's router (kept float: TensorRT-LLM and vLLM read it so) and every
        expert's projections, each on the kernel of its own encoding."""
        moe = config.moe
        assert moe is not None
        block = f"{p}.{moe.block}"
        router = f"{block}.{moe.router}"
        if ckpt.served_linear(router).scheme.type != "dense":
            raise ArtifactError(
                f"{model_dir}: {router} (the MoE router) is quantised; kiln serves float "
                "routers, as TensorRT-LLM and vLLM do: add it to quantization.ignore"
            )
        named = [f"{block}.experts.{e}" for e in range(config.num_experts)]
        return Experts(
            router=tensor(f"{router}.weight"),
            gate_up=[linear(e, (moe.gate, moe.up)) for e in named],
            down=[linear(e, (moe.down,)) for e in named],
            top_k=config.num_experts_per_tok,
            normalize=config.norm_topk_prob,
        )

    embed = tensor("model.embed_tokens.weight")
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        sparse = config.is_sparse(i)
        sandwich = config.gemma  # Gemma 3's own norms around the MLP
        gate_up = FUSED["gate_up"] if config.fused_projections else PROJECTIONS["gate_up"]
        layers.append(
            DecoderLayer(
                input_norm=norm(f"{p}.input_layernorm.weight"),
                qkv=linear(p, FUSED["qkv"] if config.fused_projections else PROJECTIONS["qkv"]),
                o_proj=linear(p, PROJECTIONS["o_proj"]),
                post_norm=norm(f"{p}.post_attention_layernorm.weight"),
                gate_up=None if sparse else linear(p, gate_up),
                down=None if sparse else linear(p, PROJECTIONS["down"]),
                q_norm=norm(f"{p}.self_attn.q_norm.weight") if config.qk_norm else None,
                k_norm=norm(f"{p}.self_attn.k_norm.weight") if config.qk_norm else None,
                experts=experts(p) if sparse else None,
                pre_mlp_norm=norm(f"{p}.pre_feedforward_layernorm.weight") if sandwich else None,
                post_mlp_norm=norm(f"{p}.post_feedforward_layernorm.weight") if sandwich else None,
                windowed=config.layer_window(i) is not None,
            )
        )
    # As transformers does: a stored lm_head wins even when the config says tied.
    if ckpt.has_linear("lm_head"):
        lm_head = linear("", ("lm_head",))
    else:
        lm_head = make_linear([LinearWeights(WeightScheme(), embed)], compute, device)
    positions = max_model_len or config.max_position_embeddings
    model = CausalLM(config, embed, layers, norm("model.norm.weight"), lm_head, positions)
    model.dtype_reason = choice.reason
    return model, kv_cache_spec(ckpt, config.num_layers)


def kv_cache_spec(ckpt: Checkpoint, num_layers: int) -> KVCacheSpec:
    """The KV-cache encoding: FP8 or INT8 codes with each layer's k/v scales."""
    if ckpt.kv_cache is None:
        return KVCacheSpec()
    scales = [ckpt.kv_scales(i) for i in range(num_layers)]
    return KVCacheSpec(ckpt.kv_cache, [k for k, _ in scales], [v for _, v in scales])
