"""What a model is, read once from its Hugging Face config.json and never from its weights.

One record serves the runtime's forward pass (runtime/engine/model.py) and the compiler's checks,
planner and quantisers; GGUF metadata is mapped to the same config fields
(compiler/sources/metadata.py), so a GGUF yields the same record as its checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.formats.config_ranges import (
    ConfigValueError,
    attention_problems,
    moe_problems,
    rope_problems,
    rotary_problems,
    size_problems,
)

# The families the runtime's forward pass runs, by Hugging Face model_type (which is also
# llama.cpp's architecture name for these) → the transformers class a config names. kiln
# compiles exactly what its runtime runs: the gate evaluates an artifact through it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Families whose checkpoints store q/k/v as one `self_attn.qkv_proj` and gate/up as one
# `mlp.gate_up_proj` (Phi-3, Phi-4), in that order along the output rows.
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)
# Families whose attention normalises each query and key head (RMSNorm over head_dim, its own
# weight per layer: `self_attn.q_norm`, `self_attn.k_norm`) before the rotary embedding.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# Families whose config.json sets `sliding_window` but applies it only with use_sliding_window,
# on the layers from max_window_layers on.
OPT_IN_WINDOW_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Families whose transformers model reads config.json's layer_types (Qwen2 and Qwen3 derive them
# from max_window_layers where absent, Gemma 3 from its pattern); the others slide every layer
# where a window is set and ignore layer_types, and Llama's has no window at all.
LAYER_TYPES_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
UNWINDOWED_ARCHITECTURES = ("LlamaForCausalLM",)
# Gemma 3: RMSNorms scale by (1 + weight), the embedding output is multiplied by
# sqrt(hidden_size), attention output and the MLP's input and output each have their own norm
# (`post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`),
# scores are scaled by query_pre_attn_scalar ** -0.5, and sliding-window layers (every one but
# each sliding_window_pattern-th) rotate with their own base (rope_local_base_freq).
GEMMA_ARCHITECTURES = ("Gemma3ForCausalLM",)
# Families whose transformers model rotates only the first int(head_dim * partial_rotary_factor)
# channels of each query and key head and passes the rest through (Phi-4-mini: 96 of 128); the
# others' transformers models rotate whole heads whatever config.json says.
PARTIAL_ROTARY_ARCHITECTURES = ("Phi3ForCausalLM",)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class MoELayout:
    """Where a mixture-of-experts family keeps its sparse block, by HF module name: the block
    under `model.layers.N`, its router, and each expert's gate, up and down projections."""

    block: str
    router: str
    gate: str
    up: str
    down: str
    # Whether the top-k routing weights are renormalised to sum to one: always (Mixtral), or
    # as config.json's norm_topk_prob says (None: Qwen3-MoE).
    normalize: bool | None
    # The config.json key of each expert's MLP width, as transformers reads it.
    width_key: str
    # Whether config.json's decoder_sparse_step and mlp_only_layers make some layers dense
    # (Qwen3-MoE; transformers' Mixtral reads neither).
    dense_keys: bool = False


