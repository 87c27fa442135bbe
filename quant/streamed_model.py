"""A transformers model whose weights stream from a checkpoint a module at a time: each module's
parameters are read when the forward reaches it and dropped when it returns, so running a model
holds one module's weights, never the model, and writes nothing to disk.

The float side reads the checkpoint's tensors as stored (in float32). The quantised side reads
them through kiln's checkpoint reader (runtime/formats/checkpoint: compressed-tensors or
ModelOpt), each quantised linear decoded from its codes as the deployed kernel computes with it,
and applies what the checkpoint records about activations and the KV cache with hooks: the
pre-quant scale, then the input's fake quantisation (static per tensor, or dynamic per token as
compressed-tensors computes it), and keys and values rounded after RoPE as the cache holds them.
Mixture-of-experts checkpoints store each expert's projections apart; transformers 5 holds a
layer's experts fused ([experts, 2 x width, hidden] gate then up, and [experts, hidden, width]),
so those parameters are stacked from the experts as they are read.

Hand-written: accelerate's and compressed-tensors' offloading read tensors as stored (or write
converted copies to disk), and neither decodes a checkpoint's codes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kiln.runtime.base.heap import GrowthTrim
from kiln.runtime.formats import nvfp4
from kiln.runtime.formats.checkpoint import Checkpoint, TensorFiles, open_checkpoint
from kiln.runtime.formats.model_info import ModelInfo
from kiln.runtime.formats.weights import ActivationScheme, LinearWeights, dequantize, fp8_as
from kiln.runtime.formats.weights import effective_weight as _effective

Provider = Callable[[str], torch.Tensor]  # a parameter's name in the model → its value
EXPERTS = re.compile(r"^(model\.layers\.(\d+))\.mlp\.experts\.(gate_up_proj|down_proj)$")
ROUTER = re.compile(r"^(model\.layers\.(\d+))\.mlp\.gate\.weight$")
F32 = torch.float32


def _moe_names(name: str, info: ModelInfo) -> tuple[str, str, list[list[str]]] | None:
    """For a fused expert parameter: (kind, layer prefix, each expert's checkpoint weights)."""
    moe, found = info.moe, EXPERTS.match(name)
    if moe is None or found is None:
        return None
    prefix, kind = found.group(1), found.group(3)
    base = f"{prefix}.{moe.block}.experts"
    parts = (moe.gate, moe.up) if kind == "gate_up_proj" else (moe.down,)
    names = [[f"{base}.{e}.{p}.weight" for p in parts] for e in range(info.num_experts)]
    return kind, prefix, names


def checkpoint_provider(
    present: Callable[[str], bool], read: Provider, info: ModelInfo, tied: bool
) -> Provider:
    """The value of each model parameter from a checkpoint's tensors (`read`, by name), where
    the model names them otherwise: a tied lm_head, a MoE layer's fused experts and router."""

    def get(name: str) -> torch.Tensor:
        if present(name):
            return read(name)
        if name == "lm_head.weight" and tied:
            return read("model.embed_tokens.weight")
        fused = _moe_names(name, info)
        if fused is not None:
            return torch.stack([torch.cat([read(n) for n in names]) for names in fused[2]])
        router = ROUTER.match(name)
        if router is not None and info.moe is not None:
            return read(f"{router.group(1)}.{info.moe.block}.{info.moe.router}.weight")
        return read(name)  # names what is missing

    return get


def float_provider(model_dir: Path, info: ModelInfo, tied: bool) -> Provider:
    """A float checkpoint's parameters, as stored."""
    files = TensorFiles(Path(model_dir))
    return checkpoint_provider(files.__contains__, files.get, info, tied)


# Hears each quantised linear's effective float32 weight as the forward decodes it, a block of
# rows at a time: (the linear's name, the block's first row, the block).
WeightSeen = Callable[[str, int, torch.Tensor], None]
# float32 rows decoded at once: a block stays near a core while it is decoded, converted and
# compared, where a whole weight in float32 went through memory three times, and is large
# enough that the ~15 operations a block costs in Python stay small beside its work. Decoding
# and comparing nine of a 1.17B model's weights on two Xeon cores: 2.5-2.6 ns a weight with
# 512 KiB blocks, 1.7 with 2 MiB, 2.3 with 4 MiB, 2.7 with 8 MiB.
ROW_BLOCK_BYTES = 1 << 21
TRIM_LAYERS = 2  # a streamed model's growth, in layers, at which it hands freed memory back


def decoded(
    linear: LinearWeights, dtype: torch.dtype, name: str = "", seen: WeightSeen | None = None
) -> torch.Tensor:
    """`linear`'s weight decoded as its kernel computes with it (in float32, then held in
    `dtype`; the same values as decoding it whole), a block of rows at a time, the blocks on
    every core; `seen(name, first row, rows)` hears each block's effective float32 rows (× the
    pre-quant scale), from those threads, in no fixed order."""
    rows, cols = linear.out_features, linear.in_features
    out = torch.empty((rows, cols), dtype=dtype, device=linear.weight.device)
    step = max(1, ROW_BLOCK_BYTES // (4 * max(cols, 1)))
    pqs = linear.pre_quant_scale
    pqs = None if pqs is None else pqs.to(F32)[None, :]

    def one(start: int) -> None:
        block = dequantize(linear.rows(slice(start, start + step)), F32)
        out[start : start + len(block)] = block
        if seen is not None:
            seen(name, start, block if pqs is None else block * pqs)

    starts = range(0, rows, step)
    if len(starts) == 1 or out.device.type != "cpu":
        for start in starts:
            one(start)
    else:  # each block is element-wise work on one core: the blocks go to every core
        for _ in _blocks_pool().map(one, starts):
            pass
    return out


_POOL: list[ThreadPoolExecutor] = []
os.register_at_fork(after_in_child=_POOL.clear)  # a forked child has none of the threads


def _blocks_pool() -> ThreadPoolExecutor:
    """The threads `decoded` spreads blocks over: one per core torch computes on (the table
    lookup, scaling and comparing release the GIL)."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(torch.get_num_threads(), "kiln-decode"))
    return _POOL[0]


def quantised_provider(
    ckpt: Checkpoint,
    info: ModelInfo,
    tied: bool,
    seen: WeightSeen | None = None,
    dtype: torch.dtype = F32,
) -> Provider:
    """A quantised checkpoint's parameters: each quantised linear's weight decoded as its
    kernel computes with it and held in `dtype` (its pre-quant scale is applied to the input by
    a hook), the rest as stored; `seen` hears each decoded linear's effective weight."""

    def read(name: str) -> torch.Tensor:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and ckpt.is_quantised(module):
            return decoded(ckpt.served_linear(module), dtype, module, seen)
        return ckpt.tensor(name)

    def present(name: str) -> bool:
        module, _, leaf = name.rpartition(".")
        return name in ckpt or (leaf == "weight" and ckpt.is_quantised(module))

    return checkpoint_provider(present, read, info, tied)


def _materialised(
    module: torch.nn.Module, prefix: str, provider: Provider, device: Any, ahead: _ReadAhead
) -> None:
    for name, param in list(module._parameters.items()):
        if param is not None:
            value = ahead.take(f"{prefix}{name}")
            if value is None:
                value = provider(f"{prefix}{name}").to(device=device, dtype=param.dtype)
            module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)


_AHEAD: list[ThreadPoolExecutor] = []
os.register_at_fork(after_in_child=_AHEAD.clear)


class _ReadAhead:
    """The next decoder layer's parameters, read and decoded on a thread of their own while
    the current layer computes: reading and decoding (numpy's table lookups, safetensors'
    reads) and the layer's compute (torch's threads) each leave the cores idle at times when
    run one after the other, and run beside each other they fill those times. One layer is
    read ahead, so a streamed model holds at most two layers' weights."""

    def __init__(self, provider: Provider, device: Any) -> None:
        self.provider, self.device = provider, device
        self.pending: dict[str, Future[torch.Tensor]] = {}

    def start(self, params: list[tuple[str, torch.dtype]]) -> None:
        """Begin reading `params` (name, dtype) in order, those not already on their way."""
        if not _AHEAD:
            _AHEAD.append(ThreadPoolExecutor(1, "kiln-ahead"))
        for name, dtype in params:
            if name not in self.pending:
                self.pending[name] = _AHEAD[0].submit(self._read, name, dtype)

    def _read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.provider(name).to(device=self.device, dtype=dtype)

    def take(self, name: str) -> torch.Tensor | None:
        """`name`'s value if it was read ahead (waiting for it; its error raised here), else
        None."""
        future = self.pending.pop(name, None)
        return None if future is None else future.result()


def _released(module: torch.nn.Module) -> None:
    for name, param in list(module._parameters.items()):
        if param is not None:
            meta = torch.empty_like(param, device="meta")
            module._parameters[name] = torch.nn.Parameter(meta, requires_grad=False)


def streamed_model(
    config: dict[str, Any], provider: Provider, device: Any = "cpu", dtype: Any = F32
) -> Any:
    """The transformers model of `config` computing in `dtype`, with every parameter on the
    meta device, read from `provider` when its module runs and released after (buffers, such
    as RoPE's frequencies, are real)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    hf_config = AutoConfig.for_model(**config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    ahead = _ReadAhead(provider, device)
    for module_name, module in model.named_modules():
        for buffer_name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[buffer_name] = buffer.to(device)
        if not any(p is not None for p in module._parameters.values()):
            continue
        prefix = f"{module_name}." if module_name else ""

        def onload(m: torch.nn.Module, args: Any, prefix: str = prefix) -> None:
            _materialised(m, prefix, provider, device, ahead)

        def release(m: torch.nn.Module, args: Any, output: Any) -> None:
            _released(m)

        module.register_forward_pre_hook(onload)
        module.register_forward_hook(release)
    layers = getattr(getattr(model, "model", None), "layers", None)
    layers = list(layers) if isinstance(layers, torch.nn.ModuleList) else []
    # A finished layer's freed tensors go back to the system once the process has grown by two
    # layers' parameters since it last handed memory back (bounded by a layer, as the depth
    # guard in tests/compiler/test_compile_memory.py holds it).
    largest = max((sum(p.numel() * p.element_size() for p in x.parameters()) for x in layers),
                  default=0)  # fmt: skip
    trim = GrowthTrim(TRIM_LAYERS * largest)
    for layer in layers:
        layer.register_forward_hook(trim)
    # Each layer, as it starts, sends the next one's parameters to be read ahead (the last
    # layer: those of the modules after the layers, the final norm and lm_head); the model, as
    # it starts, those before the layers (the embedding) and the first layer's.
    where = {id(layer): i for i, layer in enumerate(layers)}
    groups: list[list[tuple[str, torch.dtype]]] = [[] for _ in range(len(layers) + 2)]
    group, inside = 0, None  # group 0: before the layers, 1 + i: layer i, then after them
    for module_name, module in model.named_modules():
        if id(module) in where:
            group, inside = 1 + where[id(module)], f"{module_name}."
        elif inside is not None and not module_name.startswith(inside):
            group, inside = len(layers) + 1, None
        prefix = f"{module_name}." if module_name else ""
        groups[group] += [
            (prefix + n, p.dtype) for n, p in module._parameters.items() if p is not None
        ]
    if layers:
        first = groups[0] + groups[1]
        model.register_forward_pre_hook(lambda m, args: ahead.start(first))
        for i, layer in enumerate(layers):

            def read_next(m: torch.nn.Module, args: Any, params: Any = groups[i + 2]) -> None:
                ahead.start(params)

            layer.register_forward_pre_hook(read_next)
    return model.eval()


# -- what the checkpoint records about activations and the KV cache -----------------------


def fake_quant_fp8(x: Any, scale: Any) -> Any:
    """Round x to float8_e4m3fn with a per-tensor scale and back (the temporaries changed in
    place: the report runs this on every quantised linear's input)."""
    scaled = x / scale
    scaled.clamp_(-448.0, 448.0)
    # Into float8 through float32: the same codes (every bfloat16 and float16 value is exact
    # in float32, tested), and torch converts float32 to float8 in half the time it takes from
    # a 16-bit float on a CPU (0.57 against 1.12 ns a value on two Xeon cores).
    return fp8_as(scaled.float().to(torch.float8_e4m3fn), x.dtype).mul_(scale)


def fake_quant_int8(x: Any, scale: Any) -> Any:
    """Round x to int8 with a per-tensor scale and back."""
    return (x / scale).round().clamp(-128, 127) * scale


def _dynamic(acts: ActivationScheme) -> Callable[[Any], Any]:
    """Per-token fake quantisation as compressed-tensors computes it (its own functions)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=acts.num_bits, type=acts.type, strategy=acts.strategy,
                            symmetric=acts.symmetric, dynamic=True)  # fmt: skip

    def quantise(x: Any) -> Any:
        scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=None)
        return fake_quantize(x=x, scale=scale, zero_point=zero, args=args)

    return quantise


def input_quantiser(linear: LinearWeights) -> Callable[[Any], Any] | None:
    """What the deployed layer does to its input before the GEMM, or None for nothing."""
    acts, pqs, scale = linear.scheme.activations, linear.pre_quant_scale, linear.input_scale
    static: Callable[[Any, Any], Any] = fake_quant_fp8
    if acts is not None and acts.type == "int":
        static = fake_quant_int8
    elif acts is not None and acts.num_bits == 4:
        static = nvfp4.fake_quantize
    dynamic = _dynamic(acts) if acts is not None and acts.dynamic and scale is None else None
    if pqs is None and scale is None and dynamic is None:
        return None

    def quantise(x: Any) -> Any:
        if pqs is not None:
            x = x * pqs.to(x.device, x.dtype)
        if scale is not None:
            x = static(x, scale.to(x.device))
        elif dynamic is not None:
            x = dynamic(x)
        return x

    return quantise


def rounding_key(linear: LinearWeights) -> tuple[Any, ...] | None:
    """What decides how `linear` rounds its input, where that is small enough to compare (no
    pre-quant scale, a scale of one value or none): linears that read one tensor and have equal
    keys round it to the same values."""
    acts, pqs, scale = linear.scheme.activations, linear.pre_quant_scale, linear.input_scale
    if pqs is not None or (scale is not None and scale.numel() != 1):
        return None
    return (acts, None if scale is None else (scale.dtype, float(scale)))


class SharedInputs:
    """The input the last quantised linear rounded, how, and the result: q, k and v (gate and
    up) read one tensor, and calibration saw one tensor, so their checkpoint rounds it alike
    (equal static scales, or one dynamic scheme): it is rounded once, not three times (the
    fake quantisation was a fifth of the report's forward). Reset after each forward."""

    def __init__(self) -> None:
        self.last: tuple[Any, int, tuple[Any, ...], Any] | None = None

    def hook(self, quantise: Callable[[Any], Any], key: tuple[Any, ...] | None) -> Any:
        """A forward pre-hook rounding a linear's input with `quantise` (rounded alike by every
        linear with the same `key`; None: never shared)."""

        def hook(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x, last = args[0], self.last
            if key is None or x.is_inference():  # an inference tensor keeps no version counter
                return (quantise(x), *args[1:])
            if last is not None and last[0] is x and last[1:3] == (x._version, key):
                return (last[3], *args[1:])
            out = quantise(x)
            self.last = (x, x._version, key, out)
            return (out, *args[1:])

        return hook

    def forget(self, *_: Any) -> None:
        self.last = None


KV_ATTENTION = "kiln_quantised_kv"


def quantised_kv_attention(
    model: Any, scales: dict[str, Any], fake_quant: Callable[[Any, Any], Any]
) -> None:
    """Route attention through SDPA with keys and values rounded as the KV cache holds them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        k_scale, v_scale = getattr(module, "kiln_kv_scales", (None, None))
        if k_scale is not None:
            key = fake_quant(key, k_scale.to(key.device))
        if v_scale is not None:
            value = fake_quant(value, v_scale.to(value.device))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(KV_ATTENTION, attention)
    for name, module in model.named_modules():
        if f"{name}.k_scale" in scales or f"{name}.v_scale" in scales:
            module.kiln_kv_scales = (scales.get(f"{name}.k_scale"), scales.get(f"{name}.v_scale"))
    model.set_attn_implementation(KV_ATTENTION)


def quantised_linears(model: Any, ckpt: Checkpoint) -> list[str]:
    """The model's linears the checkpoint stores quantised, in the model's order (a MoE's
    experts, fused into 3-D parameters by transformers, are not linears of the model)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ckpt.is_quantised(name)
    ]


class EffectiveWeights(Mapping[str, torch.Tensor]):
    """{linear: its effective float32 weight (dequantised × pre-quant scale)}, decoded when
    asked for: a whole model's would not fit where the report runs."""

    def __init__(self, ckpt: Checkpoint, names: list[str]) -> None:
        self.ckpt, self.names = ckpt, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return _effective(self.ckpt.served_linear(name), F32)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def float_model(model_dir: Path, device: Any = "cpu", dtype: Any = F32) -> Any:
    """A float checkpoint as a streamed model computing in `dtype`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    info = ModelInfo.from_hf_config(config)
    tied = bool(config.get("tie_word_embeddings", False))
    return streamed_model(config, float_provider(Path(model_dir), info, tied), device, dtype)


def quantised_model(
    model_dir: Path, device: Any = "cpu", dtype: Any = F32, seen: WeightSeen | None = None
) -> tuple[Any, EffectiveWeights]:
    """A quantised checkpoint (compressed-tensors or ModelOpt) as a streamed model that computes
    as it ships, in `dtype` (its weights decoded in float32 first), and its quantised linears'
    effective weights; `seen` hears each as the forward decodes it, a block of rows at a
    time."""
    ckpt = open_checkpoint(Path(model_dir))
    info = ModelInfo.from_hf_config(ckpt.config)
    tied = bool(ckpt.config.get("tie_word_embeddings", False))
    provider = quantised_provider(ckpt, info, tied, seen, dtype)
    model = streamed_model(ckpt.config, provider, device, dtype)
    names = quantised_linears(model, ckpt)
    shared = SharedInputs()
    for name in names:
        linear = _scales_only(ckpt, name)
        quantise = input_quantiser(linear)
        if quantise is not None:
            hook = shared.hook(quantise, rounding_key(linear))
            model.get_submodule(name).register_forward_pre_hook(hook)
    model.register_forward_hook(shared.forget)
    if ckpt.kv_cache is not None:
        scales: dict[str, Any] = {}
        for layer in range(info.num_layers):
            k, v = ckpt.kv_scales(layer)
            scales[f"model.layers.{layer}.self_attn.k_scale"] = k.to(F32)
            scales[f"model.layers.{layer}.self_attn.v_scale"] = v.to(F32)
        fake = fake_quant_int8 if ckpt.kv_cache == "int8" else fake_quant_fp8
        quantised_kv_attention(model, scales, fake)
    return model, EffectiveWeights(ckpt, names)


def _scales_only(ckpt: Checkpoint, name: str) -> LinearWeights:
    """A quantised linear's activation scheme and scales, with its weight dropped (a hook keeps
    these for the model's life; the weight is read when the layer runs)."""
    linear = ckpt.served_linear(name)
    empty = torch.empty(0)
    return LinearWeights(linear.scheme, empty, input_scale=linear.input_scale,
                         pre_quant_scale=linear.pre_quant_scale)  # fmt: skip
