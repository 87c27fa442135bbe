"""Which modules a TensorRT-LLM 1.2 checkpoint quantises: its `exclude_modules` list (three
matchers read it, each with fnmatchcase), the group sizes and feature padding of group-wise
int4, and FP8 rowwise, which swaps whole attention / MLP blocks and their norms, so its
exclusions name blocks, never single linears. Each rule cites the TensorRT-LLM (1.2.x) file
and function it was read from; none of its code is used or copied.
"""

from __future__ import annotations

import fnmatch
import math

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
# quantization/layers.py `validate_group_size`: "W4A8_AWQ with group_size = 64 is not
# implemented yet!". Read from the engine layers; kiln applies it to the PyTorch path too
# (ModelOpt, W4A8's one producer, quantises in groups of 128).
GROUP_SIZES = {"W4A8_AWQ": (128,)}


def group_sizes(algo: str) -> tuple[int, ...]:
    """The group sizes TensorRT-LLM's group-wise kernels take for `algo`."""
    return GROUP_SIZES.get(algo, INT4_GROUP_SIZES)


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
    # Since TensorRT-LLM PR #3567 the defaults apply only where exclude_modules is absent
    # (None); an empty list excludes nothing, so a quantised lm_head is expressible.
    rules = DEFAULT_EXCLUDES if patterns is None else patterns
    return any(fnmatch.fnmatchcase(name, p) for p in rules)


def build_quantises(tensor: str, patterns: list[str] | None) -> bool:
    """Whether trtllm-build quantises float tensor `tensor` of a W8A16/W4A16 checkpoint
    (convert_utils.weight_only_quantize_dict: None means `*shared_expert_gate.weight`)."""
    rules = ["*shared_expert_gate.weight"] if patterns is None else patterns
    if any(fnmatch.fnmatchcase(tensor, p) for p in rules):
        return False
    return any(part in tensor for part in BUILD_QUANTISED_TENSORS)


def group_problem(algo: str, group_size: int | None) -> str | None:
    """Why TensorRT-LLM refuses `group_size` for `algo` (None: it takes it)."""
    sizes = group_sizes(algo)
    if algo in GROUPWISE and group_size is not None and group_size not in sizes:
        return (
            f"group_size {group_size}: TensorRT-LLM's group-wise int4 kernels take group "
            f"{' or '.join(map(str, sizes))} only for {algo}"
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
