"""How many calibration tokens the router sends to each expert of a mixture-of-experts model.

An expert that receives few or no calibration tokens gets scales from almost nothing (GPTQ's
Hessian is empty, static activation scales are zero): GPTQModel added "FailSafe" handling for
it, and llm-compressor calibrates every expert on every token by default
(`moe_calibrate_all_experts`). kiln counts the routing on the float model before quantising,
with a forward hook on each router, so the report lists the starved experts and the recipe's
`calibration.moe_experts` decides: `all` (every expert calibrated on every token, where the
backend can), `warn` (routed tokens only; starved experts reported) or `fail` (routed tokens
only; a starved expert stops the compile, exit 2). Hand-written: no library reports it.
"""

from __future__ import annotations

from typing import Any

from kiln.runtime.formats.model_info import ModelInfo

MOE_EXPERTS = ("all", "warn", "fail")


def routed_tokens(model: Any, info: ModelInfo, samples: list[list[int]]) -> dict[int, list[int]]:
    """Sparse layer → tokens routed to each of its experts (top-k choices counted) over
    `samples`, from one forward pass of the float `model`."""
    import torch

    moe = info.moe
    assert moe is not None
    counts = {i: torch.zeros(info.num_experts, dtype=torch.int64)
              for i in range(info.num_layers) if info.is_sparse(i)}  # fmt: skip

    def hook(layer: int) -> Any:
        def count(_module: Any, _inputs: Any, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            chosen = logits.reshape(-1, info.num_experts).topk(info.num_experts_per_tok).indices
            counts[layer] += torch.bincount(chosen.flatten(), minlength=info.num_experts)

        return count

    def router(layer: int) -> Any:
        # transformers 5 names every family's sparse block `mlp` in memory (Mixtral's
        # checkpoint still says block_sparse_moe).
        for block in dict.fromkeys((moe.block, "mlp")):
            try:
                return model.get_submodule(f"model.layers.{layer}.{block}.{moe.router}")
            except AttributeError:
                continue
        raise AttributeError(f"no router module in layer {layer} of {info.architecture}")

    handles = [router(i).register_forward_hook(hook(i)) for i in counts]
    try:
        with torch.no_grad():
            for ids in samples:
                model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return {layer: c.tolist() for layer, c in counts.items()}


def routing_report(
    counts: dict[int, list[int]], info: ModelInfo, minimum: int, policy: str
) -> dict[str, Any]:
    """The report's `moe_routing`: tokens per expert per layer, and the experts that got
    fewer than `minimum` (by module name, with their count)."""
    assert info.moe is not None
    starved = [
        {"expert": f"model.layers.{layer}.{info.moe.block}.experts.{e}", "tokens": n}
        for layer, per_expert in sorted(counts.items())
        for e, n in enumerate(per_expert)
        if n < minimum
    ]
    return {
        "policy": policy,
        "min_tokens": minimum,
        "tokens_per_expert": {str(layer): c for layer, c in sorted(counts.items())},
        "starved": starved,
    }


def starved_problem(report: dict[str, Any]) -> str | None:
    """What `moe_experts: fail` refuses: the starved experts, named (None if there are none)."""
    starved = report["starved"]
    if not starved:
        return None
    shown = ", ".join(f"{s['expert']} ({s['tokens']} tokens)" for s in starved[:6])
    more = f" and {len(starved) - 6} more" if len(starved) > 6 else ""
    return (
        f"calibration.moe_experts: fail: {len(starved)} expert(s) were routed fewer than "
        f"{report['min_tokens']} calibration tokens: {shown}{more} — add calibration text "
        "(calibration.num_samples, another dataset), or set calibration.moe_experts: all to "
        "calibrate every expert on every token"
    )
