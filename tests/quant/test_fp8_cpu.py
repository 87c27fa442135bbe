"""kiln's CPU rounding of FP8 weights gives compressed-tensors' own codes, bit for bit."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.utils import calculate_range
from compressed_tensors.utils.impl_backend import ImplBackend

from kiln.quant.backends import fp8_cpu

FP8 = torch.float8_e4m3fn


def _args(strategy: str = "tensor", kind: str = "float", bits: int = 8) -> QuantizationArgs:
    return QuantizationArgs(num_bits=bits, type=kind, strategy=strategy, symmetric=True)


def _weight(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows with every special value a float8 cast meets."""
    torch.manual_seed(rows * 31 + cols)
    w = torch.randn(rows, cols) * torch.logspace(-12, 4, cols)
    nan, inf = float("nan"), float("inf")
    specials = [nan, inf, -inf, 0.0, -0.0, 1e-30, -1e-30, 448.0, -448.0, 449.0, 464.0, 1e6,
                -1e6, 2.0**-9, 2.0**-10, 3 * 2.0**-11]  # fmt: skip
    flat = w.view(-1)
    flat[: len(specials)] = torch.tensor(specials)
    flat[-len(specials) :] = -torch.tensor(specials)
    return w.to(dtype)


def _library(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors' own eager `_quantize`, as it runs without kiln's backend."""
    args = _args()
    low, high = calculate_range(args, x.device)
    return ImplBackend.call("_quantize", x=x, scale=scale, zero_point=zero, q_min=low,
                            q_max=high, args=args, dtype=FP8)  # fmt: skip


def _kiln(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    args = _args()
    low, high = calculate_range(args, x.device)
    kwargs = dict(x=x, scale=scale, zero_point=zero, q_min=low, q_max=high, args=args, dtype=FP8)
    assert fp8_cpu.covers(**kwargs)
    return fp8_cpu.round_fp8_cpu(**kwargs)


def _same_codes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == FP8 and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per", ["tensor", "row", "tensor-0d"])
@pytest.mark.parametrize("zero", [False, True])
def test_codes_are_the_librarys(dtype: torch.dtype, per: str, zero: bool, monkeypatch) -> None:
    monkeypatch.setattr(fp8_cpu, "BLOCK_BYTES", 4 * 96)  # blocks of a few rows, the last short
    x = _weight(37, 64, dtype)
    finite = x.float().nan_to_num(0, 0, 0).abs()
    if per == "row":
        scale = (finite.amax(dim=1, keepdim=True) / 448).clamp_min(1e-8)
    else:
        scale = (finite.amax() / 448).reshape(1 if per == "tensor" else ())
    scale = scale.to(dtype if per == "tensor-0d" else torch.float32)
    zero_point = torch.zeros_like(scale, dtype=FP8) if zero else None
    _same_codes(_kiln(x, scale, zero_point), _library(x, scale, zero_point))


def test_quantize_dispatches_to_kiln_once_registered(monkeypatch) -> None:
    """compressed-tensors' public `quantize` (what its compressor calls at save) reaches kiln's
    rounding after `register`, and gives the same codes as without it."""
    called: list[int] = []
    real = fp8_cpu.round_fp8_cpu

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        called.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    fp8_cpu.register()
    fp8_cpu.register()  # once per process, however often asked
    entries = [e for e in ImplBackend._backends["_quantize"] if e[1] is fp8_cpu.covers]
    assert len(entries) == 1
    x = _weight(300, 256, torch.bfloat16)
    scale = (x.float().nan_to_num(0, 0, 0).abs().amax() / 448).reshape(1)
    args = _args()
    ours = quantize(x=x, scale=scale, zero_point=None, args=args, dtype=FP8)
    _same_codes(ours, _library(x, scale, None))
    monkeypatch.setattr(ImplBackend, "_backends", {
        k: [(counted if f is real else f, r, p) for f, r, p in v]
        for k, v in ImplBackend._backends.items()})  # fmt: skip
    quantize(x=x, scale=scale, zero_point=None, args=args, dtype=FP8)
    assert called == [1]


@pytest.mark.parametrize(
    "case",
    ["int8", "group", "no-dtype", "global-scale", "3-d", "column-scale", "fp4"],
)
def test_other_calls_are_left_to_the_library(case: str) -> None:
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    scale = torch.tensor([0.01])
    kwargs: dict = dict(x=x, scale=scale, zero_point=None, args=_args(), dtype=FP8)
    if case == "int8":
        kwargs.update(args=_args(kind="int"), dtype=torch.int8)
    elif case == "group":
        kwargs.update(x=x.unflatten(-1, (2, 8)), scale=torch.full((8, 2, 1), 0.01))
    elif case == "no-dtype":
        kwargs.update(dtype=None)
    elif case == "global-scale":
        kwargs.update(global_scale=torch.tensor([2.0]))
    elif case == "3-d":
        kwargs.update(x=x[None])
    elif case == "column-scale":
        kwargs.update(scale=torch.full((1, 16), 0.01))
    elif case == "fp4":
        kwargs.update(args=_args(bits=4))
    low, high = calculate_range(kwargs["args"], x.device)
    assert not fp8_cpu.covers(q_min=low, q_max=high, **kwargs)
