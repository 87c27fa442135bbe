"""Exact greedy tokens from a bf16 LM head while reading about half of its bytes (CPU).

A greedy decode step without log-probabilities needs only each row's argmax. At a few rows the
step is bound by the bytes it reads, and SmolLM2-135M's bf16 LM head (49,152 x 576, 57 MB) is
about a third of them (half of a W4A16 step's). `GreedyHead` keeps an int8 copy of the head
(per-row scale max|w| / 127) and, per step:

1. approx = the int8 copy's logits (runtime/engine/native/csrc/int8_screen.cpp);
2. each logit's exact value lies within `bound` of approx: |x|_1 times the row's largest
   rounding error of the copy, plus what float32 summation of K terms can lose on either side,
   plus margins for the float32 arithmetic of the bound itself;
3. a token n can be the argmax only if upper_n = approx_n + bound_n, rounded as the layer
   rounds its output (bfloat16), reaches max_m(approx_m - bound_m) rounded the same way:
   rounding is monotone, so every other token's rounded exact logit is strictly below the
   rounded exact logit of the token that attains that floor;
4. the candidates' logits are recomputed by the bf16 layer's own kernel (kiln's panels: the
   same sequential float32 sum over k for any tile; kiln's AMX tiles: the same tile sums of
   the candidate's 32 columns as any call's; kiln's AVX512-BF16 pairs: the same VDPBF16PS per
   pair of k, in order, on the candidate's 16 columns; each way bit-identical to the full
   head's), and the argmax over them, ties to the lowest index, is the full head's argmax.

Where the screen cannot decide cheaply (a non-finite input or logit, or more than
`MAX_CANDIDATES` candidates), the full head runs. The engine asks for it only on steps whose
rows all sample greedily without log-probabilities (model_runner.py).

The summation bound allows twice the usual float32 loss for the head's own sum: AMX's
documentation does not pin down the order and rounding of its k-chunk sums (measured: not
the sequential sum), and 2 gamma_K covers any order rounding to nearest or towards zero.

Hand-written: no library screens a vocabulary projection with a bound. Applies to a bf16
head that holds kiln's panels (`DenseLinear` on CPUs with AVX2: the only copy without native
bf16), kiln's AMX tiles (CPUs with AMX) or kiln's pairs (CPUs with AVX512-BF16 but no AMX;
an even K): rows up to `MAX_ROWS` are screened, the full head runs on the same copy up to
its few-row limit. Elsewhere the head runs whole.
"""

from __future__ import annotations

import torch

from kiln.runtime.engine.allocator import in_huge_pages
from kiln.runtime.engine.layers import dense
from kiln.runtime.engine.layers.dense import DenseLinear
from kiln.runtime.engine.layers.linear import Linear
from kiln.runtime.engine.sampling import greedy_tokens

PANEL = 64  # output columns per panel, as in bf16_linear.cpp and int8_screen.cpp
MAX_ROWS = 4  # int8_screen's tile
MAX_CANDIDATES = 512  # beyond this, the full head is cheaper than the recomputation
MIN_VOCAB = 4096  # below it the head is too small to be worth a second copy
MAX_K = 8192  # the bound's margins assume K * 2^-24 well under 2^-10
# Enabled where it applies (False: every greedy step runs the full head, for comparison).
ENABLED = True


def _unpack_bf16(panels: torch.Tensor, rows: int) -> torch.Tensor:
    """The [rows, K] weight `bf16_pack` stored as [P, K, 64] (columns interleaved per 16)."""
    count, k = panels.shape[0], panels.shape[1]
    return panels.view(count, k, 4, 8, 2).permute(0, 2, 4, 3, 1).reshape(count * PANEL, k)[:rows]


def _unpack_pairs(pairs: torch.Tensor, rows: int) -> torch.Tensor:
    """The [rows, K] weight `dpbf16_pack` stored as [P, K / 2, 64, 2] (K even)."""
    count, half = pairs.shape[0], pairs.shape[1]
    return pairs.permute(0, 2, 1, 3).reshape(count * PANEL, half * 2)[:rows]


def _unpack_amx(tiles: torch.Tensor, rows: int) -> torch.Tensor:
    """The [rows, K] weight `amx_pack` stored as [pairs, chunks, 2, 16, 16, 2] (K a multiple
    of 32)."""
    pairs, chunks = tiles.shape[0], tiles.shape[1]
    return tiles.permute(0, 2, 4, 1, 3, 5).reshape(pairs * 32, chunks * 32)[:rows]


