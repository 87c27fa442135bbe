"""Session fixtures: tiny deterministic models built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_model

# Hermetic: never reach a model hub, keep dataset caches out of the user's home.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The suite's fidelity specs (runtime vs transformers, the gate on an unchanged model) are
# float32 ones, so "auto" means float32 on every CPU here, bf16-native or not; run the suite
# with KILN_DTYPE=bfloat16 to see how they hold in bf16 (runtime/engine/dtype.py).
os.environ.setdefault("KILN_DTYPE", "float32")
# The runtime's native kernels build once per machine in torch's extensions directory, which
# follows XDG_CACHE_HOME: pin it before the session's private cache (below) moves that, so
# test sessions and the servers they start share one build instead of compiling again.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"),
)


# `make test` splits the suite over two workers (pytest-xdist), each test sent to whichever
# is free: the slow tests (`slow(minutes=...)`, measured on a 2-core machine) are collected
# first, longest first, so they start at once on both workers and the short ones fill in
# around them instead of both workers waiting on a long one at the end.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def minutes(item: pytest.Item) -> float:
        slow = item.get_closest_marker("slow")
        return 0.0 if slow is None else float(slow.kwargs.get("minutes", 1.0))

    items.sort(key=lambda item: -minutes(item))


@pytest.fixture(autouse=True, scope="session")
def _private_kiln_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep kiln's per-user caches (file digests, GGUF metadata) out of the real home."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random LlamaForCausalLM (hidden 128) with a trained BPE tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), arch="mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Qwen3ForCausalLM: per-head q/k norms, head_dim 64 (heads * head_dim
    = 256, twice the hidden size, as Qwen3's explicit head_dim allows)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", head_dim=64)


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Phi3ForCausalLM: q/k/v and gate/up stored fused."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-phi3"), arch="phi3")


# Gemma 3 in small: a window of 8 tokens on layers 0 and 1, layer 2 global; scores scaled by a
# query_pre_attn_scalar that is not head_dim; global layers rotate with base 1e6 and linear
# scaling, sliding ones with base 10000, as Gemma 3 4B's config.json has them.
GEMMA3 = {
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 48,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
}


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Gemma3ForCausalLM (GEMMA3), embeddings tied, norms random."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-gemma3"), arch="gemma3_text", num_layers=3,
        tie_word_embeddings=True, **GEMMA3,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random MixtralForCausalLM: 4 experts as wide as intermediate_size (256), 2 a
    token."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mixtral"), arch="mixtral")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Qwen3MoeForCausalLM: q/k norms, 4 experts of width 128, 2 per token,
    top-k weights not renormalised, layer 1 dense (mlp_only_layers)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-moe"), arch="qwen3_moe", num_layers=3,
        mlp_only_layers=[1], norm_topk_prob=False,
    )  # fmt: skip


@pytest.fixture(scope="session")
def smollm2_float(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2-135M-Instruct as a float checkpoint, materialised once per run of
    the suite, whatever its number of workers (its Q4_1 GGUF dequantised through transformers:
    ~50 s on a 2-core EPYC)."""
    from filelock import FileLock

    from kiln.compiler import sources

    # One copy for all of a run's workers: they share their base temporary folder's parent.
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    with FileLock(root / "smollm2-float.lock"):
        ref = sources.parse_source("builtin:smollm2-135m-instruct", base_dir=root)
        return sources.materialize(ref, root / "smollm2-float")


@pytest.fixture(scope="session")
def smollm2_gptq_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo recipe (SmolLM2-135M-Instruct, GPTQ W4A16 g64) compiled once per session."""
    from kiln.compiler.compile import compile_recipe

    repo = Path(__file__).parents[1]
    out = tmp_path_factory.mktemp("smollm2-artifacts")
    return compile_recipe(repo / "recipes" / "demo.yaml", output=out).artifact
