"""`kiln draft TARGET`: make a speculative-decoding draft (compiler/draft/make.py) and show
what it measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from kiln.compiler.cli.consoles import console
from kiln.compiler.cli.exits import handle_errors
from kiln.compiler.cli.options import JSON_OPTION, old_spellings
from kiln.compiler.draft.make import DraftOptions, DraftReport, make_draft


def format_report(report: DraftReport) -> list[tuple[str, str]]:
    """The report as (label, value) rows for a table."""
    rows = [
        ("draft", report.path),
        ("target", report.target),
        ("layers", f"{report.layers} of {report.target_layers}"),
        ("parameters", f"{report.parameters / 1e6:.1f}M of {report.target_parameters / 1e6:.1f}M"),
        ("distill steps", str(report.distill_steps)),
    ]
    if report.kl_before is not None:
        rows.append(
            (
                "KL(target‖draft)",
                f"{report.kl_before:.4f} → {report.kl_after:.4f} "
                f"({report.seconds_distilling:.0f} s distilling)",
            )
        )
    a = report.acceptance
    if a:
        per_position = " ".join(f"{x:.2f}" for x in a["alpha_per_position"])
        rows += [
            ("acceptance α", f"{a['alpha']:.3f}"),
            ("α per position", per_position),
            (
                "cost ratio c",
                f"{a['cost_ratio']:.3f} ({a['draft_ms_per_token']:.1f} / "
                f"{a['target_ms_per_token']:.1f} ms per token, this CPU)",
            ),
            ("best K", str(a["best_k"])),
            ("formula speedup", f"{a['expected_speedup']:.2f}×"),
            (
                "measured speedup",
                f"{a['measured_speedup']:.2f}× ({a['plain_tokens_per_s']:.1f} → "
                f"{a['speculative_tokens_per_s']:.1f} tokens/s, this CPU)"
                + ("" if a["measured_speedup"] > 1 else " — speculation slows decoding down"),
            ),
        ]
    return rows


# Old spellings keep working, unlisted: --prompts (now --num-prompts), --out (--output).
@click.command(name="draft", context_settings=old_spellings({"prompts": "num-prompts",
                                                            "out": "output"}))  # fmt: skip
@click.argument("target")
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    help="Decoder layers to keep (default: a sixth of the target's).",
)
@click.option(
    "--distill-steps",
    type=click.IntRange(min=0),
    default=DraftOptions.distill_steps,
    show_default=True,
    help="Batches of KL distillation on the target's outputs (0: a plain cut).",
)
@click.option(
    "--dataset",
    default="builtin:licenses",
    show_default=True,
    help="Distillation and measurement text (a calibration dataset).",
)
@click.option(
    "--seq-len",
    type=click.IntRange(min=16),
    default=DraftOptions.seq_len,
    show_default=True,
    help="Tokens per distillation and measurement sequence.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Sequences per distillation step.",
)
@click.option(
    "--lr",
    "learning_rate",
    type=click.FloatRange(min=0, min_open=True),
    default=DraftOptions.learning_rate,
    show_default=True,
    help="Distillation learning rate (AdamW).",
)
@click.option(
    "--num-prompts",
    "prompts",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="How many held-out prompts to measure acceptance on.",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=4),
    default=32,
    show_default=True,
    help="Tokens generated per prompt while measuring acceptance.",
)
@click.option(
    "--max-k",
    type=click.IntRange(1, 16),
    default=8,
    show_default=True,
    help="Largest number of draft tokens per step (K) the measurement tries.",
)
@click.option("--no-measure", is_flag=True, help="Skip the acceptance measurement.")
@click.option(
    "--output",
    "out",
    type=click.Path(path_type=Path),
    help="Output directory (default: ./<target name>-draft[-<N>l]).",
)
@JSON_OPTION
@handle_errors
def draft_command(
    target: str, no_measure: bool, out: Path | None, as_json: bool, **options: Any
) -> None:
    """Make a speculative-decoding draft of TARGET (a model source) and measure it.

    The draft keeps TARGET's first layers, final norm and head (so its tokenizer), is
    optionally distilled on TARGET's outputs, and is written as a Hugging Face directory to
    use as `speculative.draft` in a recipe.

    \b
    Example:
      kiln draft builtin:smollm2-135m-instruct --layers 6 --output smollm2-draft
    """
    from rich.table import Table

    err = console(stderr=True)
    settings = DraftOptions(**options, measure=not no_measure)
    if out is None:
        name = Path(target.removeprefix("builtin:")).name.removesuffix(".gguf") or "model"
        out = Path(f"{name}-draft" + (f"-{settings.layers}l" if settings.layers else ""))
    with err.status("starting") as status:
        report = make_draft(target, out, settings, progress=status.update)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    table = Table(title=f"kiln draft {target}", title_justify="left", show_header=False)
    table.add_column()
    table.add_column()
    for label, value in format_report(report):
        table.add_row(label, value)
    console().print(table)
