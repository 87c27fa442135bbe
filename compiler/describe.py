"""`kiln inspect`: a human-readable view of an artifact's manifest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kiln.runtime.artifact import QUANT_REPORT, Manifest

MIB = 1 << 20


def _sizes_by_top(manifest: Manifest) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for rel, entry in manifest.files.items():
        top = rel.split("/", 1)[0]
        sizes[top] = sizes.get(top, 0) + int(entry["size"])
    return sizes


def describe(manifest: Manifest, path: Path, console: Console) -> None:
    """Print name, digest, source, scheme, stages, sizes, report summary and targets."""
    scheme = manifest.scheme
    console.print(f"[bold]{manifest.name}[/]  {path}")
    console.print(f"digest   sha256:{manifest.digest}")
    console.print(f"created  {manifest.created_at}")
    source = manifest.source
    console.print(
        f"source   {source.get('spec')} ({source.get('architecture')}, "
        f"{source.get('parameters', 0) / 1e6:.1f}M parameters, "
        f"sha256:{str(source.get('digest', ''))[:12]})"
    )
    console.print(
        f"scheme   {scheme.get('scheme', scheme.get('name', '?'))} via "
        f"{scheme.get('backend', '?')} ({scheme.get('format', '?')})"
    )
    console.print("tools    " + ", ".join(f"{k} {v}" for k, v in sorted(manifest.tools.items())))

    sizes = Table(title="files", title_justify="left")
    sizes.add_column("folder")
    sizes.add_column("MiB", justify="right")
    for top, size in sorted(_sizes_by_top(manifest).items()):
        sizes.add_row(top, f"{size / MIB:.1f}")
    console.print(sizes)

    stages = Table(title="stages", title_justify="left")
    for column in ("stage", "status", "seconds"):
        stages.add_column(column)
    for name, entry in manifest.stages.items():
        stages.add_row(name, str(entry.get("status")), f"{float(entry.get('seconds', 0)):.1f}")
    console.print(stages)

    report_path = path / QUANT_REPORT
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        summary = {k: v for k, v in report.items() if isinstance(v, (int, float, str))}
        console.print(
            "report   "
            + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()
            )
        )
    if manifest.targets:
        targets = Table(title="targets (TensorRT-LLM)", title_justify="left")
        for column in ("target", "tp", "engine (1.2.x)", "pytorch backend"):
            targets.add_column(column)
        for name, entry in manifest.targets.items():
            targets.add_row(name, str(entry.get("tp_size", "")), str(entry.get("engine")),
                            str(entry.get("pytorch")))  # fmt: skip
        console.print(targets)
    speculative = manifest.extra.get("speculative")
    if isinstance(speculative, dict):
        describe_speculative(speculative, console)
    if manifest.gate:
        console.print(f"gate     {manifest.gate.get('verdict', manifest.gate)}")


def describe_speculative(section: dict[str, Any], console: Console) -> None:
    """The manifest's `speculative` section: method, draft, K and how it was chosen."""
    k = section.get("max_draft_len")
    if section.get("method") == "ngram":
        console.print(
            f"speculative  ngram (prompt lookup), K={k}, "
            f"max_matching_ngram_size {section.get('max_matching_ngram_size')}"
        )
        return
    console.print(
        f"speculative  draft {section.get('draft')}/ ({section.get('draft_source')}, "
        f"{section.get('draft_scheme')}, sha256:{str(section.get('draft_digest'))[:12]}), "
        f"K={k} ({section.get('chosen_by')})"
    )
    if section.get("alpha") is not None:
        per_position = ", ".join(f"{a:.2f}" for a in section.get("alpha_per_position") or [])
        where = section.get("measured_on") or {}
        console.print(
            f"             alpha {section['alpha']:.3f} (per position: {per_position}), "
            f"cost ratio c {section.get('cost_ratio', 0):.3f}, expected speedup "
            f"{section.get('expected_speedup', 0):.2f}x, measured on "
            f"{where.get('device', '?')} ({where.get('name', '?')}, "
            f"{where.get('threads', '?')} threads)"
        )
        if section.get("pays") is False:
            console.print(
                "             [bold]speculation does not pay on that device[/]: no K "
                "beats plain decoding at this acceptance and cost ratio"
            )
