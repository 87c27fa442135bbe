"""Human-readable views: an artifact's manifest (`kiln inspect`), a target's capacity plan and
the disk a compile needs (`kiln plan`, `kiln validate`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kiln.compiler.disk import MARGIN, DiskEstimate, human, needed
from kiln.compiler.trtllm.capacity import GiB, Plan
from kiln.runtime.formats.artifact import QUANT_REPORT, Manifest, SpeculativeRecord

MIB = 1 << 20


def _sizes_by_top(manifest: Manifest) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for rel, entry in manifest.files.items():
        top = rel.split("/", 1)[0]
        sizes[top] = sizes.get(top, 0) + entry.size
    return sizes


def describe(manifest: Manifest, path: Path, console: Console) -> None:
    """Print name, digest, source, scheme, stages, sizes, report summary and targets."""
    scheme = manifest.scheme
    console.print(f"[bold]{manifest.name}[/]  {path}")
    console.print(f"digest   sha256:{manifest.digest}")
    console.print(f"created  {manifest.created_at}")
    source = manifest.source
    if source is not None:
        console.print(
            f"source   {source.spec} ({source.architecture}, "
            f"{source.parameters / 1e6:.1f}M parameters, sha256:{source.digest[:12]})"
        )
    if scheme is not None:
        console.print(f"scheme   {scheme.label} via {scheme.backend} ({scheme.format})")
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
    for name, stage in manifest.stages.items():
        stages.add_row(name, stage.status, f"{stage.seconds:.1f}")
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
        for name, target in manifest.targets.items():
            targets.add_row(name, str(target.tp_size), target.engine, target.pytorch)
        console.print(targets)
    if manifest.speculative is not None:
        describe_speculative(manifest.speculative, console)
    if manifest.gate is not None:
        gate = manifest.gate
        verdict = "PASS" if gate.passed else "FAIL (" + ", ".join(gate.failed_checks) + ")"
        console.print(f"gate     {verdict} against {gate.baseline.get('name')}; {gate.reports}")


def describe_speculative(section: SpeculativeRecord, console: Console) -> None:
    """The manifest's `speculative` section: method, draft, K and how it was chosen."""
    k = section.max_draft_len
    if section.method == "ngram":
        console.print(
            f"speculative  ngram (prompt lookup), K={k}, "
            f"max_matching_ngram_size {section.max_matching_ngram_size}"
        )
        return
    console.print(
        f"speculative  draft {section.draft}/ ({section.draft_source}, {section.draft_scheme}, "
        f"sha256:{str(section.draft_digest)[:12]}), K={k} ({section.chosen_by})"
    )
    if section.alpha is not None:
        per_position = ", ".join(f"{a:.2f}" for a in section.alpha_per_position)
        where = section.measured_on
        console.print(
            f"             alpha {section.alpha:.3f} (per position: {per_position}), "
            f"cost ratio c {section.cost_ratio or 0:.3f}, formula speedup "
            f"{section.expected_speedup or 0:.2f}x, measured on "
            f"{where.get('device', '?')} ({where.get('name', '?')}, "
            f"{where.get('threads', '?')} threads)"
        )
        if section.measured_speedup is not None:
            console.print(
                f"             measured speedup {section.measured_speedup:.2f}x "
                f"({section.plain_tokens_per_s or 0:.1f} → "
                f"{section.speculative_tokens_per_s or 0:.1f} tokens/s single stream)"
            )
        if section.pays is False:
            console.print(
                "             [bold]speculation does not pay on that device[/]: decoding "
                "with the draft was timed slower than without it"
            )


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB"


