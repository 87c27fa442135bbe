"""The `kiln` entry point asks glibc for transparent huge pages by executing itself once more
with GLIBC_TUNABLES set (compiler/cli/console.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from kiln.compiler.cli.console import (
    OPENMP_WAIT,
    TUNABLE,
    passive_openmp,
    started_as_kiln,
    streams_models,
    thp_mode,
    tunables_with_huge_pages,
)

SHOW = (
    "import os; from kiln.compiler.cli.console import with_huge_pages; with_huge_pages(); "
    "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'))"
)


def test_the_tunable_is_added_to_what_the_user_set() -> None:
    assert tunables_with_huge_pages({}, "madvise") == f"{TUNABLE}=1"
    assert tunables_with_huge_pages({}, "always") == f"{TUNABLE}=1"
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert tunables_with_huge_pages(mine, "madvise") == f"glibc.malloc.arena_max=2:{TUNABLE}=1"


def test_nothing_changes_where_it_would_not_help_or_was_decided() -> None:
    assert tunables_with_huge_pages({}, "never") is None
    assert tunables_with_huge_pages({}, None) is None  # no THP file: not Linux's THP
    assert tunables_with_huge_pages({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, "madvise") is None
    assert tunables_with_huge_pages({"KILN_HUGE_PAGES": "0"}, "madvise") is None


def _run(env: dict[str, str]) -> tuple[int, str, str]:
    proc = subprocess.Popen([sys.executable, "-c", SHOW], env=env, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    pid, tunables = out.split()
    return proc.pid, pid, tunables


def test_the_program_runs_on_in_the_same_process_with_the_tunable() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "KILN_HUGE_PAGES")}
    started, pid, tunables = _run(env)
    assert int(pid) == started  # executed again in place: the same process id
    expected = f"{TUNABLE}=1" if thp_mode() in ("always", "madvise") else "None"
    assert tunables == expected


def test_opting_out_leaves_the_environment_alone() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    _, _, tunables = _run({**env, "KILN_HUGE_PAGES": "0"})
    assert tunables == "None"


def test_the_command_line_runs_through_the_entry_point() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-m", "kiln.compiler.cli", "--version"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "version" in done.stdout


def test_only_the_kiln_program_is_executed_again() -> None:
    assert started_as_kiln("/venv/bin/kiln", None)
    assert started_as_kiln("/repo/compiler/cli/__main__.py", "kiln.compiler.cli.__main__")
    assert not started_as_kiln("/home/me/pipeline.py", None)  # a script calling run()
    assert not started_as_kiln("-c", None)


def test_only_the_commands_that_stream_models_ask_for_huge_pages() -> None:
    assert streams_models(["compile", "r.yaml"]) and streams_models(["--debug", "search", "r"])
    assert not streams_models(["serve", "registry://staging"])
    assert not streams_models(["--version"]) and not streams_models([])


def test_openmp_threads_sleep_when_idle_unless_the_user_chose() -> None:
    environ: dict[str, str] = {}
    assert passive_openmp(environ) and environ == {OPENMP_WAIT: "PASSIVE"}
    mine = {OPENMP_WAIT: "ACTIVE"}
    assert not passive_openmp(mine) and mine == {OPENMP_WAIT: "ACTIVE"}


def test_a_compile_and_what_it_starts_see_the_wait_policy() -> None:
    """Set by the entry point for `compile` before torch is imported, so the process's
    OpenMP and every process it starts (the report's float half) read it."""
    show = (
        "import os, sys; sys.argv = ['kiln', 'compile', '--help']; "
        "from kiln.compiler.cli import console; "
        "console.started_as_kiln = lambda *a: True; console.with_huge_pages = lambda: None; "
        "real = console.passive_openmp; seen = []; "
        "console.passive_openmp = lambda env: seen.append('torch' in sys.modules) or real(env)\n"
        "try:\n    console.run()\nexcept SystemExit:\n    pass\n"
        "print(*seen, os.environ.get('OMP_WAIT_POLICY'))"
    )
    env = {k: v for k, v in os.environ.items() if k != OPENMP_WAIT}
    done = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].split() == ["False", "PASSIVE"]  # after its help
    mine = subprocess.run([sys.executable, "-c", show], env={**env, OPENMP_WAIT: "ACTIVE"},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert mine.stdout.splitlines()[-1].split() == ["False", "ACTIVE"]


def test_the_program_leaves_its_objects_to_the_system_at_exit() -> None:
    """The entry point registers the freeze before the command's libraries are imported, so
    Python's shutdown does not scan their objects."""
    show = (
        "import atexit, gc, sys; sys.argv = ['kiln', '--version']\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))\n"
        "from kiln.compiler.cli import console\n"
        "try:\n    console.run()\nexcept SystemExit:\n    pass\n"
    )
    done = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "frozen True"
