"""What TensorRT-LLM's PyTorch backend loads from a ModelOpt HF checkpoint, as data.

The PyTorch backend (`trtllm-serve --backend pytorch`) reads a quantised Hugging Face
directory whose `hf_quant_config.json` names a ModelOpt quant_algo; it shards the tensors
itself at load time, so one directory serves every tensor-parallel size, but not every size
loads. Each rule cites the TensorRT-LLM file and function it was read from (NVIDIA/
TensorRT-LLM; ModelOpt's modelopt/torch/export/ for what its own writer emits); none of their
code is used or copied. `check_hf_checkpoint(dir, tp)` lists every rule a directory breaks
for every family kiln writes (PYTORCH_ARCHITECTURES); the engine path's rules are in
checkpoint.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from kiln.compiler.trtllm.rules.checkpoint import FLOATS, Param
from kiln.runtime.formats.model_info import ModelInfo

QUANT_CONFIG_FILE = "hf_quant_config.json"
# _torch/model_config.py `ModelConfig.load_modelopt_quant_config` /
# `_build_modelopt_quant_config`: the `quantization` keys it reads from hf_quant_config.json.
HF_QUANT_KEYS = frozenset(
    {
        "quant_algo",
        "kv_cache_quant_algo",
        "group_size",
        "has_zero_point",
        "pre_quant_scale",
        "exclude_modules",
    }
)
# The algos kiln writes in this format (the PyTorch backend reads more: see
# PYTORCH_LOADS["modelopt"]).
HF_ALGOS = frozenset({"FP8", "W4A16_AWQ"})
HF_KV_ALGOS = frozenset({"FP8"})
# _torch/models/checkpoints/hf/weight_mapper.py `HfWeightMapper.map_weights`: q/k/v load
# into one fused qkv_proj and gate/up into gate_up_proj; o_proj and down_proj load alone
# ("vanilla"). Column-parallel linears split output rows, row-parallel ones input columns
# (_torch/modules/linear.py `TensorParallelMode.split_dim`). Phi-3 stores qkv_proj and
# gate_up_proj fused already (modeling_phi3.py `load_weights` splits them by rows); a MoE
# expert's down projection (Mixtral's w2, Qwen3-MoE's down_proj) is row-parallel too.
FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj", "w2")


@dataclass(frozen=True, slots=True)
class HfLinear:
    """One projection: full HF module name, whole (out, in) features and its tp role; a
    MoE router (kept float: the PyTorch backend builds it unquantised) or one expert's."""

    name: str
    out_features: int
    in_features: int
    router: bool = False
    expert: bool = False

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def row_parallel(self) -> bool:
        return self.short in ROW_PARALLEL


def hf_linears(config: dict[str, Any]) -> list[HfLinear]:
    """Every decoder projection of a config.json kiln exports, by HF module name (a MoE
    layer's router and each expert's projections included)."""
    info = ModelInfo.from_hf_config(config)
    moe = info.moe
    router = f"{moe.block}.{moe.router}" if moe else None
    return [
        HfLinear(f"model.layers.{i}.{name}", n, k, name == router, ".experts." in name)
        for i in range(info.num_layers)
        for name, (n, k) in info.layer_linears(i).items()
    ]