def format_plan(plan: Plan) -> str:
    """A plain-text table of a plan, for `kiln plan` and logs."""
    d = plan.deploy
    kv = plan.kv_cache_quant_algo or "bf16"
    rows = [
        ("target", f"{plan.target} × {plan.num_gpus} (tp={plan.tp_size}, pp={plan.pp_size})"),
        ("scheme", f"{plan.quant_algo}, KV {kv}"),
        ("fits", "yes" if plan.fits else "NO"),
        ("GPU memory", _gib(plan.memory_bytes_per_gpu)),
        ("weights (all GPUs)", _gib(plan.weight_bytes)),
        ("weights per GPU", _gib(plan.weight_bytes_per_gpu)),
        ("activations + runtime per GPU", _gib(plan.reserve_bytes_per_gpu)),
        (f"KV cache per GPU (× {d.kv_free_fraction})", _gib(plan.kv_cache_bytes_per_gpu)),
        ("KV per token (model)", f"{plan.kv_bytes_per_token:,} B"),
        (f"KV per request at {d.max_seq_len} tokens", _gib(plan.kv_bytes_per_request)),
        (f"sequences at {d.max_seq_len} tokens", f"{plan.max_concurrent_sequences:,}"),
        ("recommended max_batch_size", str(plan.recommended_max_batch_size)),
        ("recommended max_num_tokens", str(plan.recommended_max_num_tokens)),
        ("decode bound, batch 1", f"{plan.decode_tokens_per_s_bound:,.0f} tokens/s"),
    ]
    if plan.cost_per_million_output_tokens is not None:
        rows.append(("cost", f"${plan.cost_per_million_output_tokens:,.3f} per M output tokens"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"suggestion: {s}" for s in plan.suggestions]
    return "\n".join(lines)


def _free(disk: DiskEstimate) -> str:
    if disk.same_filesystem:
        return f"{human(disk.free_output)} free on the filesystem of {disk.output}"
    return (f"{human(disk.free_output)} free for the artifact in {disk.output}, "
            f"{human(disk.free_cache)} for the stage cache in {disk.cache_dir}")  # fmt: skip


def disk_summary(disk: DiskEstimate) -> str:
    """One line: what the compile writes, where, and the room there (`kiln validate`)."""
    cached = disk.cached
    what = f"{len(cached)} cached stage(s) reused" if cached else "a fresh compile"
    return (
        f"disk: {what} keeps about {human(disk.total)} (stage cache {human(disk.cache_bytes)}, "
        f"artifact {human(disk.artifact_bytes)}) and needs {human(needed(disk.peak))} at its "
        f"peak ({MARGIN:.0%} margin included); {_free(disk)}"
    )


def format_disk(disk: DiskEstimate) -> str:
    """A plain-text table of what each stage and the artifact write (`kiln plan`)."""
    same = disk.same_filesystem
    rows = [("", "", "keeps", "while running", "")]
    for part in disk.parts:
        size, note = human(part.bytes), part.note
        if part.where == "link":
            how = "no new bytes (same filesystem)" if same else "copied (another filesystem)"
            size, note = (human(0) if same else size), f"{note} ({human(part.bytes)}): {how}"
        where = "stage cache" if part.where == "cache" else "artifact"
        scratch = f"+{human(part.scratch)}" if part.scratch and not part.cached else ""
        rows.append((part.name, where, "cached" if part.cached else size, scratch, note))
    rows.append(("total", "", human(disk.total), "", ""))
    margin = f"{human(needed(disk.peak))} with the {MARGIN:.0%} margin"
    rows.append(("peak", "", human(disk.peak), "", margin))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"stage cache {disk.cache_dir}; artifact under {disk.output}"]
    for name, where, size, scratch, note in rows:
        cells = f"{name.ljust(widths[0])}  {where.ljust(widths[1])}  {size.rjust(widths[2])}"
        lines.append(f"{cells}  {scratch.rjust(widths[3])}  {note}".rstrip())
    lines.append(f"free: {_free(disk)}")
    if disk.reclaimable:
        lines.append(f"note: {human(disk.reclaimable)} that killed runs left is removed first")
    lines += [f"problem: {p}" for p in disk.problems()]
    return "\n".join(lines)


def stage_plan(disk: DiskEstimate, draft: bool, auto_k: bool, force: bool) -> list[dict[str, Any]]:
    """What `kiln compile` would do, stage by stage (`kiln compile --dry-run`): each stage's
    status (`runs`, `cached`, or `unknown` where its key needs what the draft's stages
    produce), the bytes it keeps and those it writes only while running (the disk estimate's).
    """
    later = "runs" if force else "unknown"
    why = "keyed by what the draft's stages produce: known once they have run"

    def row(stage: str, status: str, nbytes: int, scratch: int, note: str) -> dict[str, Any]:
        cached = status == "cached"
        return {"stage": stage, "status": status, "bytes": 0 if cached else nbytes,
                "scratch_bytes": 0 if cached else scratch, "note": note}  # fmt: skip

    rows = []
    for part in disk.parts:
        if part.where != "cache":
            continue
        nested = draft and part.name.endswith("-package")  # its key is not looked up
        status = "cached" if part.cached else later if nested else "runs"
        rows.append(row(part.name, status, part.bytes, part.scratch, part.note))
    if auto_k:
        rows.append(row("acceptance", later, 0, 0, f"measures the draft's K; {why}"))
    published = any(p.cached for p in disk.parts if p.where != "cache")
    status = "cached" if published else later if draft else "runs"
    note = why if status == "unknown" else "the artifact: stage outputs linked, manifest, reports"
    rows.append(row("package", status, disk.artifact_bytes, 0, note))
    return rows


def format_stage_plan(rows: list[dict[str, Any]]) -> str:
    """`stage_plan` as plain-text lines, one a stage."""
    table = [("stage", "status", "writes", "scratch", "")]
    for row in rows:
        writes = human(row["bytes"]) if row["status"] != "cached" else "-"
        scratch = f"+{human(row['scratch_bytes'])}" if row["scratch_bytes"] else ""
        table.append((row["stage"], row["status"], writes, scratch, row["note"]))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    return "\n".join(
        f"{a.ljust(widths[0])}  {b.ljust(widths[1])}  {c.rjust(widths[2])}  "
        f"{d.rjust(widths[3])}  {note}".rstrip()
        for a, b, c, d, note in table
    )
