"""A quantised Hugging Face checkpoint as the TensorRT-LLM export sees it.

The checkpoint is read by the runtime's reader (`kiln.runtime.formats.checkpoint`:
compressed-tensors, ModelOpt HF export or float) into `LinearWeights`, in the quantiser's own
convention so that nothing is lost before export: y = (x * pre_quant_scale) @ ((code - zero) *
scale)^T. What this module adds is what only the export needs: the TensorRT-LLM QuantAlgo of the
checkpoint, the model's shapes, refusing what TensorRT-LLM's layouts cannot hold, and reading
one decoder layer at a time (`Source.layer`): what the whole export must know first (which
linears are quantised, zero points, pre-quant scales) is read off the config and the tensor
names, so no stage of the export holds more than a layer of the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.trtllm.rules.engine import engine_problem
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.checkpoint import Checkpoint, open_checkpoint
from kiln.runtime.formats.checkpoint.compressed_tensors import CompressedTensors
from kiln.runtime.formats.model_info import ModelInfo
from kiln.runtime.formats.weights import LinearWeights, WeightScheme, effective_weight

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QK_NORMS = ("q_norm", "k_norm")  # Qwen3's and Gemma 3's per-head norms, float in every export
# Gemma 3's norms before and after the MLP (its sandwich norms), besides Llama's two.
GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
KV_CACHE_ALGO = {"fp8": "FP8", "int8": "INT8"}
# Phi-3's fused projections → the projections they hold, in row order.
FUSED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass
class Layer:
    """One decoder layer as the export reads it: linears under Llama's HF names (Phi-3's fused
    projections split by rows; experts under their own names), norms as stored, a sparse
    layer's router as float32, the KV cache's dequantising scale (the larger of k's and v's)
    and, for NVFP4, each quantised linear's per-tensor weight scale (`weight_scale_2`), which
    the reader folds into the block scales and the TensorRT-LLM layout keeps apart."""

    index: int
    linears: dict[str, LinearWeights] = field(default_factory=dict)
    norms: dict[str, torch.Tensor] = field(default_factory=dict)
    router: torch.Tensor | None = None
    kv_scale: torch.Tensor | None = None
    weight_globals: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Source:
    """A quantised checkpoint, opened: its shapes, scheme and what is quantised, known without
    reading a weight; each decoder layer is read when asked for (`layer`) and held by the
    caller only, so the export holds one layer at a time, never the model."""

    ckpt: Checkpoint
    info: ModelInfo
    quant_algo: str
    kv_cache_quant_algo: str | None
    symmetric: bool  # no quantised linear has zero points
    pre_quant_scales: bool  # some quantised linear keeps a separate pre-quant scale
    recorded_algo: str  # what the checkpoint itself records or implies
    # Phi-3: each split-off projection → the fused HF module it is stored in.
    fused_in: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> dict[str, Any]:
        return self.ckpt.config

    @property
    def fmt(self) -> str:  # compressed-tensors | modelopt | float
        return self.ckpt.format

    @property
    def linears(self) -> Mapping[str, LinearWeights]:
        """Every linear by HF name, read from disk on each lookup (nothing is kept)."""
        return _Linears(self)

    def quantised(self, name: str) -> bool:
        """Is the linear `name` (an HF module, Phi-3's split names included) stored quantised?"""
        return self.ckpt.is_quantised(self.fused_in.get(name, name))

    def sparse(self, layer: int) -> bool:
        return self.info.is_sparse(layer)

    def tensor(self, name: str) -> torch.Tensor:
        return self.ckpt.tensor(name)

    def lm_head(self) -> tuple[LinearWeights, torch.Tensor | None]:
        """lm_head (the embedding where the checkpoint ties it: SmolLM2, Qwen2-0.5B stores
        none) and its NVFP4 per-tensor weight scale."""
        if not self.ckpt.has_linear("lm_head"):
            return LinearWeights(WeightScheme(), self.tensor("model.embed_tokens.weight")), None
        lin = self.ckpt.linear("lm_head")
        return lin, self._weight_global("lm_head", lin)

    def layer(self, index: int) -> Layer:
        """Decoder layer `index`, read from disk."""
        info, prefix, moe = self.info, f"model.layers.{index}", self.info.moe
        out = Layer(index)
        for name, (rows, _) in info.layer_linears(index).items():
            full = f"{prefix}.{name}"
            lin = self.ckpt.linear(full)
            if lin.g_idx is not None:
                raise UsageError(
                    f"{full}: GPTQ activation reordering (g_idx) has no TensorRT-LLM layout"
                )
            if moe is not None and name == f"{moe.block}.{moe.router}":
                out.router = effective_weight(lin, torch.float32)
            elif name == "self_attn.qkv_proj":
                q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
                parts = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
                _split(out, lin, {f"{prefix}.self_attn.{p}": at for p, at in parts.items()})
            elif name == "mlp.gate_up_proj":
                half = rows // 2
                parts = {"gate_proj": (0, half), "up_proj": (half, half)}
                _split(out, lin, {f"{prefix}.mlp.{p}": at for p, at in parts.items()})
            else:
                out.linears[full] = lin
        for name, lin in out.linears.items():
            found = self._weight_global(name, lin)
            if found is not None:
                out.weight_globals[name] = found
            if lin.pre_quant_scale is not None and not self.pre_quant_scales:
                raise AssertionError(f"{name}: a pre-quant scale read_source did not see")
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += [f"self_attn.{n}" for n in QK_NORMS] if info.qk_norm else []
        norms += list(GEMMA_NORMS) if info.gemma else []
        out.norms = {f"{prefix}.{n}.weight": self.tensor(f"{prefix}.{n}.weight") for n in norms}
        if self.ckpt.kv_cache is not None:
            k, v = (s.to(torch.float32).reshape(()) for s in self.ckpt.kv_scales(index))
            out.kv_scale = torch.maximum(k, v)
        return out

    def experts(self, layer: Layer) -> list[tuple[LinearWeights, LinearWeights, LinearWeights]]:
        """(gate, up, down) of each expert of sparse layer `layer`, in expert order."""
        moe = self.info.moe
        assert moe is not None
        base = f"model.layers.{layer.index}.{moe.block}.experts"
        get = layer.linears.__getitem__
        return [
            (get(f"{base}.{e}.{moe.gate}"), get(f"{base}.{e}.{moe.up}"),
             get(f"{base}.{e}.{moe.down}"))
            for e in range(self.info.num_experts)
        ]  # fmt: skip

    def expert_names(self, layer: int) -> list[str]:
        """HF names of every expert projection of sparse layer `layer`."""
        moe = self.info.moe
        assert moe is not None
        base = f"model.layers.{layer}.{moe.block}.experts"
        return [f"{base}.{e}.{p}" for e in range(self.info.num_experts)
                for p in (moe.gate, moe.up, moe.down)]  # fmt: skip

    def _weight_global(self, name: str, lin: LinearWeights) -> torch.Tensor | None:
        if self.recorded_algo != "NVFP4" or lin.scale is None:
            return None
        stored = self.fused_in.get(name, name)
        return self.tensor(f"{stored}.weight_scale_2").to(torch.float32).reshape(())


class _Linears(Mapping[str, LinearWeights]):
    """`Source.linears`: each lookup reads that linear (its whole layer) from disk."""

    def __init__(self, src: Source) -> None:
        self._src = src

    def __getitem__(self, name: str) -> LinearWeights:
        if name == "lm_head":
            return self._src.lm_head()[0]
        parts = name.split(".")
        if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            raise KeyError(name)
        return self._src.layer(int(parts[2])).linears[name]

    def __iter__(self) -> Iterator[str]:
        for i in range(self._src.info.num_layers):
            yield from _layer_names(self._src.info, i)
        yield "lm_head"

    def __len__(self) -> int:
        return sum(1 for _ in self)


def trtllm_algo(scheme: WeightScheme, actorder: bool) -> str:
    """The TensorRT-LLM QuantAlgo of a compressed-tensors weight scheme."""
    a = scheme.activations
    if scheme.type == "float":
        return "FP8" if scheme.strategy == "tensor" else "FP8_PER_CHANNEL_PER_TOKEN"
    if a is not None and a.type == "int":
        return "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN" if a.dynamic else "W8A8_SQ_PER_CHANNEL"
    if a is not None and a.type == "float":
        return "W4A8_AWQ"
    grouped = scheme.strategy == "group"
    if scheme.num_bits == 8:
        return "W8A16_GPTQ" if grouped else "W8A16"
    if not grouped:
        return "W4A16"
    return "W4A16_GPTQ" if actorder else "W4A16_AWQ"  # GPTQ records its act order


def _recorded_algo(ckpt: Checkpoint) -> str:
    """The QuantAlgo the checkpoint records (ModelOpt) or implies (compressed-tensors)."""
    quant = ckpt.quant
    if isinstance(quant, CompressedTensors):
        if len(quant.groups) != 1:
            raise UsageError(
                "compressed-tensors checkpoints with several config_groups (mixed "
                "precision) have no single TensorRT-LLM quant_algo"
            )
        group = quant.groups[0]
        return trtllm_algo(group.weights, group.actorder)
    return quant.quant_algo or "NO_QUANT"


def layer_signatures(ckpt: Checkpoint, info: ModelInfo) -> list[tuple[Any, ...]]:
    """What each decoder layer's export is a function of, known without reading a weight: its
    stored tensors (names within the layer, dtypes, shapes, off the files' headers), its
    linears' shapes and quantisation scheme (the config group that quantises each, or none),
    and whether it is sparse. Layers with equal signatures export to the same tensors under
    their own index."""
    by_layer: list[list[tuple[str, tuple[str, tuple[int, ...]]]]] = [
        [] for _ in range(info.num_layers)
    ]
    for name, spec in ckpt.files.stored().items():
        parts = name.split(".", 3)
        if parts[:2] == ["model", "layers"] and parts[2].isdigit() and len(parts) == 4:
            index = int(parts[2])
            if index < len(by_layer):
                by_layer[index].append((parts[3], spec))
    scheme_for = getattr(ckpt.quant, "scheme_for", lambda _: None)
    out = []
    for index, stored in enumerate(by_layer):
        linears = tuple(
            (name, shape, repr(scheme_for(f"model.layers.{index}.{name}")))
            for name, shape in info.layer_linears(index).items()
        )
        out.append((tuple(sorted(stored)), linears, info.is_sparse(index)))
    return out


def read_source(model_dir: Path, quant_algo: str | None = None) -> Source:
    """Open `model_dir` (compressed-tensors, ModelOpt HF export or float) for the export; reads
    no weight.

    `quant_algo` is the TensorRT-LLM algorithm the quantiser recorded (the manifest's
    `trtllm_quant_algo`); without it the algorithm is read off the checkpoint (W4A16 GPTQ
    and AWQ differ there only by GPTQ's recorded `actorder`).
    """
    ckpt = open_checkpoint(Path(model_dir))
    info = ModelInfo.from_hf_config(ckpt.config)
    recorded = _recorded_algo(ckpt)
    if (why := engine_problem(info, quant_algo or recorded)) is not None:
        raise UsageError(f"{model_dir}: {why.problem}")
    fused_in: dict[str, str] = {}
    for i in range(info.num_layers):
        prefix = f"model.layers.{i}"
        for fused, parts in FUSED.items():
            if fused in info.layer_linears(i):
                block = fused.partition(".")[0]
                fused_in |= {f"{prefix}.{block}.{p}": f"{prefix}.{fused}" for p in parts}
    quantised = [
        name
        for i in range(info.num_layers)
        for name in (f"model.layers.{i}.{n}" for n in info.layer_linears(i))
        if ckpt.is_quantised(name)
    ] + (["lm_head"] if ckpt.is_quantised("lm_head") else [])
    quant = ckpt.quant
    # Zero points come only from a compressed-tensors group stored asymmetric (one group:
    # _recorded_algo refuses more); ModelOpt's and float linears are symmetric.
    asymmetric = isinstance(quant, CompressedTensors) and not quant.groups[0].weights.symmetric
    # ModelOpt keeps AWQ's smoothing as `<linear>.pre_quant_scale` where it did not fold it
    # into the norm (runtime/formats/checkpoint/modelopt.py); compressed-tensors always folds.
    pre_quant = ckpt.format == "modelopt" and any(
        f"{name}.pre_quant_scale" in ckpt for name in quantised
    )
    return Source(
        ckpt,
        info,
        quant_algo or recorded,
        KV_CACHE_ALGO.get(ckpt.kv_cache or ""),
        symmetric=not (asymmetric and quantised),
        pre_quant_scales=pre_quant,
        recorded_algo=recorded,
        fused_in=fused_in,
    )


def _layer_names(info: ModelInfo, layer: int) -> list[str]:
    """HF names of decoder layer `layer`'s linears as `Layer.linears` holds them (Phi-3's
    fused projections split; no router)."""
    prefix, moe = f"model.layers.{layer}", info.moe
    names = []
    for name in info.layer_linears(layer):
        if name in FUSED:
            names += [f"{prefix}.{name.partition('.')[0]}.{p}" for p in FUSED[name]]
        elif moe is None or name != f"{moe.block}.{moe.router}":
            names.append(f"{prefix}.{name}")
    return names


def _split(layer: Layer, lin: LinearWeights, parts: dict[str, tuple[int, int]]) -> None:
    """The rows (start, count) of a fused linear as linears of their own."""
    for name, (start, count) in parts.items():
        layer.linears[name] = lin.rows(torch.arange(start, start + count))