def linear_params(lin: HfLinear, algo: str | None, quant: dict[str, Any]) -> dict[str, Param]:
    """The tensors the PyTorch backend reads for `lin` under `algo` (None: float), whole
    (it shards them itself), as ModelOpt's HF writer stores them."""
    n, k = lin.out_features, lin.in_features
    if algo is None:  # _torch/modules/linear.py UnquantizedLinearMethod
        return {f"{lin.name}.weight": Param((n, k), FLOATS)}
    if algo == "FP8":
        # linear.py FP8QDQLinearMethod: float8_e4m3fn weight (out, in); `load_weight_scales`
        # reads weight_scale and input_scale with reshape([]) (one value each; q/k/v and
        # gate/up keep their own and are rescaled to the largest in `rescale_fused_weights`).
        # ModelOpt writes them as 0-d float32 (quant_utils.py / unified_export_hf.py).
        return {
            f"{lin.name}.weight": Param((n, k), ("F8_E4M3",)),
            f"{lin.name}.weight_scale": Param((), ("F32",)),
            f"{lin.name}.input_scale": Param((), ("F32",)),
        }
    # W4A16_AWQ, linear.py W4A16_AWQ_LinearMethod: the checkpoint weight is (out/2, in)
    # bytes, two output rows per byte (ModelOpt quant_utils.py `pack_int4_in_uint8`: row 2r
    # in the low nibble), which load_weights_* transpose and hand to
    # preprocess_weights_for_mixed_gemm as quint4x2; weight_scale (out, in/group) is
    # transposed on load. load_weights_vanilla (o_proj, down_proj) reads pre_quant_scale
    # unconditionally; the fused loaders read none (ModelOpt folds it into the norms).
    group = int(quant["group_size"])
    params = {
        f"{lin.name}.weight": Param((n // 2, k), ("U8", "I8")),
        f"{lin.name}.weight_scale": Param((n, k // group), FLOATS),
    }
    if lin.row_parallel:
        params[f"{lin.name}.pre_quant_scale"] = Param((k,), FLOATS)
    return params


def tp_problems(
    config: dict[str, Any], algo: str | None, quant: dict[str, Any], tp: int
) -> list[str]:
    """Why the PyTorch backend cannot load the checkpoint at tensor parallel `tp`."""
    problems = []
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    if heads % tp:
        problems.append(f"tp={tp}: {heads} attention heads do not split evenly")
    # weight_mapper.py `HfWeightMapper._duplicate_kv`: KV heads split evenly, or are
    # repeated when tp is a multiple of them.
    if kv_heads % tp and tp % kv_heads:
        problems.append(f"tp={tp}: {kv_heads} KV heads neither split nor repeat evenly")
    info = ModelInfo.from_hf_config(config)
    if info.moe is not None and info.moe_intermediate_size % tp:
        # fused_moe/interface.py `MoE.__init__`: intermediate_size // tp per rank, while
        # load_weight_shard cuts ceil(width / tp) rows: they agree only when tp divides it.
        problems.append(
            f"tp={tp}: each expert's {info.moe_intermediate_size} intermediate rows do not "
            "split evenly"
        )
    if algo != "W4A16_AWQ":
        return problems
    group = int(quant["group_size"])
    if tp > kv_heads:
        # `_duplicate_kv_weights` repeats only weight and bias (and NVFP4's weight_scale):
        # the packed int4 rows would be repeated and their group scales not.
        problems.append(
            f"tp={tp} exceeds the {kv_heads} KV heads: the PyTorch backend repeats a W4A16 "
            "AWQ k/v weight but not its weight_scale"
        )
    excluded = set(quant.get("exclude_modules") or [])
    for lin in (x for x in hf_linears(config) if x.name not in excluded and not x.router):
        if lin.row_parallel and (lin.in_features % tp or (lin.in_features // tp) % group):
            # linear.py W4A16_AWQ_LinearMethod.create_weights: "in_features must be
            # divisible by group_size" on each rank's slice.
            problems.append(
                f"tp={tp}: {lin.name} has {lin.in_features} input features, "
                f"{lin.in_features / tp:g} per rank, not a multiple of group {group}"
            )
        if not lin.row_parallel and lin.out_features % (2 * tp):
            # linear.py `load_weight_shard` splits the packed (out/2, in) rows by
            # ceil(rows / tp): each rank needs whole byte rows of its own outputs.
            problems.append(
                f"tp={tp}: {lin.name}'s {lin.out_features} output rows do not split into "
                "whole int4 byte pairs per rank"
            )
    return sorted(set(problems), key=problems.index)


def expected_hf_tensors(config: dict[str, Any], quant: dict[str, Any]) -> dict[str, Param]:
    """Every tensor a ModelOpt HF checkpoint of this config must hold for the PyTorch backend."""
    info = ModelInfo.from_hf_config(config)
    algo = quant.get("quant_algo")
    excluded = set(quant.get("exclude_modules") or [])
    hidden, vocab = info.hidden_size, info.vocab_size
    params = {
        "model.embed_tokens.weight": Param((vocab, hidden), FLOATS),
        "model.norm.weight": Param((hidden,), FLOATS),
    }
    # weight_mapper.py `should_skip_module`: a tied lm_head is not loaded.
    if not info.tie_word_embeddings:
        params["lm_head.weight"] = Param((vocab, hidden), FLOATS)
    for lin in hf_linears(config):
        float_ = lin.name in excluded or lin.router
        params.update(linear_params(lin, None if float_ else algo, quant))
        if info.qkv_bias and lin.short in ("q_proj", "k_proj", "v_proj"):
            params[f"{lin.name}.bias"] = Param((lin.out_features,), FLOATS)
    # Norms load under their HF names: Gemma 3's four per layer (gemma3_weight_mapper.py adds
    # the 1 of its (1 + weight) convention to every norm on load, so they are stored as HF
    # stores them); q_norm/k_norm over head_dim (_torch/modules/qk_norm_attention.py
    # QKNormRoPEAttention) for Qwen3, Qwen3-MoE and Gemma 3.
    norms = ["input_layernorm", "post_attention_layernorm"]
    if info.gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(info.num_layers):
        for norm in norms:
            params[f"model.layers.{i}.{norm}.weight"] = Param((hidden,), FLOATS)
        for norm in ("q_norm", "k_norm") if info.qk_norm else ():
            params[f"model.layers.{i}.self_attn.{norm}.weight"] = Param((info.head_dim,), FLOATS)
        if quant.get("kv_cache_quant_algo"):
            # ModelOpt quant_utils.py `_KV_CACHE_REPLACEMENTS`: k_bmm/v_bmm amax / maxbound
            # become `k_proj.k_scale` and `v_proj.v_scale`; linear.py
            # FP8QDQLinearMethod.load_kv_scales reads them from the q/k/v weights.
            prefix = f"model.layers.{i}.self_attn"
            params[f"{prefix}.k_proj.k_scale"] = Param((), ("F32",))
            params[f"{prefix}.v_proj.v_scale"] = Param((), ("F32",))
    return params


def fused_groups(config: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The linears that load as one module with one quant method, (what, HF names): q/k/v
    and gate/up where stored apart (weight_mapper.py `map_weights`), and all experts of a MoE
    layer (one fused MoE module per layer, _torch/modules/fused_moe)."""
    groups: dict[tuple[int, str], list[str]] = {}
    for lin in hf_linears(config):
        layer = int(lin.name.split(".")[2])
        if lin.expert:
            groups.setdefault((layer, "the layer's experts"), []).append(lin.name)
        elif lin.short in FUSED[:3]:
            groups.setdefault((layer, ", ".join(FUSED[:3])), []).append(lin.name)
        elif lin.short in FUSED[3:]:
            groups.setdefault((layer, ", ".join(FUSED[3:])), []).append(lin.name)
    return [(what, names) for (_, what), names in groups.items()]


def float_expert_blocks(config: dict[str, Any], excluded: set[str]) -> list[str]:
    """The `...experts` module of each MoE layer whose experts are all in `excluded`: the
    PyTorch backend matches exclude_modules against its module names (fnmatch,
    QuantConfig.is_module_excluded_from_quantization), and a layer's experts are one fused
    module there, so per-expert names match nothing."""
    return [
        names[0].split(".experts.")[0] + ".experts"
        for what, names in fused_groups(config)
        if what == "the layer's experts" and all(n in excluded for n in names)
    ]


def fused_problems(config: dict[str, Any], quant: dict[str, Any]) -> list[str]:
    """A fused group part float, part quantised: kiln refuses it rather than rely on how
    exclude_modules names would be matched against the fused module."""
    excluded = set(quant.get("exclude_modules") or [])
    problems = []
    for what, names in fused_groups(config):
        floats = [n for n in names if n in excluded]
        if floats and len(floats) != len(names):
            more = f" and {len(floats) - 3} more" if len(floats) > 3 else ""
            shown = ", ".join(floats[:3]) + more
            problems.append(f"{shown} excluded but not the rest of its fused group ({what})")
    problems += [
        f"every expert of {block.removesuffix('.experts')} is float but exclude_modules does "
        f"not name {block}, the module the PyTorch backend matches"
        for block in float_expert_blocks(config, excluded)
        if block not in excluded
    ]
    return problems


def check_quant_config(quant: dict[str, Any]) -> list[str]:
    """Rules the `quantization` section of hf_quant_config.json breaks."""
    problems = [
        f"hf_quant_config.json: {k} is not read by _build_modelopt_quant_config"
        for k in sorted(set(quant) - HF_QUANT_KEYS)
    ]
    algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if algo not in HF_ALGOS:
        problems.append(f"quant_algo {algo!r}: kiln writes {', '.join(sorted(HF_ALGOS))}")
    if kv_algo is not None and kv_algo not in HF_KV_ALGOS:
        problems.append(f"kv_cache_quant_algo {kv_algo!r}: the PyTorch backend's KV cache is fp8")
    if algo == "W4A16_AWQ":
        if quant.get("has_zero_point"):
            # linear.py W4A16_AWQ_LinearMethod.apply calls finegrained_mixed_dtype_gemm
            # with zeros=None: zero points are never read.
            problems.append("has_zero_point: the W4A16 AWQ GEMM reads no zero points")
        if not quant.get("group_size"):
            problems.append("W4A16_AWQ needs group_size (W4A16_AWQ_LinearMethod.create_weights)")
    return problems


def check_hf_checkpoint(model_dir: Path, tp: int) -> list[str]:
    """Every rule the ModelOpt HF checkpoint in `model_dir` breaks for TensorRT-LLM's PyTorch
    backend at tensor parallel `tp`; empty when it would load. A tensor it needs and cannot
    find is a KeyError at load; one of the wrong shape fails `copy_weight`; kiln writes no
    tensor the loader does not read."""
    model_dir = Path(model_dir)
    path = model_dir / QUANT_CONFIG_FILE
    if not path.is_file():
        return [f"{QUANT_CONFIG_FILE} is missing: the PyTorch backend would read it as float"]
    quant = json.loads(path.read_text()).get("quantization") or {}
    config = json.loads((model_dir / "config.json").read_text())
    problems = check_quant_config(quant)
    if problems:
        return problems
    problems += fused_problems(config, quant)
    problems += tp_problems(config, quant.get("quant_algo"), quant, tp)
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                s = f.get_slice(name)
                found[name] = (tuple(s.get_shape()), s.get_dtype())
    want = expected_hf_tensors(config, quant)
    problems += [f"{n} is required but not provided" for n in sorted(set(want) - set(found))]
    problems += [f"{n} is provided but never read" for n in sorted(set(found) - set(want))]
    for name in sorted(set(want) & set(found)):
        (shape, dtype), rule = found[name], want[name]
        if shape != rule.shape or dtype not in rule.dtypes:
            problems.append(
                f"{name} is {dtype}{list(shape)}; the PyTorch backend reads "
                f"{'/'.join(rule.dtypes)}{list(rule.shape)}"
            )
    return problems


# compressed-tensors' TensorRT-LLM algo → the ModelOpt quant_algo that carries it exactly.
CONVERTS = {"FP8": "FP8", "W4A16_AWQ": "W4A16_AWQ", "W4A16_GPTQ": "W4A16_AWQ"}


KV_CACHE_ALGOS = ("FP8",)


def conversion_problem(
    algo: str, kv_algo: str | None, *, symmetric: bool, group_size: int | None
) -> str | None:
    """Why a compressed-tensors checkpoint of this scheme has no exact ModelOpt HF form (None:
    it has one), judged from the recipe alone."""
    if algo not in CONVERTS:
        return (
            f"{algo} from compressed-tensors has no exact ModelOpt HF form (kiln converts "
            f"{', '.join(sorted(CONVERTS))}); quantise with backend: modelopt"
        )
    if kv_algo is not None and kv_algo not in KV_CACHE_ALGOS:
        return f"a {kv_algo} KV cache: the PyTorch backend's quantised KV cache is FP8"
    if CONVERTS[algo] == "W4A16_AWQ":
        if not symmetric:
            return (
                "asymmetric int4 groups: TensorRT-LLM's W4A16 AWQ layer reads no zero points "
                "(its GEMM runs with zeros=None); set quantization.symmetric: true"
            )
        if group_size is None:
            return "per-channel int4 has no ModelOpt HF form; set a group_size of 64 or 128"
    return None


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


# The families kiln writes for the PyTorch backend, each with the _torch/models/ class that
# loads it (registered under its HF architecture name).
PYTORCH_ARCHITECTURES = {
    "LlamaForCausalLM": "modeling_llama.py LlamaForCausalLM",
    "MistralForCausalLM": "modeling_mistral.py MistralForCausalLM",
    "Qwen2ForCausalLM": "modeling_qwen.py Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "modeling_qwen3.py Qwen3ForCausalLM",
    "Phi3ForCausalLM": "modeling_phi3.py Phi3ForCausalLM",
    "Gemma3ForCausalLM": "modeling_gemma3.py Gemma3ForCausalLM",
    "MixtralForCausalLM": "modeling_mixtral.py MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "modeling_qwen3_moe.py Qwen3MoeForCausalLM",
}


# What the fused MoE loads from the checkpoints kiln writes (the CUTLASS backend's methods in
# _torch/modules/fused_moe/quantization.py): bf16, FP8 per tensor, ModelOpt's NVFP4 and
# W4A8 AWQ; no W4A16 AWQ (int4 weight-only) experts.
MOE_ALGOS = frozenset({"NO_QUANT", "FP8", "NVFP4", "W4A8_AWQ"})


def family_problem(info: ModelInfo, algo: str, kv_algo: str | None) -> str | None:
    """Why the PyTorch backend cannot serve this model, as kiln writes it, with TensorRT-LLM
    quant algo `algo` (the one it loads: after kiln's ModelOpt HF conversion) and KV cache
    `kv_algo`; None where it can. Judged from config.json and the recipe, before calibration."""
    arch = info.architecture
    if arch not in PYTORCH_ARCHITECTURES:
        return f"{arch}: kiln writes {', '.join(PYTORCH_ARCHITECTURES)} for the PyTorch backend"
    where = PYTORCH_ARCHITECTURES[arch]
    if arch == "Qwen3MoeForCausalLM":
        # modeling_qwen3_moe.py builds every decoder layer sparse and renormalises the top-k
        # routing weights: it reads neither norm_topk_prob nor mlp_only_layers /
        # decoder_sparse_step, so such a checkpoint would load and route differently.
        if not info.norm_topk_prob:
            return (f"{arch} with norm_topk_prob false: {where} always renormalises the top-k "
                    "routing weights, so it would route this model differently")  # fmt: skip
        if info.dense_layers:
            dense = ", ".join(map(str, info.dense_layers))
            return (f"{arch} with dense layers ({dense}, from mlp_only_layers / decoder_"
                    f"sparse_step): {where} builds every layer as mixture of experts")  # fmt: skip
    if arch == "Phi3ForCausalLM":
        # modeling_phi3.py `Phi3ForCausalLM.load_weights` (@bd6f83f8) splits the stored
        # qkv_proj / gate_up_proj by row counts of the float weight (q: hidden_size rows,
        # head_dim = hidden_size // heads), hands each part the whole weight_scale unless its
        # rows equal the weight's, and passes only weight, weight_scale, input_scale and
        # weight_scale_2 on: packed int4 rows (out/2) and their (out, in/group) scales would be
        # cut wrong, and k_scale / v_scale never reach the attention.
        if algo in ("W4A16_AWQ", "W4A8_AWQ"):
            return (f"{algo} on {arch}: {where} splits the fused qkv_proj and gate_up_proj "
                    "by float rows, cutting packed int4 rows and group scales wrong")  # fmt: skip
        if kv_algo is not None:
            return (f"a {kv_algo} KV cache on {arch}: {where} passes the fused qkv_proj no "
                    "k_scale / v_scale")  # fmt: skip
        if info.head_dim * info.num_heads != info.hidden_size:
            return (f"{arch} with head_dim {info.head_dim} x {info.num_heads} heads != "
                    f"hidden size {info.hidden_size}: {where} splits qkv_proj at hidden_size "
                    "rows")  # fmt: skip
    if info.moe is not None and algo not in MOE_ALGOS:
        return (f"{algo} on {arch}'s experts: the PyTorch backend's fused MoE "
                f"(_torch/modules/fused_moe) loads {', '.join(sorted(MOE_ALGOS))} from kiln's "
                "checkpoints")  # fmt: skip
    return None