MOE_LAYOUTS = {
    "MixtralForCausalLM": MoELayout(
        "block_sparse_moe", "gate", "w1", "w3", "w2", True, "intermediate_size"
    ),
    "Qwen3MoeForCausalLM": MoELayout(
        "mlp", "gate", "gate_proj", "up_proj", "down_proj", None, "moe_intermediate_size", True
    ),
}
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES.values())
SUPPORTED = f"kiln compiles and serves {', '.join(SUPPORTED_ARCHITECTURES)}"
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# transformers' own default where a config.json names no max_position_embeddings.
DEFAULT_MAX_POSITIONS = 2048


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model's shapes and the settings its forward pass needs, from config.json."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_scaling: dict[str, Any] | None = None  # the scaling parameters, unless rope_type default
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    fused_projections: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    partial_rotary_factor: float = 1.0  # the share of each head RoPE rotates (see rotary_dim)
    sliding_window: int | None = None
    # Each decoder layer's attention, "sliding_attention" or "full_attention", as transformers
    # reads config.json (every layer of Mistral slides; Gemma 3 all but every sixth).
    layer_types: tuple[str, ...] = ()
    # Gemma 3 (see GEMMA_ARCHITECTURES): norms offset by one, scaled embeddings, sandwich norms.
    gemma: bool = False
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power, else head_dim's
    local_rope_theta: float | None = None  # the sliding layers' RoPE base where it differs
    # Mixture of experts: experts per sparse layer (0: dense), experts each token uses, each
    # expert's MLP width, whether top-k weights are renormalised, and the dense layers among
    # them (Qwen3-MoE's mlp_only_layers / decoder_sparse_step).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)  # config.json as read

    @property
    def num_parameters(self) -> int:
        """Parameters of the model: decoder layers (every expert), embedding, LM head unless
        tied."""
        sandwich = 2 if self.gemma else 0  # pre/post feed-forward norms
        norms = self.hidden_size * (2 + sandwich) + (self.head_dim * 2 if self.qk_norm else 0)
        linears = sum(
            o * i for i in range(self.num_layers) for o, i in self.layer_linears(i).values()
        )
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return linears + self.num_layers * norms + embeddings + self.hidden_size

    @property
    def rotary_dim(self) -> int:
        """The channels of each query and key head RoPE rotates: the first
        int(head_dim * partial_rotary_factor), as transformers' Phi3 counts them; the rest pass
        through unrotated."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe(self) -> MoELayout | None:
        """The sparse block's layout of a mixture-of-experts model; None for a dense one."""
        return MOE_LAYOUTS.get(self.architecture) if self.num_experts else None

    def layer_window(self, layer: int) -> int | None:
        """The tokens layer `layer` attends to (its own included); None: the whole context."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.dense_layers

    def layer_linears(self, layer: int) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of every linear of decoder layer `layer`, by its module
        name under `model.layers.N` (`self_attn.q_proj`, `mlp.down_proj`; a sparse layer's
        router and each expert's projections: `mlp.gate`, `mlp.experts.3.up_proj`)."""
        dense = self.linear_shapes()
        if self.fused_projections:
            q, kv = dense["q_proj"][0], dense["k_proj"][0]
            return {
                "self_attn.qkv_proj": (q + 2 * kv, self.hidden_size),
                "self_attn.o_proj": dense["o_proj"],
                "mlp.gate_up_proj": (2 * self.intermediate_size, self.hidden_size),
                "mlp.down_proj": dense["down_proj"],
            }
        out = {f"self_attn.{n}": dense[n] for n in ATTENTION_LINEARS}
        moe = self.moe
        if moe is None or not self.is_sparse(layer):
            out.update({f"mlp.{n}": dense[n] for n in ("gate_proj", "up_proj", "down_proj")})
            return out
        width, hidden = self.moe_intermediate_size, self.hidden_size
        out[f"{moe.block}.{moe.router}"] = (self.num_experts, hidden)
        for e in range(self.num_experts):
            expert = f"{moe.block}.experts.{e}"
            out[f"{expert}.{moe.gate}"] = (width, hidden)
            out[f"{expert}.{moe.up}"] = (width, hidden)
            out[f"{expert}.{moe.down}"] = (hidden, width)
        return out

    def active_linears(self, layer: int) -> dict[str, tuple[int, int]]:
        """The linears one token multiplies in `layer`: a sparse layer's router and only
        num_experts_per_tok of its experts (the first ones stand for any)."""
        moe = self.moe
        if moe is None or not self.is_sparse(layer):
            return self.layer_linears(layer)
        used = {f"{moe.block}.experts.{e}." for e in range(self.num_experts_per_tok)}
        return {
            name: shape
            for name, shape in self.layer_linears(layer).items()
            if ".experts." not in name or name[: name.rindex(".") + 1] in used
        }

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of each dense decoder linear, by its HF module name."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        return {
            "q_proj": (q_out, self.hidden_size),
            "k_proj": (kv_out, self.hidden_size),
            "v_proj": (kv_out, self.hidden_size),
            "o_proj": (self.hidden_size, q_out),
            "gate_proj": (self.intermediate_size, self.hidden_size),
            "up_proj": (self.intermediate_size, self.hidden_size),
            "down_proj": (self.hidden_size, self.intermediate_size),
        }

    def unsupported(self) -> list[str]:
        """Why the runtime cannot run this model (so kiln cannot compile it); empty if it can."""
        problems = []
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            problems.append(f"architecture {self.architecture} is not supported; {SUPPORTED}")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(
                f"hidden_act {self.hidden_act!r} is not supported; the runtime has "
                f"{', '.join(ACTIVATIONS)}"
            )
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if self.config.get(name) is not None:
                problems.append(f"{name} {self.config[name]} is not supported (Gemma 2's)")
        if self.config.get("use_bidirectional_attention"):
            problems.append("use_bidirectional_attention (an embedding model) is not supported")
        if (
            self.partial_rotary_factor != 1.0
            and self.architecture not in PARTIAL_ROTARY_ARCHITECTURES
        ):
            problems.append(
                f"partial_rotary_factor {self.partial_rotary_factor} is not supported on "
                f"{self.architecture}: its transformers model rotates whole heads (of the "
                f"families kiln runs, {', '.join(PARTIAL_ROTARY_ARCHITECTURES)} rotates part of "
                "each); remove the key, or set it to 1.0"
            )
        if self.rope_type not in ROPE_TYPES:
            problems.append(
                f"rope type {self.rope_type!r} is not supported; the runtime has "
                f"{', '.join(ROPE_TYPES)}"
            )
        return problems

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelInfo:
        """Parse a config.json dict (Llama, Mistral, Qwen2, Qwen3 field names).

        Raises ValueError naming the field when one the shapes need is missing or unusable
        (configs of other families name them differently: GPT-2's n_embd, n_layer), and
        config_ranges.ConfigValueError naming each value out of its range.
        """
        if not isinstance(config, dict):
            raise ValueError(f"a {type(config).__name__} where a JSON object belongs")
        arch = _architecture(config)
        try:
            return cls._parse(config, arch)
        except ConfigValueError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"no usable {exc} for architecture {arch}; {SUPPORTED}") from None

    @classmethod
    def for_runtime(cls, config: dict[str, Any], source: str) -> ModelInfo:
        """config.json for the forward pass; ArtifactError naming `source` if it cannot run."""
        try:
            info = cls.from_hf_config(config)
        except ValueError as exc:
            raise ArtifactError(f"{source}: config.json has {exc}") from None
        problems = info.unsupported()
        if problems:
            raise ArtifactError(f"{source}: {'; '.join(problems)}")
        return info

    @classmethod
    def _parse(cls, config: dict[str, Any], arch: str) -> ModelInfo:
        if problems := size_problems(config):
            raise ConfigValueError(problems)
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        max_positions = int(config.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
        params = config.get("rope_parameters") or {}
        for key, value in (
            ("rope_parameters", params),
            ("rope_scaling", config.get("rope_scaling")),
        ):
            if value is not None and not isinstance(value, dict):
                raise ConfigValueError([f"{key} is {json.dumps(value)[:60]}, not an object"])
        local = params.get("sliding_attention") or {}
        where = "rope_parameters" if params else "rope_scaling"
        if "full_attention" in params:  # one set per layer type (Gemma 3, transformers 5)
            params, where = params["full_attention"], "rope_parameters.full_attention"
        rope = {**(config.get("rope_scaling") or {}), **params}
        theta_key = f"{where}.rope_theta" if "rope_theta" in rope else "rope_theta"
        theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        partial_key = (f"{where}.partial_rotary_factor" if "partial_rotary_factor" in rope
                       else "partial_rotary_factor")  # fmt: skip
        partial = rope.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        rotary = rotary_problems(partial_key, partial, head_dim)
        rotary_dim = None if rotary else int(head_dim * partial)  # unknown: lengths unchecked
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        window = None if arch in UNWINDOWED_ARCHITECTURES else config.get("sliding_window")
        if arch in OPT_IN_WINDOW_ARCHITECTURES and not config.get("use_sliding_window", False):
            window = None
        layers = int(config["num_hidden_layers"])
        gemma = arch in GEMMA_ARCHITECTURES
        local_theta = local.get("rope_theta", config.get("rope_local_base_freq"))
        layout = MOE_LAYOUTS.get(arch)
        bases = {theta_key: theta}  # and the sliding layers' own, where set (Gemma 3)
        if local_theta is not None:
            local_key = "rope_parameters.sliding_attention" if "rope_theta" in local else ""
            bases[f"{local_key}.rope_theta" if local_key else "rope_local_base_freq"] = local_theta
        problems = [
            *(moe_problems(config, layout.width_key, layers, layout.dense_keys) if layout else []),
            *attention_problems(config, layers, window, gemma),
            *rotary,
            *rope_problems(config, rope, where, rotary_dim, bases),
        ]
        if problems:
            raise ConfigValueError(problems)
        eos = config.get("eos_token_id")
        experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
        step = int(config.get("decoder_sparse_step") or 1)
        only = config.get("mlp_only_layers") or []
        dense = layout is not None and layout.dense_keys
        dense_layers = tuple(i for i in range(layers) if dense and (i in only or (i + 1) % step))
        normalize = layout.normalize if layout else None
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            hidden_act=str(config.get("hidden_activation") or config.get("hidden_act", "silu")),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_type=rope_type,
            rope_scaling=rope if rope_type != "default" else None,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            fused_projections=arch in FUSED_ARCHITECTURES,
            partial_rotary_factor=float(partial),
            num_experts=experts if layout else 0,
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 0) if layout else 0,
            moe_intermediate_size=int(config[layout.width_key]) if layout else 0,
            norm_topk_prob=bool(
                config.get("norm_topk_prob", False) if normalize is None else normalize
            ),
            dense_layers=dense_layers if layout else (),
            sliding_window=int(window) if window else None,
            layer_types=tuple(_layer_types(config, arch, layers, window is not None)),
            gemma=gemma,
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256)
            if gemma
            else None,
            local_rope_theta=float(local_theta or 10000.0) if gemma else None,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            config=dict(config),
        )


