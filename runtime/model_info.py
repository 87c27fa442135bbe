"""What the compiler knows about a model before loading any weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Shapes and sizes read from a model's config (or GGUF metadata), never its weights."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    num_parameters: int
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    config: dict[str, Any] = field(default_factory=dict)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of each decoder linear, by its HF module name."""
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

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelInfo:
        """Build from a Hugging Face config.json dict (Llama, Mistral, Qwen2 field names)."""
        archs = config.get("architectures") or ["<missing>"]
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
        layers = int(config["num_hidden_layers"])
        vocab = int(config["vocab_size"])
        tied = bool(config.get("tie_word_embeddings", False))
        per_layer = (
            hidden * heads * head_dim * 2  # q, o
            + hidden * kv_heads * head_dim * 2  # k, v
            + hidden * inter * 3  # gate, up, down
            + hidden * 2  # two norms
        )
        params = layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden
        return cls(
            architecture=str(archs[0]),
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            num_parameters=params,
            tie_word_embeddings=tied,
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            config=dict(config),
        )
