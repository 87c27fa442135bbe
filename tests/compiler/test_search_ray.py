"""`kiln search --ray`: the candidates as tasks on a real local Ray cluster (a head started
with `ray start --head`, not Ray's removed local mode, nothing mocked). The same candidates,
verdicts and winner as the serial search; a killed worker retried, a worker that dies twice
recorded with why; a killed driver leaves no task running and a rerun resumes; an address,
a cluster or storage the search cannot use refused before any work. Plus the k the mixed
search probes several at once, which reach the serial search's answer by construction.

The Ray tests share one head (one xdist worker runs them all, `loadgroup`); the storage test
starts its own, whose nodes see a private mount where the driver keeps its files.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kiln.compiler.search.probes import next_probes, walk
from tests.compiler.test_compile import kiln
from tests.compiler.test_search import damaged, search_recipe  # noqa: F401

pytestmark = pytest.mark.xdist_group("ray")

RAY = Path(sys.executable).with_name("ray")
START_WAIT_S, STOP_WAIT_S, EVENT_WAIT_S = 120.0, 5.0, 300.0
WORKER_PORTS = 100
QUICK = ("--kv-cache", "none", "--no-measure", "--no-mixed")


# ---- a real local Ray head ---------------------------------------------------------------------


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _ports(count: int) -> tuple[list[int], int]:
    """`count` free ports and the first of WORKER_PORTS free ones after them, in 40000-59999:
    outside Ray's worker range (10002-19999), so no other head on the machine collides."""
    while True:
        base = random.randrange(40000, 60000 - WORKER_PORTS - count)
        ports = list(range(base, base + count + WORKER_PORTS))
        if all(_free(p) for p in ports):
            return ports[:count], ports[count]