class GreedyHead:
    """The int8 screen of one bf16 LM head, and the exact argmax it leads to."""

    CHUNK = 4096  # rows converted to float64 at a time while building the copy

    def __init__(self, head: DenseLinear) -> None:
        assert head.bias is None
        self.head = head
        self.vocab = head.out_features
        # the full head's own copy, which the candidates are recomputed from
        if head.amx is not None:
            self.weight, weight = head.amx, _unpack_amx(head.amx, self.vocab)
        elif head.pairs is not None:
            self.weight, weight = head.pairs, _unpack_pairs(head.pairs, self.vocab)
        else:
            assert head.panels is not None
            self.weight, weight = head.panels, _unpack_bf16(head.panels, self.vocab)
        k = weight.shape[1]
        # float32 summation of K products can lose gamma_K * sum |x_k w_k| <= |x|_1 max|w|
        gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
        self.scale = torch.empty(self.vocab)
        self.slack = torch.empty(self.vocab)
        codes = torch.zeros((-(-self.vocab // PANEL) * PANEL, k), dtype=torch.int8)
        for begin in range(0, self.vocab, self.CHUNK):  # float64 a chunk at a time
            end = min(begin + self.CHUNK, self.vocab)
            w = weight[begin:end].double()
            if not bool(torch.isfinite(w).all()):
                raise ValueError("the LM head holds a non-finite weight: no bound holds")
            peak = w.abs().amax(dim=1)
            scale = torch.where(peak > 0, peak / 127, torch.ones_like(peak)).float().double()
            q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127)
            # The copy's largest error in the row, plus the summation losses of both sides
            # (twice for the head's, see above, once more for the screen's own arithmetic),
            # rounded up.
            error = (w - q * scale.unsqueeze(1)).abs().amax(dim=1)
            self.slack[begin:end] = ((error + 4 * gamma * peak) * (1 + 2.0**-20)).float()
            self.scale[begin:end] = scale.float()
            codes[begin:end] = q.to(torch.int8)
        self.panels = in_huge_pages(codes.view(-1, PANEL, k).transpose(1, 2).contiguous())
        # Rows it screens: those the full head runs on the same copy (panels: one beside
        # oneDNN's packed weight), so the recomputed candidates are the full head's own logits.
        if head.amx is not None:
            held_rows = dense.AMX_MAX_ROWS
        elif head.pairs is not None:
            held_rows = head.pair_max_rows
        else:
            held_rows = head.panel_max_rows
        self.max_rows = min(MAX_ROWS, held_rows)
        self.screened = 0  # steps decided by the screen (tests and benchmarks read these)
        self.fallbacks = 0

    @classmethod
    def build(cls, head: Linear) -> GreedyHead | None:
        """The screen of `head` where it applies and its weights are finite, else None."""
        if not cls.applies(head):
            return None
        assert isinstance(head, DenseLinear)
        try:
            return cls(head)
        except ValueError:
            return None

    @staticmethod
    def applies(head: Linear) -> bool:
        if not ENABLED or not isinstance(head, DenseLinear) or head.bias is not None:
            return False
        # on AMX tiles or pairs the screen reads x as they do: K needs no padding
        amx = head.amx is not None and head.in_features % 32 == 0
        pairs = head.pairs is not None and head.in_features % 2 == 0  # K as pairs, unpadded
        held = amx or pairs or head.panels is not None
        return held and head.out_features >= MIN_VOCAB and head.in_features <= MAX_K

    def weight_bytes(self) -> int:
        return self.panels.nbytes + self.scale.nbytes + self.slack.nbytes

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of the head's logits (first index among equals, NaN first)."""
        if x.shape[0] <= self.max_rows:
            tokens = self._screened(x)
            if tokens is not None:
                self.screened += 1
                return tokens
        self.fallbacks += 1
        return greedy_tokens(self.head(x))

    def _screened(self, x: torch.Tensor) -> torch.Tensor | None:
        tokens = torch.ops.kiln.int8_greedy(
            x, self.panels, self.scale, self.slack, self.weight, self.vocab, MAX_CANDIDATES
        )
        return tokens if tokens.numel() else None
