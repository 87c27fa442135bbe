"""The runtime's forward pass matches transformers on Llama, Mistral, Qwen2, Qwen3, Phi-3 (its
partial rotary too: Phi-4-mini), Gemma 3, Mixtral and Qwen3-MoE."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.runtime import Engine, SamplingParams
from kiln.runtime.base.errors import ArtifactError, UsageError
from tests.runtime.conftest import hf_greedy, hf_logprobs, hf_model, logprobs_of, prompt_ids

ARCHS = ["tiny_llama", "tiny_mistral", "tiny_qwen2", "tiny_qwen3", "tiny_phi3",
         "tiny_phi3_partial_rotary", "tiny_gemma3", "tiny_mixtral", "tiny_qwen3_moe"]  # fmt: skip
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_phi3_partial_rotary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Phi-3 that rotates 24 of each head's 32 channels (partial_rotary_factor 0.75,
    as Phi-4-mini rotates 96 of 128) and ties its LM head to the embedding, as Phi-4-mini."""
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-phi3-partial"), arch="phi3", partial_rotary_factor=0.75,
        tie_word_embeddings=True,
    )  # fmt: skip


def prompt_logprob_matrix(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """Engine log-probabilities of each prompt token (after the first), as a tensor."""
    out = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return logprobs_of(out.prompt_logprobs[1:], prompt[1:])


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(arch)
    engine = Engine.from_pretrained(model_dir, block_size=4)
    prompt = prompt_ids(model_dir, 1)[0]
    reference = hf_logprobs(hf_model(model_dir), prompt)
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(prompt_logprob_matrix(engine, prompt), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuations_match_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(arch)
    engine = Engine.from_pretrained(model_dir, block_size=8)
    hf = hf_model(model_dir)
    prompts = prompt_ids(model_dir)
    outputs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
        assert out.finish_reason == "length"


def test_top_logprobs_match_transformers(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama)
    prompt = prompt_ids(tiny_llama, 1)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    out = engine.generate([prompt], params)[0]
    reference = hf_logprobs(hf_model(tiny_llama), prompt + out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == 6
    for step, (entry, token) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
        row = reference[len(prompt) - 1 + step]
        values, ids = row.topk(5)
        assert entry[token].rank == 1
        assert entry[token].decoded_token == engine.tokenizer.decode([token])
        for rank, (value, token_id) in enumerate(
            zip(values.tolist(), ids.tolist(), strict=True), start=1
        ):
            assert entry[token_id].rank == rank
            assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)


def edited_copy(source: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_llama3_rope_scaling_and_tied_embeddings_match(tiny_llama: Path, tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    model_dir = edited_copy(
        tiny_llama, tmp_path / "llama3", rope_parameters=rope, tie_word_embeddings=True
    )
    weights = load_file(model_dir / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    engine = Engine.from_pretrained(model_dir)
    prompt = [
        t for p in prompt_ids(model_dir) for t in p
    ]  # long enough for the scaled low frequencies to matter
    reference = hf_logprobs(hf_model(model_dir), prompt)
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(prompt_logprob_matrix(engine, prompt), expected, atol=1e-4, rtol=0)


def test_unsupported_architecture_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = edited_copy(tiny_llama, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ArtifactError, match="GPT2LMHeadModel is not supported"):
        Engine.from_pretrained(model_dir)


def test_prompt_too_long_is_a_usage_error(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama, max_model_len=16)
    with pytest.raises(UsageError, match="shorten the prompt"):
        engine.add_request(list(range(20)))


def test_sliding_window_layers_match_transformers_through_chunks_and_cached_prefixes(
    tiny_gemma3: Path,
) -> None:
    """Gemma 3's window of 8 on two of three layers, with prompts of 11 to 50 tokens cut into
    chunks of 5 and a repeated prompt served from the prefix cache: every chunk, decode and
    cache hit attends to exactly the window transformers' mask allows."""
    engine = Engine.from_pretrained(tiny_gemma3, block_size=4, max_num_batched_tokens=5)
    hf = hf_model(tiny_gemma3)
    prompts = prompt_ids(tiny_gemma3)
    prompts.append(prompts[2])  # a prefix-cache hit longer than the window
    for prompt, out in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert engine.stats().prefix_cache_hits > 0


def test_mistrals_window_is_attended_not_a_length_limit(tiny_mistral: Path, tmp_path: Path) -> None:
    """A Mistral config with sliding_window 8 serves contexts past 8, each layer attending to
    its last 8 tokens as transformers does (the runtime once capped max_model_len there)."""
    model_dir = edited_copy(tiny_mistral, tmp_path / "windowed", sliding_window=8)
    engine = Engine.from_pretrained(model_dir, block_size=4)
    prompt = prompt_ids(model_dir, 1)[0]
    reference = hf_logprobs(hf_model(model_dir), prompt)
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(prompt_logprob_matrix(engine, prompt), expected, atol=1e-4, rtol=0)
    out = engine.generate([prompt], GREEDY)[0]
    assert len(prompt) > 8 and out.token_ids == hf_greedy(hf_model(model_dir), prompt, 24)


# Gemma 3's chat template, its structure as google/gemma-3-*-it ship it: the system prompt
# folded into the first user turn, the assistant called "model", turns closed by <end_of_turn>.
GEMMA3_CHAT = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ prefix if loop.first else '' }}{{ m['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_a_gemma3_chat_renders_its_template_and_stops_at_its_generation_eos(
    tiny_gemma3: Path, tmp_path: Path
) -> None:
    """The chat prompt is the model's own template, rendered as transformers renders it, and
    generation stops at any of generation_config.json's eos_token_id (Gemma 3 lists
    <end_of_turn> beside <eos>): here the tiny model's second greedy token stands for it."""
    from transformers import AutoTokenizer

    from kiln.runtime.engine.chat import chat_token_ids

    model_dir = tmp_path / "gemma3-chat"
    shutil.copytree(tiny_gemma3, model_dir)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = GEMMA3_CHAT
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    engine = Engine.from_pretrained(model_dir)
    prompt = chat_token_ids(engine.tokenizer, messages)
    assert prompt == list(getattr(expected, "input_ids", expected))
    assert engine.tokenizer.decode(prompt).endswith("<start_of_turn>model\n")
    free = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop = free[0].token_ids[1]
    eos = [tokenizer.eos_token_id, stop]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    out = Engine.from_pretrained(model_dir).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0)
    )[0]
    assert out.token_ids == free[0].token_ids[: free[0].token_ids.index(stop) + 1]
    assert out.finish_reason == "stop"


def longrope_phi3(path: Path, rotated: int, **extra: object) -> Path:
    """A 2-layer Phi-3 with LongRoPE: short and long factors of their own for each of the
    `rotated` channels' pairs, pretrained on 16 positions, extended to 512."""
    from tests.tiny_models import make_tiny_model

    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(rotated // 2)],
        "long_factor": [1.5 + 0.5 * i for i in range(rotated // 2)],
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    }
    return make_tiny_model(
        path, arch="phi3", rope_parameters=rope, original_max_position_embeddings=16, **extra
    )


@pytest.fixture(scope="module")
def tiny_phi3_longrope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LongRoPE over whole heads of 32, as Phi-3-128k and Phi-3.5."""
    return longrope_phi3(tmp_path_factory.mktemp("tiny-phi3-longrope"), 32)


@pytest.fixture(scope="module")
def tiny_phi4_mini(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-4-mini in small: LongRoPE over the 24 rotated channels of each head of 32
    (partial_rotary_factor 0.75, so 12 factors a list), the LM head tied to the embedding."""
    return longrope_phi3(
        tmp_path_factory.mktemp("tiny-phi4-mini"), 24, partial_rotary_factor=0.75,
        tie_word_embeddings=True,
    )  # fmt: skip


@pytest.mark.parametrize("model", ["tiny_phi3_longrope", "tiny_phi4_mini"])
def test_longrope_matches_transformers_on_both_sides_of_the_original_context(
    model: str, request: pytest.FixtureRequest
) -> None:
    """Within the pretrained 16 positions the short factors rotate, for a context past them
    the long ones, both scaled by the attention factor: a continuation that stays within 16
    positions and the prompt log-probabilities of a prompt past them are transformers' own.
    A sequence that grows past 16 rotates its later tokens with the long factors and keeps
    its cached keys (vLLM's rule, per sequence here, so batching changes nothing; transformers'
    generate instead drops its cache at the crossing and feeds the new token alone)."""
    model_dir = request.getfixturevalue(model)
    engine = Engine.from_pretrained(model_dir, block_size=4, dtype="float32")
    hf = hf_model(model_dir)
    prompt = prompt_ids(model_dir, 1)[0]
    short = prompt[:6]
    within = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)  # 16 positions
    assert engine.generate([short], within)[0].token_ids == hf_greedy(hf, short, 10)
    assert len(prompt) > 16
    reference = hf_logprobs(hf, prompt)
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(prompt_logprob_matrix(engine, prompt), expected, atol=1e-4, rtol=0)
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in (short, prompt)]
    assert [o.token_ids for o in engine.generate([short, prompt], GREEDY)] == alone
    # The long table is in use past the crossing: without it the continuation differs.
    engine.model.long_rope = (10**9, engine.model.long_rope[1])
    assert engine.generate([prompt], GREEDY)[0].token_ids != alone[1]


def test_partial_rotary_off_the_fused_kernels_matches_transformers(
    tiny_phi3_partial_rotary: Path,
) -> None:
    """The pure-torch forward (a GPU's, or a CPU's without kiln's native kernels) rotates the
    first 24 channels of each head and passes the other 8 through, as transformers' Phi-3."""
    engine = Engine.from_pretrained(tiny_phi3_partial_rotary, block_size=4, dtype="float32")
    engine.model.fused = False
    prompt = prompt_ids(tiny_phi3_partial_rotary, 1)[0]
    reference = hf_logprobs(hf_model(tiny_phi3_partial_rotary), prompt)
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(prompt_logprob_matrix(engine, prompt), expected, atol=1e-4, rtol=0)


def test_partial_rotary_is_refused_where_transformers_rotates_whole_heads(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model_dir = edited_copy(tiny_llama, tmp_path / "llama-partial", partial_rotary_factor=0.5)
    with pytest.raises(
        ArtifactError, match=r"partial_rotary_factor 0\.5 is not supported on Llama"
    ):
        Engine.from_pretrained(model_dir)


def test_a_partial_rotary_factor_that_rotates_an_odd_count_is_refused_naming_it(
    tiny_phi3_partial_rotary: Path, tmp_path: Path
) -> None:
    """0.72 of a head of 32 is 23 channels: RoPE rotates pairs, so the config is refused by its
    key and value before anything runs."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.72}
    model_dir = edited_copy(tiny_phi3_partial_rotary, tmp_path / "odd", rope_parameters=rope)
    with pytest.raises(ArtifactError) as refused:
        Engine.from_pretrained(model_dir)
    assert "config.json has rope_parameters.partial_rotary_factor 0.72" in str(refused.value)
    assert "23 of head_dim 32 channels" in str(refused.value)
