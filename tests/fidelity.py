"""kiln's runtime against transformers + compressed-tensors on one checkpoint, and the
reference's own spread: the helpers of tests/runtime/test_fidelity.py and
tests/benchmarks/fidelity.py.

Formats that quantise activations (FP8, W8A8) are discontinuous functions of their input: a
value within float rounding of a code boundary lands on either code. Two correct
implementations whose float sums differ in the last bit (any two kernels) flip a few codes
somewhere in a 30-layer model, and each flip moves the next layers' inputs across more
boundaries. So the distance between kiln and transformers on such a format is measured next
to the distance between transformers and itself with every decoder layer's output moved by
one part in 10^7 (`layer_jitter`, about one float32 ulp): an implementation no further from
the reference than that is as close as float arithmetic allows; a defect (a wrong scale, a
missed clamp, per-tensor where the checkpoint says per-token) sits well outside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# llm-compressor modifiers kiln compiles to, without calibration-heavy algorithms (GPTQ,
# SmoothQuant) so that a test builds each format of SmolLM2 in seconds: the runtime serves
# the stored codes and scales whatever algorithm chose them.
MODES = ("float", "w4a16_g64", "w8a8_dynamic", "fp8_dynamic", "fp8_static")
CALIBRATED = {"fp8_static"}


def modifiers(mode: str) -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    ignore = ["lm_head"]
    if mode == "w4a16_g64":
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}
        groups = {"g": {"targets": ["Linear"], "weights": {**weights, "symmetric": True}}}
        return [QuantizationModifier(ignore=ignore, config_groups=groups)]
    scheme = {"w8a8_dynamic": "W8A8", "fp8_dynamic": "FP8_DYNAMIC", "fp8_static": "FP8"}[mode]
    return [QuantizationModifier(targets="Linear", ignore=ignore, scheme=scheme)]


def token_windows(source: Path, count: int = 4, length: int = 128) -> list[list[int]]:
    """`count` windows of `length` tokens of the GPL-3 text (Debian's common-licenses)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = tokenizer.encode(Path("/usr/share/common-licenses/GPL-3").read_text())
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def quantise(source: Path, mode: str, out: Path) -> Path:
    """A compressed-tensors checkpoint of `source` in `mode`, written by llm-compressor."""
    import shutil

    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if mode == "float":
        shutil.copytree(source, out)
        return out
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    extra: dict[str, Any] = {}
    if mode in CALIBRATED:
        samples = token_windows(source, count=16, length=64)[8:]  # after the scored 512 tokens
        data = {"input_ids": samples, "attention_mask": [[1] * 64] * len(samples)}
        extra = {
            "dataset": Dataset.from_dict(data),
            "num_calibration_samples": len(samples),
            "max_seq_length": 64,
            "shuffle_calibration_samples": False,
        }
    oneshot(model=model, recipe=modifiers(mode), **extra)
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@contextlib.contextmanager
def layer_jitter(model: Any, relative: float = 1e-7, seed: int = 0) -> Iterator[None]:
    """Multiply every decoder layer's output of a transformers model by 1 + relative * N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)

    def hook(module: Any, inputs: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        noise = torch.randn(hidden.shape, generator=generator, dtype=torch.float32)
        moved = hidden * (1 + relative * noise).to(hidden.dtype)
        return (moved, *output[1:]) if isinstance(output, tuple) else moved

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def reference_logprobs(model: Any, windows: list[list[int]]) -> torch.Tensor:
    """Each token's log-probability after its prefix, under a transformers model (float64)."""
    out = []
    with torch.no_grad():
        for ids in windows:
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
            out.append(logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])])
    return torch.cat(out)


def engine_logprobs(engine: Any, windows: list[list[int]]) -> torch.Tensor:
    """The same log-probabilities from kiln's runtime (prompt_logprobs of each window)."""
    from kiln.runtime import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = []
    for ids, result in zip(windows, engine.generate(windows, params), strict=True):
        assert result.prompt_logprobs is not None
        entries = result.prompt_logprobs[1:]
        out.append(torch.tensor([e[t].logprob for e, t in zip(entries, ids[1:], strict=True)]))
    return torch.cat(out).double()


def deviation(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(mean, max) |a - b|."""
    delta = (a - b).abs()
    return float(delta.mean()), float(delta.max())
