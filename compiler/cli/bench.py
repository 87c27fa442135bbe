"""`kiln bench URL`: load an OpenAI-compatible server and report latency and throughput.

Exit codes: 0 done (failed requests are counted in the
report, not fatal), 2 usage error (bad options, or no server at URL), 3 every request failed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Group
from rich.table import Table

from kiln.compiler.cli.consoles import console
from kiln.compiler.cli.exits import handle_errors
from kiln.compiler.cli.options import JSON_OPTION

if TYPE_CHECKING:
    from kiln.runtime.client.bench_report import BenchReport, Distribution


@click.command("bench")
@click.argument("url")
@click.option("--model", help="Model name to request (default: the first of /v1/models).")
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(path_type=Path),
    help="Traffic JSON lines (as `kiln serve --record` writes) or one prompt per line.",
)
@click.option(
    "--input-len",
    type=int,
    default=128,
    show_default=True,
    help="Length of each synthetic prompt (tokens with --tokenizer, else words).",
)
@click.option("--output-len", type=int, help="Output tokens per request [synthetic: 128].")
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(path_type=Path),
    help="Tokenizer dir: synthetic prompts of exactly --input-len tokens (else words).",
)
@click.option("--chat", is_flag=True, help="Send prompts to /v1/chat/completions.")
@click.option("--num-requests", type=int, help="Requests to send [prompt count, or 64].")
@click.option("--concurrency", type=int, help="Requests in flight at most [no limit].")
@click.option(
    "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second [inf]."
)
@click.option(
    "--ignore-eos/--no-ignore-eos",
    default=True,
    show_default=True,
    help="Ask for exactly --output-len tokens (`ignore_eos`, `min_tokens`).",
)
@click.option("--slo", default="", help="Goodput limits, e.g. ttft_ms=500,tpot_ms=50,e2el_ms=9000.")
@click.option("--seed", type=int, default=0, show_default=True, help="Prompts and arrivals.")
@click.option(
    "--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Per request (s)."
)
@click.option("--api-key", envvar="KILN_API_KEY", help="Bearer token [$KILN_API_KEY].")
@click.option(
    "--json-file",
    type=click.Path(path_type=Path),
    help="Also write the report, every request included, as JSON to this file.",
)
@JSON_OPTION
@handle_errors
def bench(**given: Any) -> None:
    """Benchmark the OpenAI-compatible server at URL (kiln, vLLM, llama-server, trtllm-serve).

    URL is the server's root or its /v1 base URL; --json prints the report on stdout (the
    table then goes to stderr).

    \b
    Example:
      kiln bench http://127.0.0.1:8000/v1 --concurrency 32 --num-requests 256
      kiln bench URL --prompts traffic.jsonl --slo ttft_ms=500,tpot_ms=50 --json-file r.json
    """
    run_bench_command(BenchOptions(**given))


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """`kiln bench`'s command line, as click parsed it."""

    url: str
    model: str | None
    prompts_file: Path | None
    input_len: int
    output_len: int | None
    tokenizer_dir: Path | None
    chat: bool
    num_requests: int | None
    concurrency: int | None
    request_rate: float
    ignore_eos: bool
    slo: str
    seed: int
    timeout_s: float
    api_key: str | None
    json_file: Path | None
    as_json: bool


def run_bench_command(opts: BenchOptions) -> None:
    """Build the requests, send them, print the report (and write it with --json-file)."""
    from kiln.runtime.base.errors import StageFailure, UsageError
    from kiln.runtime.client import bench as b
    from kiln.runtime.client.bench_report import parse_slo, write_json

    limits = parse_slo(opts.slo)
    if opts.num_requests is not None and opts.num_requests < 1:
        raise UsageError(f"--num-requests {opts.num_requests}: must be at least 1")
    if opts.prompts_file is not None:
        requests = b.file_requests(
            opts.prompts_file,
            output_len=opts.output_len,
            chat=opts.chat,
            ignore_eos=opts.ignore_eos,
        )
    else:
        requests = b.synthetic_requests(
            opts.num_requests or 64,
            opts.input_len,
            opts.output_len or 128,
            tokenizer_dir=opts.tokenizer_dir,
            chat=opts.chat,
            ignore_eos=opts.ignore_eos,
            seed=opts.seed,
        )
    requests = b.repeat_to(requests, opts.num_requests or len(requests))
    report = b.run_bench(
        opts.url,
        requests,
        model=opts.model,
        concurrency=opts.concurrency,
        request_rate=opts.request_rate,
        slo=limits,
        seed=opts.seed,
        timeout_s=opts.timeout_s,
        api_key=opts.api_key,
    )
    console(stderr=opts.as_json).print(report_table(report))
    if opts.json_file is not None:
        write_json(report, opts.json_file)
    if opts.as_json:
        click.echo(json.dumps(report.to_dict()))
    if report.completed == 0:
        first = next(iter(report.errors), "no answer")
        raise StageFailure(f"{opts.url}: all {report.num_requests} requests failed; first: {first}")


def report_table(report: BenchReport) -> Group:
    """The report for a terminal: a table of latency percentiles, then the totals."""
    load = f"concurrency {report.concurrency or 'unbounded'}"
    if report.request_rate is not None:
        load += f", {report.request_rate:g} req/s Poisson"
    table = Table(title=f"kiln bench {report.url} ({report.model}; {load})", title_justify="left")
    for column in ("metric", "mean", "p50", "p90", "p99"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    rows: list[tuple[str, Distribution | None]] = [
        ("TTFT (ms)", report.ttft_ms),
        ("TPOT (ms)", report.tpot_ms),
        ("ITL (ms)", report.itl_ms),
        ("E2E latency (ms)", report.e2el_ms),
    ]
    for name, dist in rows:
        if dist is None:
            table.add_row(name, "-", "-", "-", "-")
        else:
            table.add_row(name, *(f"{v:.1f}" for v in (dist.mean, dist.p50, dist.p90, dist.p99)))
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column("name")
    summary.add_column("value", justify="right")
    done = f"{report.completed}/{report.num_requests} ok"
    if report.failed:
        done += f", {report.failed} failed"
    totals = [
        ("requests", done),
        ("duration (s)", f"{report.duration_s:.2f}"),
        ("request throughput (req/s)", f"{report.request_throughput:.2f}"),
        ("output throughput (tok/s)", f"{report.output_throughput:.1f}"),
        ("total token throughput (tok/s)", f"{report.total_token_throughput:.1f}"),
        ("input / output tokens", f"{report.total_input_tokens} / {report.total_output_tokens}"),
    ]
    if report.goodput is not None:
        totals.append(("goodput (req/s within SLO)", f"{report.goodput:.2f}"))
    if report.short_outputs:
        totals.append(("shorter than asked (EOS not ignored)", str(report.short_outputs)))
    for message, count in list(report.errors.items())[:3]:
        totals.append((f"error x{count}", message[:120]))
    for name, value in totals:
        summary.add_row(name, value)
    return Group(table, summary)
