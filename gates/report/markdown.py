"""Gate reports: gate.json, a Markdown summary for CI logs and PR comments, an HTML page.

The HTML report is one self-contained file (inline CSS and SVG, no scripts, no external
assets) so it can be attached to a CI run or opened offline. Every piece of model or
user text goes through `html.escape`. Hand-written: a templating engine would be a new
dependency for one page.
"""

from __future__ import annotations

from kiln.gates.decide.checks import NO_THRESHOLD, NOT_MEASURED, Check
from kiln.gates.decide.verdict import GateVerdict, TaskComparison
from kiln.gates.report.cells import (
    ENGINE_VS_RUNTIME_HEADER,
    OUTCOME_MARK,
    detects,
    engine_lines,
    engine_vs_runtime_rows,
    flipped_items,
    flips_cell,
    floor_text,
    loss_cell,
    ms,
    num,
    pct,
    points,
    rule_line,
    who,
)

MARKDOWN = "gate.md"


_OPS = {"<=": "≤", ">=": "≥"}
_CHECK_MARK = {"pass": "✅", "fail": "❌", "inconclusive": "❔", "reported": "➖",
               NOT_MEASURED: "⛔"}  # fmt: skip


def _check_state(check: Check) -> str:
    if check.outcome in ("inconclusive", NOT_MEASURED):
        return check.outcome
    if check.threshold is None and check.op != "rule":
        return "reported"
    return "pass" if check.passed else "fail"


def _check_cells(check: Check, tasks: dict[str, TaskComparison]) -> tuple[str, str]:
    """A check's value and its rule, in the units a reader compares them in."""
    if check.outcome == NOT_MEASURED:
        return "—", "measured on the engine"
    if check.op == "rule":
        task = tasks.get(check.name)
        if task is None or check.value is None or check.threshold is None:
            return num(check.value), "decision rule"
        return f"loss {points(task, check.value)}", f"loss ≤ {points(task, check.threshold)}"
    if check.threshold is None:
        return num(check.value), "reported only"
    return num(check.value), f"{_OPS.get(check.op, check.op)} {num(check.threshold)}"


def _failure(check: Check, tasks: dict[str, TaskComparison]) -> str:
    """`name value, needs threshold` for a failed check (its rule's reason for a task)."""
    value, threshold = _check_cells(check, tasks)
    if check.op == "rule" or check.outcome == NOT_MEASURED:
        return f"{check.name}: {check.detail}"
    return f"{check.name} = {value}, needs {threshold}"


def why_lines(verdict: GateVerdict) -> list[str]:
    """Why the verdict is what it is: the rule that combines the checks, the checks that
    decided it with their numbers, then every check with its value and threshold."""
    states = [_check_state(c) for c in verdict.checks]
    failed = [c for c, s in zip(verdict.checks, states, strict=True) if not c.passed]
    undecided = [c for c, s in zip(verdict.checks, states, strict=True) if s == "inconclusive"]
    gated = sum(s != "reported" for s in states)
    tasks = {f"{t.task}: {t.metric} ({t.decision.rule})": t for t in verdict.tasks}
    lines = [f"### Why it {'passes' if verdict.passed else 'fails'}", ""]
    rule = (
        "The gate passes only when every gated check passes "
        f"({gated} gated, {len(states) - gated} reported only)."
    )
    if failed:
        reasons = "; ".join(_failure(c, tasks) for c in failed)
        lines.append(f"{rule} **{len(failed)} failed**: {reasons}.")
    else:
        lines.append(f"{rule} All {gated} passed.")
    if undecided:
        counted = verdict.policy.inconclusive
        names = ", ".join(c.name for c in undecided)
        lines.append(
            f"\n**Inconclusive: {names}**, counted as {counted} (`gates.inconclusive`): the "
            "items could neither show a loss beyond the margin nor rule one out (see Why below "
            "the task table for the loss each task can detect)"
            + ("; the distribution checks decide." if counted == "pass" else ".")
        )
    lines += [
        "",
        f"**{len(verdict.checks) - len(failed)}/{len(verdict.checks)} checks passed**",
        "",
        "| | check | value | threshold | detail |",
        "|---|---|---|---|---|",
    ]
    for check, state in zip(verdict.checks, states, strict=True):
        value, threshold = _check_cells(check, tasks)
        detail = "" if check.detail == NO_THRESHOLD else check.detail.replace("|", "\\|")
        lines.append(
            f"| {_CHECK_MARK[state]} {state} | {check.name} | {value} | {threshold} | {detail} |"
        )
    return lines