def _layer_types(config: dict[str, Any], arch: str, layers: int, window: bool) -> list[str]:
    """Each layer's attention ("sliding_attention" or "full_attention") as transformers reads
    config.json: its layer_types, else the family's rule."""
    if arch in LAYER_TYPES_ARCHITECTURES and config.get("layer_types"):
        return [str(t) for t in config["layer_types"]]
    if arch in GEMMA_ARCHITECTURES:
        pattern = int(config.get("sliding_window_pattern") or 6)
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    if not window:
        return ["full_attention"] * layers
    first = int(config.get("max_window_layers", 28)) if arch in LAYER_TYPES_ARCHITECTURES else 0
    return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]


def _architecture(config: dict[str, Any]) -> str:
    """The class a config names; from its model_type where it names none, as transformers does."""
    names = config.get("architectures")
    if names is not None and not (
        isinstance(names, list) and all(isinstance(n, str) for n in names)
    ):
        # vLLM and TensorRT-LLM read a list of class names; a string reads as its letters.
        shown = json.dumps(names)[:60]
        raise ConfigValueError(
            [
                f"architectures {shown}, not a list of class names: write "
                f"[{json.dumps(names) if isinstance(names, str) else '...'}]"
            ]
        )
    if names:
        return str(names[0])
    if config.get("model_type"):
        model_type = str(config["model_type"])
        return ARCHITECTURES.get(model_type, f"{model_type} (model_type)")
    return "<missing>"


