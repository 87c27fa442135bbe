"""Re-run README's five minutes and rewrite its transcript: validate → plan → compile with the
gate → promote to staging → serve from the registry, then the failing 4-bit gate, on this
machine, in a scratch directory with its own registry and caches.

    .venv/bin/python docs/five_minutes.py [--keep DIR]

The whole transcript (every command with its output, the machine and the date) goes to
docs/five-minutes.md; README.md's block between the `five-minutes` markers is replaced with
its short form (the lines a newcomer looks for). Run it after a change that moves what the
path prints; commit both files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
KILN = str(Path(sys.executable).with_name("kiln"))
START, END = "<!-- five-minutes:start -->", "<!-- five-minutes:end -->"


def machine() -> str:
    """The CPU, its count and the flags that decide kiln's kernels."""
    cpu = "unknown CPU"
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and cpu == "unknown CPU":
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
    shown = " ".join(f for f in wanted if f in flags) or "no AVX2"
    return f"{cpu}, {os.cpu_count()} cores ({shown})"


class Transcript:
    """Commands run one after another, their output kept as a terminal would show it."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env, self.cwd = env, cwd
        self.steps: list[tuple[str, str, float, int]] = []

    def run(self, shown: str, argv: list[str], allowed: tuple[int, ...] = (0,)) -> str:
        began = time.perf_counter()
        done = subprocess.run(argv, env=self.env, cwd=self.cwd, capture_output=True, text=True)
        seconds = time.perf_counter() - began
        text = (done.stdout + done.stderr).rstrip("\n")
        self.steps.append((shown, text, seconds, done.returncode))
        if done.returncode not in allowed:
            raise SystemExit(f"$ {shown}\nexited {done.returncode}:\n{text[-4000:]}")
        return done.stdout

    def markdown(self) -> str:
        out = []
        for shown, text, seconds, code in self.steps:
            status = f"exit {code}, " if code else ""
            out += [f"$ {shown}    # {status}{seconds:.0f} s", text, ""]
        return "\n".join(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_and_ask(t: Transcript, registry: Path) -> None:
    """`kiln serve registry://staging` on a free port, one completion asked with curl's
    equivalent, then stopped."""
    port = free_port()
    shown = f"kiln serve registry://staging --port {port} &"
    argv = [KILN, "serve", "registry://staging", "--registry", str(registry), "--port", str(port)]
    began = time.perf_counter()
    server = subprocess.Popen(argv, env=t.env, cwd=t.cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                said = server.stdout.read() if server.stdout else ""
                raise SystemExit(f"kiln serve did not come up:\n{said}")
            time.sleep(0.5)
        ready = time.perf_counter() - began
        body = {"model": "smollm2-135m-gptq-w8a16", "prompt": "The capital of France is",
                "max_tokens": 8, "temperature": 0}  # fmt: skip
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        t.steps.append((shown, f"(ready after {ready:.0f} s)", ready, 0))
        request = (f"curl -s {url}/v1/completions -H 'Content-Type: application/json' "
                   f"-d '{json.dumps(body)}' | jq -r '.choices[0].text'")  # fmt: skip
        t.steps.append((request, answer["choices"][0]["text"], 0.0, 0))
    finally:
        server.terminate()
        server.wait(60)


def short_form(t: Transcript, host: str, date: str) -> str:
    """README's block: each command with the lines a newcomer looks for."""
    keep = re.compile(
        r"^(recipes/.*: ok|disk:|scheme |fits |GPU memory |artifact: |verify: |promoted: |gate |"
        r"\| (source|quantize|report|export|package|gate) |\u2502 (source|quantize|report|export|"
        r"package|gate) |.*\bPASS\b|.*\bFAIL\b|error: |The capital|staging|reports: )"
    )
    lines = [f"Captured on {date} on {host} with `docs/five_minutes.py`; the whole transcript",
             "is docs/five-minutes.md. Output trimmed with `…`.", "", "```"]  # fmt: skip
    for shown, text, seconds, code in t.steps:
        lines.append(f"$ {shown}" + (f"    # {seconds / 60:.1f} min" if seconds >= 60 else ""))
        kept = [line for line in text.splitlines() if keep.match(line.strip())]
        if not kept and text and len(text.splitlines()) <= 3:
            kept = text.splitlines()
        lines += kept[:14]
        if len(kept) < len(text.splitlines()):
            lines.append("…")
        if code:
            lines.append(f"(exit {code})")
        lines.append("")
    lines[-1] = "```"
    return "\n".join(lines)


def _portable(text: str, work: Path) -> str:
    """`text` without this machine's paths: the scratch directory as $WORK, the clone's
    own paths relative to it (as a newcomer runs the commands from the clone)."""
    return text.replace(str(work), "$WORK").replace(f"{REPO}/", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="Work here and keep it (default: a temp dir).")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="kiln-five-minutes-"))
    work.mkdir(parents=True, exist_ok=True)
    registry = work / "registry.db"
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "KILN_REGISTRY": str(registry),
           "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "100"}  # fmt: skip
    env.pop("KILN_GATE_CACHE", None)
    t = Transcript(env, REPO)
    out = work / "artifacts"
    host, date = machine(), time.strftime("%Y-%m-%d")
    t.run("kiln validate recipes/demo-w8a16.yaml", [KILN, "validate", "recipes/demo-w8a16.yaml"])
    t.run("kiln plan recipes/demo-w8a16.yaml --target h100-sxm",
          [KILN, "plan", "recipes/demo-w8a16.yaml", "--target", "h100-sxm"])  # fmt: skip
    t.run(f"kiln compile recipes/demo-w8a16.yaml --output {out} --promote staging",
          [KILN, "compile", "recipes/demo-w8a16.yaml", "--output", str(out),
           "--promote", "staging"])  # fmt: skip
    artifact = next(p for p in out.iterdir() if p.name.startswith("smollm2-135m-gptq-w8a16-"))
    t.run(f"kiln inspect --verify {artifact}", [KILN, "inspect", "--verify", str(artifact)])
    serve_and_ask(t, registry)
    t.run(f"kiln compile recipes/demo-gated.yaml --output {out} --promote staging",
          [KILN, "compile", "recipes/demo-gated.yaml", "--output", str(out), "--promote",
           "staging"], allowed=(1,))  # fmt: skip
    t.run("kiln registry ls", [KILN, "registry", "ls"])
    full = (f"# Five minutes, the whole transcript\n\n{date}, {host}; produced by "
            f"`docs/five_minutes.py` (scratch directory, registry and caches).\n\n```\n"
            f"{t.markdown()}\n```\n")  # fmt: skip
    (REPO / "docs" / "five-minutes.md").write_text(_portable(full, work))
    readme = (REPO / "README.md").read_text()
    block = _portable(short_form(t, host, date), work)
    readme = re.sub(f"{re.escape(START)}.*{re.escape(END)}", f"{START}\n{block}\n{END}", readme,
                    flags=re.S)  # fmt: skip
    (REPO / "README.md").write_text(readme)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote docs/five-minutes.md and README.md's five minutes ({host}, {date})")


if __name__ == "__main__":
    main()