def to_markdown(verdict: GateVerdict) -> str:
    """A Markdown summary: outcome, per-task table and why, divergence, shadow, failures."""
    status = "PASS ✅" if verdict.passed else "FAIL ❌"
    lines = [
        f"## kiln gate: {status}",
        "",
        f"- candidate: `{who(verdict.candidate)}`",
        f"- baseline: `{who(verdict.baseline)}`",
        f"- {rule_line(verdict)}",
        *(f"- {label}: {text}" for label, text in engine_lines(verdict)),
        "",
    ]
    if verdict.tasks:
        lines += [
            "| task | metric | baseline | candidate | recovery | Δ ± se | lower bound | "
            "flips r→w / w→r | loss [bounds] | detects | outcome | pass |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in verdict.tasks:
            d = t.decision
            lines.append(
                f"| {t.task} | {t.metric} | {num(t.baseline)} ± {num(t.baseline_stderr)} | "
                f"{num(t.candidate)} ± {num(t.candidate_stderr)} | {num(t.recovery)} | "
                f"{d.diff:+.4f} ± {num(d.diff_stderr)} | {d.lower_bound:+.4f} | {flips_cell(t)} | "
                f"{loss_cell(t)} | {detects(t)} | {OUTCOME_MARK[t.outcome]} {t.outcome} | "
                f"{'✅' if d.passed else '❌'} |"
            )
        lines += ["", "Why:", ""]
        for t in verdict.tasks:
            lines.append(f"- {t.task}: {t.decision.explanation}")
            for label, ids in flipped_items(t):
                lines.append(f"  - {label}: items {', '.join(ids)}")
        lines.append("")
    for p in verdict.perplexity:
        lines.append(
            f"- {p.task} {p.metric}: baseline {num(p.baseline, 3)}, candidate "
            f"{num(p.candidate, 3)}, ratio {num(p.ratio)}"
        )
    if verdict.divergence:
        dv = verdict.divergence
        lines.append(
            f"- KL divergence ({dv.method}, {dv.num_tokens:,} tokens): mean {dv.kl_mean:.5f}, "
            f"p99 {dv.kl_p99:.5f}, top-1 agreement {pct(dv.top1_agreement)}"
        )
    if verdict.noise_floor:
        lines.append(f"- noise floor: {floor_text(verdict.noise_floor)}")
    if verdict.shadow:
        s = verdict.shadow
        lines.append(
            f"- shadow ({s.num_requests} requests): exact match {pct(s.exact_match_rate)}, "
            f"mean shared prefix {s.mean_prefix_chars:.1f} chars, length ratio "
            f"{s.length_ratio:.3f}, format errors {pct(s.baseline_format_error_rate)} → "
            f"{pct(s.candidate_format_error_rate)} of {s.num_json_requests} JSON requests, "
            f"TTFT p50 {ms(s.baseline_latency.ttft_p50)} → {ms(s.candidate_latency.ttft_p50)}"
            + (
                f"; control ({s.control}) exact match {pct(s.control_exact_match_rate)}"
                if s.control_exact_match_rate is not None
                else ""
            )
        )
    rows = engine_vs_runtime_rows(verdict)
    if rows:
        found = verdict.engine_vs_runtime or {}
        lines += ["", f"Engine vs {found.get('runtime')}, on the candidate (reported only):", "",
                  "| " + " | ".join(ENGINE_VS_RUNTIME_HEADER) + " |",
                  "|" + "---|" * len(ENGINE_VS_RUNTIME_HEADER)]  # fmt: skip
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", *why_lines(verdict)]
    for note in verdict.notes:
        lines.append(f"\n> {note}")
    return "\n".join(lines) + "\n"