def with_legacy_rope(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its RoPE also spelled as transformers 4 reads it.

    transformers 5 writes `rope_parameters` (one set per layer type for Gemma 3) and drops
    `rope_theta`, `rope_scaling` and `rope_local_base_freq`; transformers 4.57 (TensorRT-LLM
    1.2's, and any older consumer) ignores `rope_parameters` and takes its defaults, so a
    checkpoint saved by transformers 5 would load there with RoPE base 10000 and no scaling,
    silently. The legacy keys are added, never changed where present; transformers 5 reads
    `rope_parameters` first, so both read the same RoPE."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return dict(config)
    local = params.get("sliding_attention") or {}
    full = params.get("full_attention", params)
    legacy: dict[str, Any] = {}
    if "rope_theta" in full:
        legacy["rope_theta"] = full["rope_theta"]
    scaling = {k: v for k, v in full.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "longrope":  # transformers 4's Phi3Config takes exactly these three fields
        legacy["rope_scaling"] = {
            "type": "longrope", "short_factor": scaling.get("short_factor"),
            "long_factor": scaling.get("long_factor"),
        }  # fmt: skip
        if "original_max_position_embeddings" in scaling:
            legacy["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    elif kind != "default":
        legacy["rope_scaling"] = scaling
    if full.get("partial_rotary_factor", 1.0) != 1.0:
        legacy["partial_rotary_factor"] = full["partial_rotary_factor"]
    if "rope_theta" in local:
        legacy["rope_local_base_freq"] = local["rope_theta"]
    return {**legacy, **config}
