"""The `kiln` program's entry point: OpenMP's idle threads asked to sleep, glibc's allocator
asked for transparent huge pages and Python's shutdown spared a scan of every object
(runtime/base/heap.py `uncollected_at_exit`), then the command line.

kiln's stages stream a model a layer at a time and hand each layer's memory back to the system
when it is done (runtime/base/heap.py), so every layer's tensors are faulted in afresh; in 4 KiB
pages that is millions of faults, and on a 1.17B-parameter FP8 compile the kernel's share of the
CPU time was 29 s of 91 s. glibc's `glibc.malloc.hugetlb=1` tunable makes it ask the kernel for
transparent huge pages (2 MiB) for the blocks it maps, which a kernel in the common "madvise"
mode grants: the same compile then spent 18 s in the kernel, at the same peak RSS. glibc reads
its tunables only when a program starts, so the entry point adds the tunable to the environment
and executes the same command once more, before anything else is imported (the process keeps
its id, arguments and open files). A GLIBC_TUNABLES the user set is kept, and one that already
names the tunable is left as it is; KILN_HUGE_PAGES=0 leaves the allocator alone. Where the C
library is not glibc, the kernel grants no huge pages, `run` is called by another program
than `kiln`, or the command is not one that streams models (`compile`, `search`), nothing
changes.

The same commands run several things that compute at once on the same cores: the quantiser,
the report's float half in a process of its own, the report's decoding threads beside the
exports and hashing. libgomp's threads (torch's on Linux) spin between parallel regions by
default, spending a core another thread or process needs: a 1.17B-parameter FP8 compile on 2
cores took 67-68 s of user CPU and 43.6-43.8 s of wall time that way, 52-54 s and 38.0-39.7 s
with OMP_WAIT_POLICY=PASSIVE. So the entry point sets that variable before torch is imported
(every process it starts inherits it), unless the user set it.

Hand-written: no library sets glibc tunables for a running program.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from kiln.runtime.base.heap import uncollected_at_exit

TUNABLE = "glibc.malloc.hugetlb"
OPENMP_WAIT = "OMP_WAIT_POLICY"
OPT_OUT = "KILN_HUGE_PAGES"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def tunables_with_huge_pages(environ: Mapping[str, str], thp_mode: str | None) -> str | None:
    """The GLIBC_TUNABLES value that asks glibc for huge pages, or None where it should not be
    changed: opted out, already set either way, or a kernel that grants none (`thp_mode` is the
    bracketed word of THP_ENABLED, None where there is no such file)."""
    current = environ.get("GLIBC_TUNABLES", "")
    if environ.get(OPT_OUT) == "0" or TUNABLE in current or thp_mode not in ("always", "madvise"):
        return None
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), or None."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    return text.partition("[")[2].partition("]")[0] or None


def with_huge_pages() -> None:
    """Execute this program again with glibc asked for huge pages, where that changes anything
    (see the module's docstring); returns where it does not."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return
    value = tunables_with_huge_pages(os.environ, thp_mode())
    if value is None or not sys.executable or len(sys.orig_argv) < 2:
        return
    os.environ["GLIBC_TUNABLES"] = value
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except OSError:
        del os.environ["GLIBC_TUNABLES"]  # runs on, as it would have without


def passive_openmp(environ: MutableMapping[str, str]) -> bool:
    """Ask OpenMP's waiting threads to sleep rather than spin (see the module's docstring),
    where the user has not chosen; whether `environ` changed. Only before OpenMP is loaded
    (torch imported) does it take effect for this process; the processes it starts inherit
    it either way."""
    if OPENMP_WAIT in environ:
        return False
    environ[OPENMP_WAIT] = "PASSIVE"
    return True


def started_as_kiln(argv0: str, main_module: str | None) -> bool:
    """Whether this process is the `kiln` program (its console script, or `python -m
    kiln.compiler.cli`), so executing it again runs only kiln: never a program that calls
    `run` after work of its own, which would be done twice."""
    return Path(argv0).name == "kiln" or main_module == "kiln.compiler.cli.__main__"


# The commands that stream models through compile stages (`kiln search` compiles its
# candidates); serving and the rest keep glibc's defaults, under which they were measured.
STREAMING_COMMANDS = frozenset({"compile", "search"})


def streams_models(args: list[str]) -> bool:
    """Whether the command line `args` (after the program) names a STREAMING_COMMANDS one:
    its first word that is not an option (`kiln --debug compile R`)."""
    command = next((a for a in args if not a.startswith("-")), None)
    return command in STREAMING_COMMANDS


def run() -> None:
    """`kiln`: the command line, with OpenMP's threads sleeping when idle and glibc's
    huge-page tunable for the commands that stream models."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    kiln = started_as_kiln(sys.argv[0], getattr(spec, "name", None))
    if kiln and streams_models(sys.argv[1:]):
        passive_openmp(os.environ)  # before torch is imported; kept by the execution below
        with_huge_pages()
    uncollected_at_exit()  # first registered: runs after the libraries' handlers
    from kiln.compiler.cli.main import main

    main()
