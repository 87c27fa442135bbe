"""Random-weight checkpoints of real models' shapes, built offline with SmolLM2's tokenizer: what
the scale benchmark (tests/benchmarks/scale.py) and the suite's memory guard compile.

Tensors are made one shard at a time from the model's parameter list on the meta device, so
building an 8B-shaped checkpoint holds one 2 GB shard, never the model; the weights are
N(0, 0.02) (norms 1), in bfloat16 as the models ship, written as ≤ 2 GB shards with
`model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHARD_BYTES = 2 * 10**9
VOCAB = 49152  # SmolLM2's tokenizer


@dataclass(frozen=True)
class Shape:
    """A model's shape as its config.json states it."""

    arch: str  # llama | qwen3_moe
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    tied: bool = False

    def config(self) -> dict[str, Any]:
        common = {
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": VOCAB,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": self.tied,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        if self.arch == "llama":
            return {**common, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                    "rope_theta": 500000.0}  # fmt: skip
        return {
            **common,
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "head_dim": self.hidden // self.heads,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.expert_intermediate,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "rope_theta": 1000000.0,
        }


SHAPES = {
    # The guard the suite keeps: big enough that a second copy of the model shows.
    "guard-300m": Shape("llama", 1024, 16, 2816, 16, 4, tied=True),
    # TinyLlama-1.1B's shape (1.28B with this vocabulary).
    "llama-1b": Shape("llama", 2048, 22, 5632, 32, 4),
    # Llama-3.2-3B's shape.
    "llama-3b": Shape("llama", 3072, 28, 8192, 24, 8, tied=True),
    # Llama-3.1-8B's shape (7.5B with this vocabulary).
    "llama-8b": Shape("llama", 4096, 32, 14336, 32, 8),
    # Qwen3-30B-A3B's layers, 64 experts of its 128, 8 of its 48 layers.
    "qwen3-moe-2b": Shape("qwen3_moe", 2048, 8, 6144, 32, 4, 64, 8, 768),
}


def _parameters(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor the model's checkpoint holds, with its shape (from a meta-device model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config), dtype=torch.bfloat16
        )
    names = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    if config["tie_word_embeddings"]:
        names = [(n, s) for n, s in names if n != "lm_head.weight"]
    return names


def _experts_apart(
    names: list[tuple[str, tuple[int, ...]]],
) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' fused expert tensors as a published checkpoint stores them: one linear
    per expert and projection (transformers fuses them again when it loads)."""
    out = []
    for name, shape in names:
        if name.endswith("mlp.experts.gate_up_proj"):
            experts, rows, cols = shape
            base = name.removesuffix("gate_up_proj")
            for e in range(experts):
                out += [(f"{base}{e}.gate_proj.weight", (rows // 2, cols)),
                        (f"{base}{e}.up_proj.weight", (rows // 2, cols))]  # fmt: skip
        elif name.endswith("mlp.experts.down_proj"):
            experts, rows, cols = shape
            base = name.removesuffix("down_proj")
            out += [(f"{base}{e}.down_proj.weight", (rows, cols)) for e in range(experts)]
        else:
            out.append((name, shape))
    return out


def tokenizer_files(into: Path) -> None:
    """SmolLM2-135M-Instruct's tokenizer (from the embedded GGUF, materialised once)."""
    from kiln.compiler import sources

    cache = Path.home() / ".cache" / "kiln-scale" / "smollm2-tokenizer"
    if not (cache / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        ref = sources.parse_source("builtin:smollm2-135m-instruct", base_dir=cache.parent)
        model = sources.materialize(ref, cache.parent / "smollm2-float")
        AutoTokenizer.from_pretrained(model).save_pretrained(cache)
    for path in cache.iterdir():
        shutil.copy2(path, into / path.name)


def build(shape: Shape, out: Path, seed: int = 0) -> Path:
    """Write a random checkpoint of `shape` into `out` (config, tokenizer, ≤2 GB shards)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = shape.config()
    names = _parameters(config)
    if shape.arch == "qwen3_moe":
        names = _experts_apart(names)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in names:
        nbytes = 2 * int(torch.tensor(dims).prod()) if dims else 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    total = 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, dims in shard:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                t = torch.empty(dims, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
                tensors[name] = t.to(torch.bfloat16)
            weight_map[name] = file
            total += tensors[name].numel() * 2
        save_file(tensors, out / file, metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n"
    )
    tokenizer_files(out)
    return out


def weight_bytes(model_dir: Path) -> int:
    """The checkpoint's tensor bytes (its index's total, else the files' sizes)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return int(json.loads(index.read_text())["metadata"]["total_size"])
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def parameters(model_dir: Path) -> int:
    return weight_bytes(model_dir) // 2


# Runs its arguments as a child and prints the child's peak RSS as the kernel counts it (the
# largest resident set of that process tree's processes), so each measurement has its own.
_MEASURE = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:])\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def run_measured(argv: list[str], env: dict[str, str]) -> tuple[int, int, str, str]:
    """(exit code, peak RSS bytes, stdout, stderr) of running `argv`."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _MEASURE, *argv], env=env, capture_output=True,
                          text=True)  # fmt: skip
    *lines, peak = done.stderr.rstrip("\n").split("\n")
    return done.returncode, int(peak), done.stdout, "\n".join(lines)
