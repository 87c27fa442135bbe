"""What a TensorRT-LLM 1.2 unified checkpoint must hold, stated as data, and the check kiln
runs on what it writes: the parameters each layer class creates, per rank
(`expected_parameters`), compared with what a checkpoint holds (`check_checkpoint`):
TensorRT-LLM raises on a missing tensor or a shape mismatch and only warns on an extra one.
Also which source schemes kiln's export carries (`CHECKPOINT_ALGO`, `NOT_EXPORTED`).

TensorRT-LLM cannot be installed here, so nothing else tells kiln whether its loaders would
take a checkpoint. Each rule cites the TensorRT-LLM (1.2.x) file and function it was read
from; none of its code is used or copied. No library states these rules, so this module is
ours. Exclusions and group-wise rules are exclusions.py; the PyTorch backend's are
pytorch.py; the trtllm-serve options' serve_options.py; the trtllm-build flags are checked
where the build is planned (compiler/trtllm/build/plan.py `check_build_args`).
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from kiln.compiler.trtllm.rules.exclusions import (
    BUILD_QUANTISED,
    GROUPWISE,
    NO_EXCLUSIONS,
    QUANT_CONFIG_KEYS,
    ROWWISE,
    ROWWISE_BLOCKS,
    build_quantises,
    group_problem,
    module_excluded,
    padded_features,
    rowwise_excluded,
)


@dataclass(frozen=True, slots=True)
class Param:
    """One tensor TensorRT-LLM's model creates: its shape on one rank and its dtype(s)."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # safetensors dtype names, e.g. ("I8",), ("BF16", "F16", "F32")


FLOATS = ("BF16", "F16", "F32")


