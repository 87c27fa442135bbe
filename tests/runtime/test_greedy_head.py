"""The greedy head (runtime/engine/layers/greedy_head.py,
runtime/engine/native/csrc/int8_screen.cpp): its int8 screen decides each row's argmax exactly as
the full bf16 LM head does (ties to the lowest index, after the layer's rounding to bfloat16), falls
back where it cannot decide, and the engine's greedy tokens are the same with it and without it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kiln.runtime.engine.layers.dense as dense
import kiln.runtime.engine.layers.greedy_head as greedy_head
import kiln.runtime.engine.layers.linear as linear
from kiln.runtime import Engine, SamplingParams
from kiln.runtime.engine import native
from kiln.runtime.engine.layers.dense import DenseLinear
from kiln.runtime.engine.layers.greedy_head import GreedyHead
from kiln.runtime.formats.weights import LinearWeights, WeightScheme
from tests.runtime.test_batch_invariance import audit_prompts

pytestmark = pytest.mark.skipif(
    not native.avx2_kernels_available(),
    reason="kiln's bf16 kernel does not serve this CPU (needs AVX2, FMA and the native build)",
)

VOCAB, HIDDEN = 8192, 576


@pytest.fixture(scope="module", autouse=True, params=["panels", "amx", "pairs"])
def copy_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The copy of the head the screen recomputes from: kiln's panels (bf16 layers on kiln's
    kernel, also on CPUs whose oneDNN computes bf16), kiln's AMX tiles beside oneDNN's packed
    weight (the runtime's choice on CPUs with AMX), or kiln's AVX512-BF16 pairs, the layer's
    only copy (the runtime's choice on CPUs with AVX512-BF16 but no AMX)."""
    if request.param == "amx" and not native.amx_kernels_available():
        pytest.skip("kiln's AMX kernels need a CPU with AMX-BF16")
    if request.param == "pairs" and not native.dpbf16_kernels_available():
        pytest.skip("kiln's AVX512-BF16 kernels need a CPU with AVX512-BF16")
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "panels":
            patch.setattr(dense, "PACKED_DTYPES", (torch.float32,))
            patch.setattr(dense, "DPBF16_LINEAR", False)
        else:
            patch.setattr(dense, "PACKED_DTYPES", (torch.float32, torch.bfloat16))
            patch.setattr(dense, "AMX_LINEAR", request.param == "amx")
        yield request.param


def bf16_head(weight: torch.Tensor) -> DenseLinear:
    head = DenseLinear(
        LinearWeights(WeightScheme(), weight.bfloat16()), torch.bfloat16, torch.device("cpu")
    )
    # where the screen applies
    assert head.panels is not None or head.amx is not None or head.pairs is not None
    return head


def full_argmax(head: DenseLinear, x: torch.Tensor) -> torch.Tensor:
    return head(x).float().max(dim=-1).indices


@pytest.fixture(scope="module")
def random_head(copy_kind: str) -> DenseLinear:
    torch.manual_seed(0)
    head = bf16_head(torch.randn(VOCAB, HIDDEN) * 0.05)
    assert (head.amx is not None) == (copy_kind == "amx")
    assert (head.pairs is not None) == (copy_kind == "pairs")
    return head


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_the_screen_gives_the_full_heads_argmax(random_head: DenseLinear, rows: int) -> None:
    screen = GreedyHead.build(random_head)
    assert screen is not None
    torch.manual_seed(rows)
    for spread in (0.1, 1.0, 8.0):
        for _ in range(10):
            x = (torch.randn(rows, HIDDEN) * spread).bfloat16()
            assert torch.equal(screen.argmax(x), full_argmax(random_head, x))
    assert screen.screened == 30 and screen.fallbacks == 0


def test_equal_and_bf16_equal_maxima_go_to_the_lowest_index() -> None:
    torch.manual_seed(1)
    weight = torch.randn(VOCAB, HIDDEN) * 0.05
    x = torch.randn(1, HIDDEN).bfloat16()
    top = x.float()[0] / x.float().norm() * 2  # a row whose logit leads by far
    for index in (7000, 300, 4100):  # identical rows: an exact tie
        weight[index] = top
    # Rows whose float32 logits differ but round to the same bfloat16 (ulp 2^-6 near 2-4).
    near = top.clone()
    near[0] += 1e-6 / max(abs(float(x[0, 0])), 1e-3)
    weight[200] = near
    head = bf16_head(weight)
    screen = GreedyHead.build(head)
    assert screen is not None
    expected = full_argmax(head, x)
    assert int(expected) in (200, 300)
    assert torch.equal(screen.argmax(x), expected)
    assert screen.screened == 1


