"""What TensorRT-LLM 1.2 accepts, stated as data, and the checks kiln runs on what it writes.

TensorRT-LLM cannot be installed here, so nothing else tells kiln whether its loaders would
take a checkpoint, a build command or a serve config. Each rule below cites the TensorRT-LLM
(1.2.x) file and function it was read from; none of its code is used or copied. No library
states these rules, so this module is ours.

- Exclusions (`exclude_modules`): three matchers read the one list, each with fnmatchcase.
- Group-wise int4 (`W4A16_AWQ`, `W4A8_AWQ`): allowed group sizes and the padding of every
  group-wise linear's features.
- FP8 rowwise (`FP8_PER_CHANNEL_PER_TOKEN`): whole attention / MLP blocks and their norms are
  swapped, so exclusions name blocks, never single linears (`rowwise_*`).
- The parameters each layer class creates, per rank (`expected_parameters`), compared with
  what a checkpoint holds (`check_checkpoint`): TensorRT-LLM raises on a missing tensor or a
  shape mismatch and only warns on an extra one.
- Which checkpoint formats the PyTorch backend loads (`pytorch_problem`), and the LLM API
  arguments a trtllm-serve options file may hold (`check_serve_options`). What it reads from
  a ModelOpt HF checkpoint, tensor by tensor and per tp, is hf_rules.py.
The trtllm-build flags and their legal combinations are checked where the build is planned
(compiler/trtllm/build/plan.py `check_build_args`), from commands/build.py and plugin/plugin.py.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

# tensorrt_llm/quantization/quantize.py `quantize_layers`: `exclude_modules or [...]`, so a
# null or empty list means these, and any other list replaces them all.
DEFAULT_EXCLUDES = (
    "*lm_head",
    "*router",
    "*vocab_embedding",
    "*position_embedding",
    "*block_embedding",
    "*shared_expert_gate",
    "*fused_a",
)
# tensorrt_llm/models/convert_utils.py `weight_only_quantize_dict` (W8A16, W4A16 per
# channel): trtllm-build quantises a float checkpoint tensor whose name holds one of these,
# unless the tensor's own name (`<module>.weight`) matches an exclusion.
BUILD_QUANTISED_TENSORS = ("qkv.weight", "dense.weight", "fc.weight", "proj.weight", "gate.weight")
# tensorrt_llm/models/modeling_utils.py `QuantConfig` fields: `from_dict` is `cls(**config)`,
# so any other key in `quantization` is a TypeError at load.
QUANT_CONFIG_KEYS = frozenset(
    {
        "quant_algo",
        "kv_cache_quant_algo",
        "group_size",
        "smoothquant_val",
        "clamp_val",
        "use_meta_recipe",
        "has_zero_point",
        "pre_quant_scale",
        "exclude_modules",
    }
)
# tensorrt_llm/quantization/quantize.py `smooth_quantize_plugin` swaps whole attention, MLP
# and norm layers and never reads exclude_modules: a float linear cannot be expressed.
NO_EXCLUSIONS = frozenset(
    {
        "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
        "W8A8_SQ_PER_TENSOR_PLUGIN",
        "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
        "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
    }
)
# tensorrt_llm/quantization/layers.py `WeightOnlyGroupwiseQuantLinear.__init__` (and its
# Row variant) calls `validate_group_size`: the fine-grained int4 GEMMs take 64 and 128 only.
GROUPWISE = frozenset({"W4A16_AWQ", "W4A8_AWQ", "W4A16_GPTQ"})
INT4_GROUP_SIZES = (64, 128)
# trtllm-build quantises these itself from float weights (convert_utils above).
BUILD_QUANTISED = frozenset({"W8A16", "W4A16"})


def exclude_modules(excluded: list[str], algo: str, *, lm_head_quantised: bool) -> list[str]:
    """`quantization.exclude_modules` that keeps every module in `excluded` (TensorRT-LLM
    names) and a float lm_head in float, for every matcher that reads it under `algo`.

    Layer-swapping quantizers (quantize_layers above; `QuantConfig._get_quant_cfg`) match
    module names, and for FP8, group-wise and SmoothQuant layers a plain list of names is
    what ModelOpt's own TensorRT-LLM writer emits. W8A16/W4A16 checkpoints are different:
    weight_only_quantize maps the embedding too, so a written list must restate the default
    exclusions it replaces, and trtllm-build's weight_only_quantize_dict matches tensor
    names, so each module is also listed as `<name>.*`.
    """
    if algo == "NO_QUANT":
        return []
    if algo in BUILD_QUANTISED:
        return [*DEFAULT_EXCLUDES, *(p for name in excluded for p in (name, f"{name}.*"))]
    return (["lm_head"] if not lm_head_quantised else []) + excluded


def module_excluded(name: str, patterns: list[str] | None) -> bool:
    """Whether TensorRT-LLM keeps module `name` in float (quantize_layers)."""
    return any(fnmatch.fnmatchcase(name, p) for p in (patterns or DEFAULT_EXCLUDES))


def build_quantises(tensor: str, patterns: list[str] | None) -> bool:
    """Whether trtllm-build quantises float tensor `tensor` of a W8A16/W4A16 checkpoint
    (convert_utils.weight_only_quantize_dict: None means `*shared_expert_gate.weight`)."""
    rules = ["*shared_expert_gate.weight"] if patterns is None else patterns
    if any(fnmatch.fnmatchcase(tensor, p) for p in rules):
        return False
    return any(part in tensor for part in BUILD_QUANTISED_TENSORS)


def group_problem(algo: str, group_size: int | None) -> str | None:
    """Why TensorRT-LLM refuses `group_size` for `algo` (None: it takes it)."""
    if algo in GROUPWISE and group_size is not None and group_size not in INT4_GROUP_SIZES:
        return (
            f"group_size {group_size}: TensorRT-LLM's group-wise int4 kernels take group "
            f"{' or '.join(map(str, INT4_GROUP_SIZES))} only"
        )
    return None


def padded_features(features: int, group_size: int, tp: int, *, w4a8: bool = False) -> int:
    """`features` (whole, before the tp split) as a group-wise linear pads them: up to a
    multiple of max(64, group) × tp (max(128, group) × tp for W4A8 AWQ).

    tensorrt_llm/quantization/layers.py `WeightOnlyGroupwiseQuantLinear.__init__`; the
    parameters then hold the padded size (split by tp on the parallel dimension), and
    `PretrainedModel.load` (models/modeling_utils.py) takes only exact shapes.
    """
    multiple = max(128 if w4a8 else 64, group_size) * tp
    return math.ceil(features / multiple) * multiple


# ---- FP8 rowwise: whole blocks, not linears -------------------------------------------

ROWWISE = "FP8_PER_CHANNEL_PER_TOKEN"
# tensorrt_llm/quantization/quantize.py `fp8_rowwise_quantize`: swaps RmsNorm, Attention and
# GatedMLP modules (never a bare linear, so lm_head stays float), matching exclude_modules
# with fnmatchcase against those module names; a null list means none, and these three are
# always added.
ROWWISE_ALWAYS_EXCLUDED = ("*ln_f", "*ln_embed", "*lm_head")
# The norm whose Fp8RowwiseRmsNorm output (FP8 values + per-token scales) feeds each block
# (models/llama/model.py LLaMADecoderLayer): a block and its norm are swapped together or not
# at all, as quantize.py's own Meta recipe excludes `*input_layernorm` with `*attention`.
ROWWISE_BLOCKS = {"attention": "input_layernorm", "mlp": "post_layernorm"}


def rowwise_excluded(module: str, patterns: list[str] | None) -> bool:
    """Whether fp8_rowwise_quantize keeps block or norm `module` in float."""
    rules = [*(patterns or []), *ROWWISE_ALWAYS_EXCLUDED]
    return any(fnmatch.fnmatchcase(module, p) for p in rules)


def rowwise_exclude_modules(float_blocks: list[str]) -> list[str]:
    """`exclude_modules` keeping each block in `float_blocks` (`transformer.layers.N.mlp`,
    `...attention`) in float, with the norm that feeds it."""
    out = []
    for block in float_blocks:
        layer, _, kind = block.rpartition(".")
        out += [block, f"{layer}.{ROWWISE_BLOCKS[kind]}"]
    return out


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


# ---- the parameters each layer class creates, per rank ----------------------------------


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
    replicates KV heads when tp exceeds them.
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
            (f"{layer}.mlp.fc", inter, hidden, "column"),
            (f"{layer}.mlp.gate", inter, hidden, "column"),
            (f"{layer}.mlp.proj", hidden, inter, "row"),
        ]
    return out


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
    for i in range(int(config["num_hidden_layers"])):
        layer = f"transformer.layers.{i}"
        params[f"{layer}.input_layernorm.weight"] = Param((hidden,), (dtype,))
        params[f"{layer}.post_layernorm.weight"] = Param((hidden,), (dtype,))
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


# ---- which checkpoint formats the PyTorch backend loads --------------------------------

# tensorrt_llm/_torch/model_config.py `ModelConfig.from_pretrained`: a ModelOpt export
# (hf_quant_config.json) is read as its quant_algo; a compressed-tensors config is read only
# as config_groups "group_0" with 8-bit channel/token or block/group FP8 weights, and it
# reads input_activations["strategy"] before the bits, so weight-only groups (no input
# activations) fail and per-tensor FP8 is refused ("Unsupported weights_quant_strategy").
PYTORCH_LOADS = {
    "float": frozenset({"NO_QUANT"}),
    "modelopt": frozenset({"NO_QUANT", "FP8", "W4A16_AWQ", "W4A8_AWQ", "NVFP4"}),
    "compressed-tensors": frozenset({"FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES"}),
}


def pytorch_problem(fmt: str, algo: str) -> str | None:
    """Why TensorRT-LLM's PyTorch backend cannot load a `fmt` checkpoint of `algo`."""
    if algo in PYTORCH_LOADS.get(fmt, frozenset()):
        return None
    loads = ", ".join(sorted(PYTORCH_LOADS.get(fmt, frozenset()))) or "nothing"
    if fmt == "modelopt":  # the recipe already quantises with ModelOpt: another scheme, or engines
        fix = f"quantise to a scheme it reads ({loads}), or set deploy.trtllm_path: engine"
    else:
        fix = "quantise with backend: modelopt for its HF export (hf_quant_config.json)"
    return (
        f"TensorRT-LLM's PyTorch backend does not load {algo} from a {fmt} checkpoint "
        f"(_torch/model_config.py reads {loads} from it); {fix}"
    )