class RayHead:
    """`ray start --head --block` with `cpus` CPUs in a process group of its own, a short temp
    dir (Unix socket paths hold 107 bytes) and a small object store; `stop()` kills the group
    (never `ray stop`: it stops every Ray process on the machine). With `hidden`, the head and
    its workers see an empty private mount there instead of the driver's files."""

    def __init__(self, cpus: int = 2, hidden: Path | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kr-", dir="/tmp"))
        (gcs, dash, node, objects, agent, grpc, env_agent, metrics), workers = _ports(8)
        self.address = f"127.0.0.1:{gcs}"
        self.log = self.tmp / "head.log"
        argv = [
            str(RAY), "start", "--head", "--block", "--disable-usage-stats",
            "--num-cpus", str(cpus), "--num-gpus", "0", "--node-ip-address", "127.0.0.1",
            "--temp-dir", str(self.tmp), "--object-store-memory", str(200 * 10**6),
            "--include-dashboard=false", "--port", str(gcs), "--dashboard-port", str(dash),
            "--node-manager-port", str(node), "--object-manager-port", str(objects),
            "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(grpc),
            "--runtime-env-agent-port", str(env_agent), "--metrics-export-port", str(metrics),
            "--min-worker-port", str(workers), "--max-worker-port", str(workers + WORKER_PORTS - 1),
        ]  # fmt: skip
        if hidden is not None:
            mount = f'mount -t tmpfs kiln-test {hidden} && exec "$@"'
            argv = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                mount,
                "sh",
                *argv,
            ]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + START_WAIT_S
        while "Ray runtime started" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start failed: {self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def tasks(self) -> list[str]:
        """The Ray tasks its workers run now (a worker's title is `ray::<task>`, or
        `ray::IDLE` between tasks)."""
        out = subprocess.run(["ps", "-o", "args=", "-g", str(self.process.pid)],
                             capture_output=True, text=True, check=False).stdout  # fmt: skip
        return [t for t in out.splitlines() if t.startswith("ray::judge_on_worker")]

    def stop(self) -> None:
        """SIGTERM to the head's process group, SIGKILL to whatever of it is left after
        STOP_WAIT_S; its files removed."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_WAIT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_head() -> Iterator[RayHead]:
    head = RayHead()
    yield head
    head.stop()


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def launch(recipe: Path, out: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """`kiln search` as a process of its own (one that can be killed; the environment of the
    workers, which read no conftest), its stdout and stderr in files beside `out`."""
    registry = out.parent / f"{out.name}.db"
    argv = [sys.executable, "-m", "kiln.compiler.cli.main", "search", str(recipe), "--json",
            "--output", str(out), "--registry", str(registry), *args]  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    stdout = (out.parent / f"{out.name}.out").open("w")
    stderr = (out.parent / f"{out.name}.err").open("w")
    return subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True,
                            env={**os.environ, **env})  # fmt: skip


def driver(recipe: Path, out: Path, head: RayHead, *args: str) -> subprocess.Popen[str]:
    return launch(recipe, out, "--ray", head.address, *args)


def finished(process: subprocess.Popen[str], out: Path) -> tuple[int, dict, str]:
    code = process.wait(EVENT_WAIT_S)
    stdout = (out.parent / f"{out.name}.out").read_text()
    stderr = (out.parent / f"{out.name}.err").read_text()
    return code, json.loads(stdout) if stdout.strip() else {}, stderr


def wait_for(what: str, check: Callable[[], object]) -> object:
    """Poll `check` until it returns something true (a wait, not a timed assertion)."""
    deadline = time.monotonic() + EVENT_WAIT_S
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.1)
    return found


def attempts(out: Path, cid: str) -> list[dict]:
    path = out / "candidates" / f".{cid}.attempts"
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return [json.loads(line) for line in path.read_text().splitlines()]
    return []


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def killer(out: Path, cid: str, times: int) -> tuple[threading.Thread, list[int]]:
    """A thread that SIGKILLs the worker process of each of the first `times` attempts at
    candidate `cid` as soon as it starts (the attempts file names its process id)."""
    killed: list[int] = []

    def kill() -> None:
        for n in range(1, times + 1):
            tried = wait_for(f"attempt {n} at {cid}", lambda n=n: attempts(out, cid)[n - 1 : n])
            os.kill(tried[0]["pid"], signal.SIGKILL)
            killed.append(tried[0]["pid"])

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread, killed


def search_on(head: RayHead, recipe: Path, out: Path, *args: str) -> tuple[int, dict, str]:
    """`kiln search --ray` in this process."""
    code, stdout, stderr = kiln("search", str(recipe), "--json", "--ray", head.address,
                                "--output", str(out), "--registry", f"{out}.db", *args)  # fmt: skip
    return code, json.loads(stdout) if stdout.strip() else {}, stderr


def verdicts(answer: dict) -> dict[str, tuple[bool, list[str]]]:
    return {c["id"]: (c["quality"]["passed"], c["quality"]["failed_checks"])
            for c in answer["candidates"] if c["quality"]}  # fmt: skip


# ---- the same answer as the serial search ------------------------------------------------------


def test_a_search_on_the_cluster_reaches_the_serial_searchs_candidates_verdicts_and_winner(
    damaged: Path,  # noqa: F811
    tmp_path: Path,
    ray_head: RayHead,
) -> None:
    """The planted model: W4A16 fails on the damaged layer and its mixed candidate keeping
    that layer float wins. On two CPUs the cluster probes k=1 and k=2 at once; every
    candidate the serial search judged gets the same verdict and artifact digest, the winner
    is the same, and each row says where it ran, when and for how long. The source stage was
    made once, by the driver."""
    recipe = search_recipe(tmp_path, damaged, kl_max=0.17)
    args = ("--schemes", "w4a16", "--kv-cache", "none", "--no-measure")
    # One torch thread, as Ray gives a task of one CPU: GPTQ's sums, so the digests, follow it.
    serial_run = launch(recipe, tmp_path / "serial", *args, OMP_NUM_THREADS="1")
    code, serial, stderr = finished(serial_run, tmp_path / "serial")
    assert code == 0, stderr
    code, clustered, stderr = search_on(ray_head, recipe, tmp_path / "ray", *args)
    assert code == 0, stderr
    assert "2 running (w4a16-keep1, w4a16-keep2)" in " ".join(stderr.split())
    assert serial["targets"]["h100-sxm"]["winner"] == "w4a16-keep1"
    assert clustered["targets"]["h100-sxm"]["winner"] == "w4a16-keep1"
    ours = verdicts(clustered)
    assert {cid: ours.get(cid) for cid in verdicts(serial)} == verdicts(serial)
    assert set(ours) - set(verdicts(serial)) <= {"w4a16-keep2"}  # the probe judged alongside
    digests = {c["id"]: Path(c["artifact"]).name for c in clustered["candidates"]}
    for row in serial["candidates"]:
        assert digests[row["id"]] == Path(row["artifact"]).name
    for row in clustered["candidates"]:
        assert row["node"] and row["started"] and row["seconds"] > 0 and row["attempts"] == 1
        manifest = json.loads((Path(row["artifact"]) / "manifest.json").read_text())
        assert manifest["stages"]["source"]["status"] == "cached"
    assert clustered["cluster"]["slots"] == 2 and clustered["cluster"]["per_candidate"]["CPU"] == 1
    assert "## Where each candidate ran" in (tmp_path / "ray" / "search.md").read_text()


# ---- faults ----------------------------------------------------------------------------------


def test_a_worker_killed_mid_candidate_is_retried_and_the_search_completes(
    tiny_llama: Path, tmp_path: Path, ray_head: RayHead
) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    out = tmp_path / "search"
    thread, killed = killer(out, "w8a16", times=1)
    code, answer, stderr = search_on(ray_head, recipe, out, "--schemes", "w8a16", *QUICK)
    thread.join()
    assert code == 0, stderr
    assert len(killed) == 1
    (row,) = answer["candidates"]
    assert row["attempts"] == 2 and row["quality"]["passed"] and row["failed"] is None
    assert answer["targets"]["h100-sxm"]["winner"] == "w8a16"


def test_a_candidate_whose_worker_dies_twice_is_recorded_as_failed_and_the_search_goes_on(
    tiny_llama: Path, tmp_path: Path, ray_head: RayHead
) -> None:
    """One candidate at a time (two CPUs each): FP8's worker is killed, and killed again on
    Ray's one retry; FP8 is kept with why it has no verdict, never dropped nor counted
    twice, and W8A16 after it wins."""
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    out = tmp_path / "search"
    thread, killed = killer(out, "fp8", times=2)
    code, answer, stderr = search_on(ray_head, recipe, out, "--schemes", "fp8,w8a16",
                                     "--cpus-per-candidate", "2", *QUICK)  # fmt: skip
    thread.join()
    assert code == 0, stderr
    assert len(killed) == 2
    rows = {c["id"]: c for c in answer["candidates"]}
    assert list(rows) == ["fp8", "w8a16"]
    assert rows["fp8"]["quality"] is None and rows["fp8"]["attempts"] == 2
    assert "its worker died on both attempts" in rows["fp8"]["failed"]
    assert answer["failed"] == {"fp8": rows["fp8"]["failed"]}
    assert answer["targets"]["h100-sxm"]["winner"] == "w8a16"


def test_a_killed_driver_leaves_no_task_running_and_a_rerun_resumes(
    tiny_llama: Path, tmp_path: Path, ray_head: RayHead
) -> None:
    """SIGTERM while the second candidate runs: the driver cancels it (its worker process
    ends, no worker runs a candidate) and exits 143; the rerun keeps the first candidate's
    verdict and judges the second."""
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    out = tmp_path / "search"
    args = ("--schemes", "fp8,w8a16", "--cpus-per-candidate", "2", *QUICK)
    process = driver(recipe, out, ray_head, *args)
    running = wait_for("the second candidate starting", lambda: attempts(out, "w8a16"))
    state = json.loads((out / "state.json").read_text())
    assert [c["id"] for c in state["candidates"]] == ["fp8"]
    process.send_signal(signal.SIGTERM)
    code, _, stderr = finished(process, out)
    assert code == 128 + signal.SIGTERM, stderr
    assert "cancelling 1 running candidate(s) on the cluster" in stderr
    wait_for("the cancelled candidate's worker ending", lambda: gone(running[0]["pid"]))
    assert ray_head.tasks() == []
    code, answer, stderr = search_on(ray_head, recipe, out, *args)
    assert code == 0, stderr
    assert answer["resumed"] == 1 and [c["id"] for c in answer["candidates"]] == ["fp8", "w8a16"]


# ---- refused before any work -----------------------------------------------------------------


def test_an_address_where_no_cluster_answers_is_refused_before_any_work(
    tiny_llama: Path, tmp_path: Path
) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    code, _, stderr = kiln("search", str(recipe), "--ray", address, *QUICK)
    assert code == 2 and f"--ray {address}: no Ray cluster answers there" in stderr
    assert not (tmp_path / "out").exists()


def test_a_cluster_without_a_candidates_resources_is_refused_naming_them(
    tiny_llama: Path, tmp_path: Path, ray_head: RayHead
) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, _, stderr = kiln("search", str(recipe), "--ray", ray_head.address,
                           "--gpus-per-candidate", "1", *QUICK)  # fmt: skip
    said = " ".join(stderr.split())
    assert code == 2 and "no node of the cluster has 1 CPU and 1 GPU for a candidate" in said
    assert "2 CPU, 0 GPU" in said
    assert not (tmp_path / "out").exists()


def test_a_worker_that_does_not_see_the_search_directory_is_refused_naming_it(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A cluster whose nodes mount an empty filesystem where the driver keeps its search:
    refused (exit 2) naming that directory, and nothing of the search is left."""
    if subprocess.run(["unshare", "--mount", "true"], check=False).returncode != 0:
        pytest.skip("needs a private mount namespace (unshare --mount) to hide a directory")
    local = tmp_path / "local"
    local.mkdir()
    head = RayHead(hidden=local)
    try:
        recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
        out = local / "search"
        code, _, stderr = kiln("search", str(recipe), "--ray", head.address, "--output",
                               str(out), "--registry", str(tmp_path / "r.db"), *QUICK)  # fmt: skip
    finally:
        head.stop()
    said = " ".join(stderr.split())
    assert code == 2, stderr
    assert f"does not see {out} as this driver does" in said and "docs/search.md" in said
    assert not out.exists()


def test_without_ray_installed_kiln_searches_serially_and_says_what_a_cluster_needs(
    tiny_llama: Path, tmp_path: Path, ray_head: RayHead
) -> None:
    """Ray is imported only when a search asks for a cluster: with `import ray` failing, a
    serial search runs, and `--ray` is refused naming the extra to install."""
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    no_ray = (
        "import sys; sys.modules['ray'] = None; from kiln.compiler.cli.main import main; main()"
    )

    def kiln_without_ray(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-c", no_ray, "search", str(recipe), "--registry",
                str(tmp_path / "r.db"), "--schemes", "w8a16", *QUICK, *args]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, check=False)

    clustered = kiln_without_ray("--ray", ray_head.address)
    assert clustered.returncode == 2 and "Ray is not installed here" in clustered.stderr
    assert "'.[cluster]'" in clustered.stderr
    assert kiln_without_ray().returncode == 0