def _linear_params(
    prefix: str,
    algo: str | None,
    quant: dict[str, Any],
    out_f: int,
    in_f: int,
    role: str,
    tp: int,
    dtype: str,
) -> dict[str, Param]:
    """The tensors one linear (whole size out_f × in_f; `role` column or row) needs on a rank,
    as the checkpoint stores them (before TensorRT-LLM's own preprocess_weights)."""
    model = (dtype,)
    if algo in GROUPWISE:
        # quantization/layers.py WeightOnlyGroupwiseQuantLinear: padded features, split by
        # tp on the parallel side; models/modeling_utils.py preprocess_perlayer_weights
        # transposes the packed (out/2, in) int8 weight and the (out, in/group) scales.
        group = int(quant.get("group_size", 128))
        w4a8 = algo == "W4A8_AWQ"
        out_p, in_p = (padded_features(n, group, tp, w4a8=w4a8) for n in (out_f, in_f))
        out_r, in_r = (out_p // tp, in_p) if role == "column" else (out_p, in_p // tp)
        params = {
            f"{prefix}.weight": Param((out_r // 2, in_r), ("I8",)),
            f"{prefix}.weights_scaling_factor": Param((out_r, in_r // group), FLOATS),
        }
        if quant.get("pre_quant_scale"):
            params[f"{prefix}.prequant_scaling_factor"] = Param((in_r,), FLOATS)
        if quant.get("has_zero_point"):
            params[f"{prefix}.zero"] = Param((in_r // group, out_r), FLOATS)
        if w4a8:  # preprocess_perlayer_weights turns these into the layer's alpha
            params[f"{prefix}.weights_scaling_factor_2"] = Param((1,), ("F32",))
            params[f"{prefix}.activation_scaling_factor"] = Param((1,), ("F32",))
        return params
    out_r, in_r = (out_f // tp, in_f) if role == "column" else (out_f, in_f // tp)
    if algo is None or algo in BUILD_QUANTISED:
        return {f"{prefix}.weight": Param((out_r, in_r), model)}
    if algo == "FP8":  # quantization/layers.py FP8Linear / FP8RowLinear
        return {
            f"{prefix}.weight": Param((out_r, in_r), ("F8_E4M3",)),
            f"{prefix}.weights_scaling_factor": Param((1,), ("F32",)),
            f"{prefix}.activation_scaling_factor": Param((1,), ("F32",)),
        }
    if algo == "NVFP4":
        # quantization/layers.py FP4Linear / FP4RowLinear (fp4 weight, FP8 scale per block of
        # 16 inputs, float32 global scales), as models/modeling_utils.py
        # preprocess_perlayer_weights reads them from the checkpoint: packed two codes a byte.
        return {
            f"{prefix}.weight": Param((out_r, in_r // 2), ("U8",)),
            f"{prefix}.weights_scaling_factor": Param((out_r, in_r // 16), ("F8_E4M3",)),
            f"{prefix}.weights_scaling_factor_2": Param((), ("F32",)),
            f"{prefix}.activation_scaling_factor": Param((), ("F32",)),
        }
    if algo == ROWWISE:  # quantization/layers.py Fp8RowwiseLinear / Fp8RowwiseRowLinear
        return {
            f"{prefix}.weight": Param((out_r, in_r), ("F8_E4M3",)),
            f"{prefix}.per_channel_scale": Param((out_r,), ("F32",)),
        }
    if algo == "W8A8_SQ_PER_CHANNEL":  # quantization/layers.py Int8SmoothQuantLinear
        return {
            f"{prefix}.weight": Param((out_r, in_r), ("I8",)),
            f"{prefix}.weights_scaling_factor": Param((out_r,), ("F32",)),
            f"{prefix}.activation_scaling_factor": Param((1,), ("F32",)),
            f"{prefix}.prequant_scaling_factor": Param((in_r,), model),
        }
    # W8A8 plugin: quantization/layers.py SmoothQuantColumnLinear / SmoothQuantRowLinear
    # (per-channel scale (1, out); the row linear's smoother (1, in)).
    params = {
        f"{prefix}.weight": Param((out_r, in_r), ("I8",)),
        f"{prefix}.per_channel_scale": Param((1, out_r), ("F32",)),
    }
    if role == "row":
        params[f"{prefix}.smoother"] = Param((1, in_r), ("F32",))
    return params


def _linears(config: dict[str, Any]) -> list[tuple[str, int, int, str]]:
    """(module, whole out features, whole in features, tp role) of every linear.

    models/llama/model.py (LLaMAModel / LLaMADecoderLayer): attention.qkv and dense, mlp.fc,
    gate and proj, lm_head padded to a multiple of tp; layers/attention.py `Attention`
    replicates KV heads when tp exceeds them. models/phi3/model.py: one fc of 2 × width rows
    (up and gate) and no mlp.gate. A mixture-of-experts layer's GEMMs are the MoE module's
    own (`_expert_params`), not linears.
    """
    tp = int(config["mapping"]["tp_size"])
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head = int(config.get("head_size") or hidden // heads)
    qkv_out = heads * head + 2 * max(kv_heads, tp) * head
    out = [("lm_head", math.ceil(int(config["vocab_size"]) / tp) * tp, hidden, "column")]
    for i in range(int(config["num_hidden_layers"])):
        layer = f"transformer.layers.{i}"
        out += [
            (f"{layer}.attention.qkv", qkv_out, hidden, "column"),
            (f"{layer}.attention.dense", hidden, heads * head, "row"),
        ]
        if _moe(config):
            continue
        if config.get("architecture") == "Phi3ForCausalLM":
            out.append((f"{layer}.mlp.fc", 2 * inter, hidden, "column"))
        else:
            out += [
                (f"{layer}.mlp.fc", inter, hidden, "column"),
                (f"{layer}.mlp.gate", inter, hidden, "column"),
            ]
        out.append((f"{layer}.mlp.proj", hidden, inter, "row"))
    return out


def _moe(config: dict[str, Any]) -> int:
    """Experts a layer of this checkpoint has (0: dense)."""
    return int((config.get("moe") or {}).get("num_experts") or 0)


def _expert_params(
    config: dict[str, Any], layer: str, algo: str | None, dtype: str
) -> dict[str, Param]:
    """One rank's MoE tensors of a sparse layer (layers/moe.py MixtureOfExperts, MOEWeightWrapper
    and quantization/layers.py's FP8 MoE scales): the float32 router (`RowLinear(...,
    dtype="float32", tp_size=1, strict_dtype=True)`), fc (experts, 2 × width / moe_tp, hidden)
    and proj (experts, hidden, width / moe_tp); FP8: one weight scale per expert, one
    activation scale. The experts are split by moe_tp_size = tp (kiln writes moe_ep_size 1)."""
    experts, hidden = _moe(config), int(config["hidden_size"])
    width = int(config["intermediate_size"]) // int(config["mapping"]["tp_size"])
    prefix = f"{layer}.mlp"
    params = {f"{prefix}.router.weight": Param((experts, hidden), ("F32",))}
    for name, shape in (("fc", (experts, 2 * width, hidden)), ("proj", (experts, hidden, width))):
        if algo == "FP8":
            params[f"{prefix}.{name}.weight"] = Param(shape, ("F8_E4M3",))
            params[f"{prefix}.{name}.weights_scaling_factor"] = Param((experts, 1), ("F32",))
            params[f"{prefix}.{name}.activation_scaling_factor"] = Param((1,), ("F32",))
        else:  # float, or float weights trtllm-build quantises (weight_only_quantize_dict)
            params[f"{prefix}.{name}.weight"] = Param(shape, (dtype,))
    return params


def layer_algo(module: str, algo: str | None, patterns: list[str] | None) -> str | None:
    """The quant algo TensorRT-LLM gives linear `module` (None: it stays float)."""
    if algo in NO_EXCLUSIONS:  # smooth_quantize_plugin: every block linear, never lm_head
        return None if module == "lm_head" else algo
    if algo == ROWWISE:
        return None if rowwise_excluded(module.rpartition(".")[0] or module, patterns) else algo
    return None if module_excluded(module, patterns) else algo


def expected_parameters(config: dict[str, Any]) -> dict[str, Param]:
    """Every tensor one rank of a Llama-family checkpoint must hold, from its config.json:
    the layer classes quantization/quantize.py `quantize` swaps in (honouring
    exclude_modules), with the shapes quantization/layers.py gives their parameters."""
    quant = config.get("quantization") or {}
    algo, patterns = quant.get("quant_algo"), quant.get("exclude_modules")
    tp = int(config["mapping"]["tp_size"])
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    dtype = {"bfloat16": "BF16", "float16": "F16"}.get(config["dtype"], "F32")
    params = {
        "transformer.vocab_embedding.weight": Param((vocab, hidden), (dtype,)),
        "transformer.ln_f.weight": Param((hidden,), (dtype,)),
    }
    for module, out_f, in_f, role in _linears(config):
        which = layer_algo(module, algo, patterns)
        linear = _linear_params(module, which, quant, out_f, in_f, role, tp, dtype)
        params.update(linear)
        if config.get("attn_bias") and module.endswith("attention.qkv"):
            # models/qwen/model.py: Attention(bias=attn_bias); a bias has the rank's
            # (padded, for group-wise layers) output features.
            rows = linear[f"{module}.weight"].shape[0] * (2 if which in GROUPWISE else 1)
            params[f"{module}.bias"] = Param((rows,), (dtype,))
    gemma = config.get("architecture") == "Gemma3ForCausalLM"
    for i in range(int(config["num_hidden_layers"])):
        layer = f"transformer.layers.{i}"
        params[f"{layer}.input_layernorm.weight"] = Param((hidden,), (dtype,))
        params[f"{layer}.post_layernorm.weight"] = Param((hidden,), (dtype,))
        if _moe(config):
            moe_algo = None if module_excluded(f"{layer}.mlp", patterns) else algo
            params.update(_expert_params(config, layer, moe_algo, dtype))
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm") if gemma else ():
            # models/gemma/model.py GemmaDecoderLayer: inter_layernorms (Gemma 2 and 3)
            params[f"{layer}.{norm}.weight"] = Param((hidden,), (dtype,))
        if config.get("qwen_type") in ("qwen3", "qwen3_moe") or gemma:
            # models/qwen/model.py and models/gemma/model.py: qk_layernorm, RmsNorm per head
            head = int(config["head_size"])
            for norm in ("q_layernorm", "k_layernorm"):
                params[f"{layer}.attention.{norm}.weight"] = Param((head,), (dtype,))
        if algo in NO_EXCLUSIONS:  # quantization/layers.py SmoothQuantRmsNorm
            params[f"{layer}.input_layernorm.scale_to_int"] = Param((1,), FLOATS)
            params[f"{layer}.post_layernorm.scale_to_int"] = Param((1,), FLOATS)
        if quant.get("kv_cache_quant_algo"):  # quantization/quantize.py kv_cache_quantize
            params[f"{layer}.attention.kv_cache_scaling_factor"] = Param((1,), ("F32",))
    return params


def check_config(config: dict[str, Any]) -> list[str]:
    """Rules config.json breaks, before any tensor is read."""
    problems = []
    quant = config.get("quantization") or {}
    unknown = sorted(set(quant) - QUANT_CONFIG_KEYS)
    if unknown:
        problems.append(
            f"quantization keys {unknown}: QuantConfig.from_dict takes only "
            f"{sorted(QUANT_CONFIG_KEYS)}"
        )
    algo, patterns = quant.get("quant_algo"), quant.get("exclude_modules")
    why = group_problem(algo or "", quant.get("group_size"))
    if why:
        problems.append(why)
    if algo == "W4A8_AWQ" and not quant.get("pre_quant_scale"):
        # models/modeling_utils.py preprocess_perlayer_weights divides every W4A8 linear's
        # prequant_scaling_factor by its activation scale: without one it cannot load.
        problems.append("W4A8_AWQ needs pre_quant_scale: true (a prequant_scaling_factor on "
                        "every quantised linear)")  # fmt: skip
    excluded = [p for p in patterns or [] if p.startswith("transformer.layers.")]
    if algo in NO_EXCLUSIONS and excluded:
        problems.append(
            f"{algo} quantises whole attention and MLP blocks and ignores exclude_modules "
            f"({excluded[0]} would be quantised anyway)"
        )
    if algo == ROWWISE:
        problems += rowwise_problems(config)
    if algo == "NVFP4":  # quantization/layers.py FP4Linear asserts it per rank
        tp = int(config["mapping"]["tp_size"])
        for module, _, in_f, role in _linears(config):
            per_rank = in_f // tp if role == "row" else in_f
            if per_rank % 16 and layer_algo(module, algo, patterns) is not None:
                problems.append(
                    f"{module}: {per_rank} input features per rank; FP4 GEMMs take a multiple of 16"
                )
    if algo in BUILD_QUANTISED:
        # quantization/quantize.py weight_only_quantize maps Embedding too: an embedding
        # not excluded needs scales a float checkpoint does not carry.
        if not module_excluded("transformer.vocab_embedding", patterns):
            problems.append(
                "exclude_modules does not exclude transformer.vocab_embedding: it becomes a "
                "weight-only quantised embedding whose scales the checkpoint lacks"
            )
        for module, *_ in _linears(config):
            layer_float = layer_algo(module, algo, patterns) is None
            if layer_float == build_quantises(f"{module}.weight", patterns):
                problems.append(
                    f"{module}: trtllm-build would {'quantise' if layer_float else 'keep'} "
                    f"its float weight while the layer is {'float' if layer_float else 'quantised'}"
                )
    return problems


def _merge_kv_scales(found: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """models/modeling_utils.py `preprocess_weights` merges separate k and v cache scales
    into `kv_cache_scaling_factor` (their max) before loading: count such a pair as one."""
    for name in [n for n in found if n.endswith(".k_cache_scaling_factor")]:
        v_name = name.replace(".k_cache_", ".v_cache_")
        if v_name in found:
            found[name.replace(".k_cache_", ".kv_cache_")] = found.pop(name)
            del found[v_name]


def check_checkpoint(ckpt_dir: Path) -> list[str]:
    """Every rule the TensorRT-LLM checkpoint in `ckpt_dir` breaks; empty when
    `trtllm-build` 1.2 would load it (models/modeling_utils.py `PretrainedModel.load` raises
    on missing tensors and on a shape mismatch; extra tensors only warn, but kiln writes
    none)."""
    ckpt_dir = Path(ckpt_dir)
    config = json.loads((ckpt_dir / "config.json").read_text())
    problems = check_config(config)
    want = expected_parameters(config)
    for rank in range(int(config["mapping"]["world_size"])):
        path = ckpt_dir / f"rank{rank}.safetensors"
        if not path.is_file():
            problems.append(f"{path.name} is missing")
            continue
        with safe_open(str(path), "pt") as f:
            have = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118
            found = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in have.items()}
        _merge_kv_scales(found)
        for name in sorted(set(want) - set(found)):
            problems.append(f"rank{rank}: {name} is required but not provided")
        for name in sorted(set(found) - set(want)):
            problems.append(f"rank{rank}: {name} is provided but not required")
        for name in sorted(set(want) & set(found)):
            shape, dtype = found[name]
            rule = want[name]
            if shape != rule.shape or dtype not in rule.dtypes:
                problems.append(
                    f"rank{rank}: {name} is {dtype}{list(shape)}; TensorRT-LLM creates "
                    f"{'/'.join(rule.dtypes)}{list(rule.shape)}"
                )
    return problems


# Source algo → the algo the checkpoint declares.
CHECKPOINT_ALGO = {
    "NO_QUANT": "NO_QUANT",
    "FP8": "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN": "FP8_PER_CHANNEL_PER_TOKEN",
    "W4A16_AWQ": "W4A16_AWQ",
    "W4A16_GPTQ": "W4A16_AWQ",
    "W4A8_AWQ": "W4A8_AWQ",
    "NVFP4": "NVFP4",
    "W8A16": "W8A16",
    "W4A16": "W4A16",
    "W8A8_SQ_PER_CHANNEL": "W8A8_SQ_PER_CHANNEL",
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
}


NOT_EXPORTED = {
    "W8A16_GPTQ": "its TensorRT-LLM layout is pre-interleaved for one GPU; use group_size: "
    "null (W8A16)",
}


def rowwise_problems(config: dict[str, Any]) -> list[str]:
    """Exclusions an FP8 rowwise checkpoint's config gets wrong."""
    patterns = (config.get("quantization") or {}).get("exclude_modules")
    problems = []
    for i in range(int(config["num_hidden_layers"])):
        layer = f"transformer.layers.{i}"
        for kind, norm in ROWWISE_BLOCKS.items():
            block, feeder = f"{layer}.{kind}", f"{layer}.{norm}"
            if rowwise_excluded(block, patterns) != rowwise_excluded(feeder, patterns):
                problems.append(
                    f"{feeder} and {block}: FP8 rowwise swaps a norm and the block it feeds "
                    "together; exclude both or neither"
                )
    for module, *_ in _linears(config):
        block = module.rpartition(".")[0]
        named = [p for p in patterns or [] if fnmatch.fnmatchcase(module, p)]
        if block and named and not rowwise_excluded(block, patterns):
            problems.append(
                f"exclude_modules {named[0]!r} names the linear {module}: FP8 rowwise swaps "
                f"whole blocks, so it is quantised with {block}"
            )
    return problems