# ---- the trtllm-serve options YAML (LLM API arguments) ----------------------------------

# tensorrt_llm/llmapi/llm_args.py: the LLM API models forbid unknown fields, so each dict
# takes only its class's fields. These are the ones kiln writes (BaseLlmArgs / TorchLlmArgs,
# KvCacheConfig; NGramDecodingConfig and DraftTargetDecodingConfig via
# DecodingBaseConfig.from_dict, whose `speculative_model_dir` is an alias of
# `speculative_model`).
SERVE_KEYS = frozenset(
    {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "max_batch_size",
        "max_input_len",
        "max_seq_len",
        "max_num_tokens",
        "enable_chunked_prefill",
        "kv_cache_config",
        "speculative_config",
        "disable_overlap_scheduler",
    }
)
KV_CACHE_KEYS = frozenset(
    {"free_gpu_memory_fraction", "enable_block_reuse", "tokens_per_block", "dtype"}
)
KV_CACHE_DTYPES = frozenset({"auto", "fp8"})  # KvCacheConfig.dtype on the PyTorch backend
SPECULATIVE_KEYS = {
    "DraftTarget": frozenset({"decoding_type", "max_draft_len", "speculative_model_dir"}),
    "NGram": frozenset({"decoding_type", "max_draft_len", "max_matching_ngram_size"}),
}
# llm_args.py `supports_backend`: NGram and DraftTarget decoding run on the PyTorch backend
# only, so an engine built for externally drafted tokens cannot be driven by the LLM API.
SPECULATION_BACKENDS = {"DraftTarget": frozenset({"pytorch"}), "NGram": frozenset({"pytorch"})}


def check_serve_options(options: dict[str, Any]) -> list[str]:
    """Every rule a trtllm-serve options dict breaks; empty when the LLM API takes it."""
    problems = [f"{k}: not an LLM API argument" for k in sorted(set(options) - SERVE_KEYS)]
    kv = options.get("kv_cache_config") or {}
    problems += [
        f"kv_cache_config.{k}: not a KvCacheConfig field" for k in sorted(set(kv) - KV_CACHE_KEYS)
    ]
    if kv.get("dtype", "auto") not in KV_CACHE_DTYPES:
        problems.append(
            f"kv_cache_config.dtype {kv['dtype']!r}: the PyTorch backend takes auto or fp8"
        )
    spec = options.get("speculative_config")
    if spec is not None:
        kind = spec.get("decoding_type")
        if kind not in SPECULATIVE_KEYS:
            problems.append(f"speculative_config.decoding_type {kind!r}: use DraftTarget or NGram")
        else:
            extra = sorted(set(spec) - SPECULATIVE_KEYS[kind])
            problems += [f"speculative_config.{k}: not a {kind} field" for k in extra]
            if int(spec.get("max_draft_len") or 0) < 1:
                problems.append(f"speculative_config.max_draft_len must be > 0 for {kind}")
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