def test_cluster_options_without_a_cluster_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, _, stderr = kiln("search", str(recipe), "--gpus-per-candidate", "1")
    assert code == 2 and "--gpus-per-candidate sizes a candidate's task on a Ray cluster" in stderr
    code, _, stderr = kiln("search", str(recipe), "--ray", "ray://head:10001")
    assert code == 2 and "not through Ray Client" in stderr


# ---- the mixed search's probes, several at once ------------------------------------------------


def serial_answer(passes: Callable[[int], bool], top: int) -> tuple[int | None, list[int]]:
    """The serial search's answer and the ks it judged, one at a time."""
    known: dict[int, bool] = {}
    while (need := walk(known, top).need) is not None:
        known[need] = passes(need)
    return walk(known, top).best, list(known)


def test_probes_judged_several_at_once_reach_the_serial_searchs_answer() -> None:
    """For every gate outcome of k (monotone or not) and any room on the cluster: judging
    the ks `next_probes` names, round after round, ends with the serial search's answer, and
    judges every k the serial search judged."""
    rng = random.Random(0)
    for top in range(1, 24):
        for trial in range(30):
            if trial < top + 1:
                outcome = {k: k >= trial for k in range(1, top + 1)}  # passes from k=trial on
            else:
                outcome = {k: rng.random() < 0.5 for k in range(1, top + 1)}
            best, judged = serial_answer(outcome.__getitem__, top)
            for width in (1, 2, 3, 5):
                known: dict[int, bool] = {}
                while probes := next_probes(known, top, width):
                    assert len(probes) <= width and probes[0] == walk(known, top).need
                    known.update({k: outcome[k] for k in probes})
                assert walk(known, top).best == best and set(judged) <= set(known)
                if width == 1:
                    assert list(known) == judged  # one at a time: exactly the serial search


def test_the_first_round_grows_k_and_a_bisection_round_splits_the_interval() -> None:
    assert next_probes({}, top=20, width=3) == [1, 2, 4]
    assert next_probes({1: False, 2: False, 4: False, 8: False, 16: True}, 20, 3) == [12, 10, 14]
    assert next_probes({1: True}, top=20, width=4) == []