def test_rows_it_cannot_decide_run_the_full_head(random_head: DenseLinear) -> None:
    screen = GreedyHead.build(random_head)
    assert screen is not None
    zero = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)  # every logit 0: every token a candidate
    assert torch.equal(screen.argmax(zero), full_argmax(random_head, zero))
    poisoned = torch.randn(2, HIDDEN).bfloat16()
    poisoned[1, 3] = float("nan")
    assert torch.equal(screen.argmax(poisoned), full_argmax(random_head, poisoned))
    five = torch.randn(5, HIDDEN).bfloat16()  # more rows than the screen's tile
    assert torch.equal(screen.argmax(five), full_argmax(random_head, five))
    assert (screen.screened, screen.fallbacks) == (0, 3)


def test_no_screen_for_a_head_with_a_non_finite_weight() -> None:
    weight = torch.randn(VOCAB, HIDDEN) * 0.05
    weight[17, 5] = float("inf")
    assert GreedyHead.build(bf16_head(weight)) is None


def test_engine_greedy_tokens_are_the_same_with_the_screen_and_without(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(greedy_head, "MIN_VOCAB", 1)  # the tiny model's vocabulary is small
    prompts = audit_prompts(tiny_llama)[:6]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = Engine.from_pretrained(tiny_llama, dtype="bfloat16", enable_prefix_caching=False)
    screen = engine.runner.model.greedy_head
    assert screen is not None
    screened = engine.generate(prompts[:3], greedy) + engine.generate(prompts[3:], greedy)
    assert screen.screened > 0 and screen.fallbacks == 0  # steps of 3 rows
    wide = engine.generate(prompts, greedy)  # steps of 6 rows: the full head's argmax
    assert screen.fallbacks > 0
    engine.runner.model.greedy_head = None
    full = engine.generate(prompts, greedy)
    assert [o.token_ids for o in screened] == [o.token_ids for o in full]
    assert [o.token_ids for o in wide] == [o.token_ids for o in full]
    # A request that wants log-probabilities gets them from the full head's logits.
    engine.runner.model.greedy_head = screen
    before = screen.screened + screen.fallbacks
    wants = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    with_logprobs = engine.generate(prompts[:1], wants)
    assert screen.screened + screen.fallbacks == before
    assert with_logprobs[0].token_ids == full[0].token_ids and with_logprobs[0].logprobs


@pytest.mark.skipif(not linear.onednn_runs_bf16(), reason="oneDNN cannot run bf16 on this CPU")
@pytest.mark.parametrize("copy_kind", ["panels"], indirect=True)
def test_beside_onednns_packed_head_only_single_rows_are_screened(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, copy_kind: str
) -> None:
    # Where oneDNN runs bf16 and neither kiln's AMX nor its AVX512-BF16 kernel serves: oneDNN's
    # packed head for two rows or more, kiln's panels for one row, so only one-row steps are
    # screened.
    monkeypatch.setattr(dense, "PACKED_DTYPES", (torch.float32, torch.bfloat16))
    monkeypatch.setattr(dense, "AMX_LINEAR", False)
    monkeypatch.setattr(dense, "DPBF16_LINEAR", False)
    monkeypatch.setattr(greedy_head, "MIN_VOCAB", 1)
    head = bf16_head(torch.randn(VOCAB, HIDDEN) * 0.05)
    assert head.packed is not None and head.panel_max_rows == 1
    screen = GreedyHead.build(head)
    assert screen is not None and screen.max_rows == 1
    for rows in (1, 2, 4):
        x = torch.randn(rows, HIDDEN).bfloat16()
        assert torch.equal(screen.argmax(x), full_argmax(head, x))
    assert (screen.screened, screen.fallbacks) == (1, 2)
    prompts = audit_prompts(tiny_llama)[:3]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = Engine.from_pretrained(tiny_llama, dtype="bfloat16", enable_prefix_caching=False)
    model = engine.runner.model
    assert model.greedy_head is not None
    alone = [engine.generate([p], greedy)[0].token_ids for p in prompts]
    assert model.greedy_head.screened > 0
    model.greedy_head = None
    assert alone == [engine.generate([p], greedy)[0].token_ids for p in prompts]


@pytest.mark.parametrize("copy_kind", ["amx", "pairs"], indirect=True)
def test_on_amx_tiles_or_pairs_rows_with_a_subnormal_run_the_full_head(
    random_head: DenseLinear, copy_kind: str
) -> None:
    screen = GreedyHead.build(random_head)
    assert screen is not None and screen.max_rows == greedy_head.MAX_ROWS
    x = torch.randn(2, HIDDEN).bfloat16()
    tiny = x.clone()
    tiny[0, 5] = 1e-39  # AMX and VDPBF16PS read a subnormal input as zero: the full head decides
    assert torch.equal(screen.argmax(tiny), full_argmax(random_head, tiny))
    assert (screen.screened, screen.fallbacks) == (0, 1)
    assert torch.equal(screen.argmax(x), full_argmax(random_head, x))
    assert screen.screened == 1
