"""A model's quantisation, resolved once: the one place a recipe's `quantization:` section (the
model's, or its draft's) becomes the `Scheme` everything downstream reads.

A published pre-quantised checkpoint (AutoAWQ, AutoGPTQ, GPTQModel) brings its own scheme,
which replaces the recipe's; otherwise the recipe's spec is checked against the model's
shapes and the backend's capabilities, and, where it calibrates, the calibration data.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.compiler.recipe.recipe import Recipe
from kiln.quant import calibration, schemes
from kiln.quant.prequantized.detect import PreQuantized, check_recipe
from kiln.quant.prequantized.detect import detect as detect_prequantized
from kiln.quant.spec import CalibrationSpec, QuantSpec, Scheme
from kiln.runtime.base.errors import PreflightError
from kiln.runtime.formats.model_info import ModelInfo


@dataclass(frozen=True, slots=True)
class ResolvedScheme:
    """What a quantization section resolved to: the scheme (None while it has problems), a
    pre-quantised checkpoint it imports, and every problem, formatted for the recipe."""

    scheme: Scheme | None  # None: the spec names no scheme at all
    imported: PreQuantized | None
    problems: list[str]
    usable: bool  # the scheme has no problem of its own (shapes, backend): plan with it


def resolve_scheme(
    recipe: Recipe,
    spec: QuantSpec,
    info: ModelInfo | None,
    calib: CalibrationSpec,
    *,
    key: str = "quantization",
    detect: bool = True,
) -> ResolvedScheme:
    """Resolve `spec` for the model `info` (None: its source did not resolve, so only the
    spec itself is checked); `key` is where the section sits in the recipe, `detect` whether
    to look for a pre-quantised checkpoint (not in a model of an unsupported architecture)."""
    problems: list[str] = []

    def add(problem_key: str, problem: str, allowed: str) -> None:
        problems.append(recipe.problem(key + problem_key.removeprefix("quantization"), problem,
                                       allowed))  # fmt: skip

    imported = detect_prequantized(info.config) if detect and info is not None else None
    if imported is not None:  # a published AWQ/GPTQ checkpoint ships its own scheme
        for p in check_recipe(spec, imported):
            add(p.key, p.problem, p.allowed)
        spec = imported.to_spec()
    scheme_problems = schemes.check(spec, info)
    for p in scheme_problems:
        add(p.key, p.problem, p.allowed)
    try:
        scheme: Scheme | None = schemes.resolve(spec)
    except PreflightError:  # check() said why, above
        scheme = None
    if imported is None and not scheme_problems and scheme is not None and scheme.needs_calibration:
        problems += [recipe.problem(p.key, p.problem, p.allowed) for p in calibration.check(calib)]
    return ResolvedScheme(scheme, imported, problems, not scheme_problems)
