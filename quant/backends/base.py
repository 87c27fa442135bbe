"""What a quantisation backend declares and the job it runs: one `Backend` per library,
registered with `@register_backend(...)` on the function that quantises a loaded model and
saves it, `run(job: QuantJob)`, with the function that loads the float model for it,
`load(model_dir, dtype, offload_dir, scheme)`. The declared capabilities are what
`quant.schemes.check` reads, so a refused combination names what the backend can do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.quant.spec import QuantSpec, Scheme


@dataclass(frozen=True)
class QuantJob:
    """What a backend's run function quantises (in place) and where it saves the result."""

    model: Any  # a transformers causal LM, loaded in its calibration dtype
    tokenizer: Any
    scheme: Scheme
    spec: QuantSpec
    samples: list[list[int]]  # token-id lists, already cut to max_seq_len
    out_dir: Path
    progress: Callable[[str], None]
    # Mixture of experts: calibrate every expert on every token (calibration.moe_experts:
    # all), not only on those routed to it.
    calibrate_all_experts: bool = True


# Hugging Face's shard size: what loaders expect, and what one save step holds in memory.
SHARD_SIZE = "5GB"
RunFn = Callable[[QuantJob], None]
# (model dir, dtype, offload folder, scheme) → the float model to calibrate
LoadFn = Callable[[Path, Any, Path, Scheme], Any]


def load_whole(model_dir: Path, dtype: Any, offload: Path, scheme: Scheme) -> Any:
    """The float model in `dtype`, every weight in memory (`offload` unused)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@dataclass(frozen=True)
class Backend:
    """A registered backend and the schemes, activation and KV cache modes it supports."""

    name: str
    format: str  # the checkpoint format it writes
    schemes: frozenset[str]
    activations: frozenset[str]
    kv_cache: frozenset[str]
    asymmetric: frozenset[str]  # schemes it can do with zero points
    per_channel: frozenset[str]  # grouped schemes it can also do with group_size null
    packages: tuple[str, ...]  # distributions whose versions the manifest records
    run: RunFn
    load: LoadFn = load_whole
    # Its `load` leaves the weights on disk until a layer needs them, but for the schemes in
    # `loads_whole`: the calibration holds a layer, not the model.
    offloads: bool = False
    loads_whole: frozenset[str] = frozenset()

    def offloads_for(self, scheme: str) -> bool:
        """Whether calibrating `scheme` (a scheme name) holds a layer rather than the model."""
        return self.offloads and scheme not in self.loads_whole


BACKENDS: dict[str, Backend] = {}


def register_backend(
    name: str,
    *,
    format: str,
    schemes: set[str],
    activations: set[str],
    kv_cache: set[str],
    asymmetric: set[str] = frozenset(),  # type: ignore[assignment]
    per_channel: set[str] = frozenset(),  # type: ignore[assignment]
    packages: tuple[str, ...] = (),
    load: LoadFn | None = None,
    loads_whole: frozenset[str] = frozenset(),
) -> Callable[[RunFn], RunFn]:
    """Decorator: register `fn` as the run function of backend `name`."""

    def decorate(fn: RunFn) -> RunFn:
        BACKENDS[name] = Backend(
            name=name,
            format=format,
            schemes=frozenset(schemes),
            activations=frozenset(activations),
            kv_cache=frozenset(kv_cache),
            asymmetric=frozenset(asymmetric),
            per_channel=frozenset(per_channel),
            packages=packages,
            run=fn,
            load=load or load_whole,
            offloads=load is not None,
            loads_whole=frozenset(loads_whole),
        )
        return fn

    return decorate
