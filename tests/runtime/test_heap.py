"""The heap policy of kiln's streaming stages (runtime/base/heap.py): tensors below 32 MiB are
kept by the heap for reuse within a layer, and `trim_freed` hands what it holds free back to
the system after the layer. Each case runs in a process of its own: the settings are the
process's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

MEASURE = textwrap.dedent(
    """
    import resource, sys, torch
    from kiln.runtime.base import heap

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    took = heap.reuse_within_layers() if sys.argv[1] == "reuse" else heap.return_large_frees()
    if not took:
        print("SKIP")
        raise SystemExit
    base = rss()
    made = []
    for _ in range(6):  # a layer's tensors, as a streamed layer makes them: made, used, freed
        before = faults()
        x = torch.ones(1 << 20)  # 4 MiB
        y = torch.ones(1 << 19)
        z = x + 1
        made.append(faults() - before)
        del x, y, z
    held = rss() - base
    heap.trim_freed()
    print(made[0], sum(made[2:]), held, rss() - base)
    """
)


def measure(policy: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", MEASURE, policy], capture_output=True,
                         text=True, check=True).stdout.split()  # fmt: skip
    if out == ["SKIP"]:
        pytest.skip("not glibc")
    return [int(x) for x in out]


def test_tensors_are_reused_within_a_layer_and_handed_back_after_it() -> None:
    first, later, held, after = measure("reuse")
    # The last four rounds fault in at most half a round's pages each (the heap hands back what
    # it kept); with a mapping of their own, every round faults in all of them (below).
    assert later <= 2 * first
    assert held >= 4 << 20  # the heap keeps what was freed, for the next round
    assert after < min(held // 4, 8 << 20)  # and hands it back to the system when trimmed


def test_mappings_of_their_own_fault_in_every_tensor_each_time() -> None:
    """What `reuse_within_layers` replaces where a model streams: each tensor a new mapping."""
    first, later, _, _ = measure("own")
    assert later >= 3 * first


def test_a_streamed_model_trims_once_it_has_grown_by_the_slack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GrowthTrim takes what the process holds after the first layer as its level, leaves the
    heap alone while layers stay within `slack` of it, trims past it, and raises the level only
    to what is still held right after a trim; where resident memory cannot be read it trims
    every time."""
    from kiln.runtime.base import heap

    # After each layer (and, after a trim, once more: what the trim left).
    sizes = iter([500, 520, 599, 601, 450, 590, 640, 630, 700, 731, 700, None, None])
    trims: list[int] = []
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(sizes))
    monkeypatch.setattr(heap, "trim_freed", lambda: trims.append(1))
    trim = heap.GrowthTrim(100)
    made = []
    for _ in range(10):
        before = len(trims)
        trim()
        made.append(len(trims) - before)
    # 500: the level; 520, 599: within; 601: past 600, trimmed, 450 left: the level stays 500
    # (a level taken before trimming would climb by a slack each time); 590: within; 640:
    # trimmed, 630 left in use: level 630; 700: within; 731: trimmed; then unknown: every time.
    assert made == [0, 0, 0, 1, 0, 1, 0, 1, 1, 1]


GROWTH = textwrap.dedent(
    """
    import resource, sys, torch
    from kiln.runtime.base import heap

    heap.reuse_within_layers()
    trim = heap.GrowthTrim(64 << 20) if sys.argv[1] == "growth" else heap.trim_freed
    made = []
    for layer in range(6):  # a layer's tensors, as a streamed layer makes them
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(1 << 20)  # 4 MiB
        y = torch.ones(1 << 19)
        z = x + 1
        del x, y, z
        made.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        trim()
    print(sum(made[1:]))
    """
)


def test_layers_within_the_slack_reuse_the_heap() -> None:
    """Layers that free what they made, trimmed once they grow past the slack, fault in far
    fewer pages than layers trimmed each time."""

    def later_faults(policy: str) -> int:
        out = subprocess.run([sys.executable, "-c", GROWTH, policy], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        return int(out)

    each, growth = later_faults("each"), later_faults("growth")
    assert each > 5 * 2048  # five layers, each faulting in its 10 MiB again
    assert growth < each // 2


def test_collection_is_paused_within_and_restored_after() -> None:
    import gc

    from kiln.runtime.base.heap import collection_paused

    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()  # left off, as the caller had it
    finally:
        gc.enable()
    with pytest.raises(ValueError), collection_paused():
        raise ValueError("raised within")
    assert gc.isenabled()


EXIT = textwrap.dedent(
    """
    import atexit, gc
    atexit.register(lambda: print("frozen at exit", gc.get_freeze_count() > 0))
    from kiln.runtime.base import heap
    if __import__("sys").argv[1] == "uncollected":
        heap.uncollected_at_exit()
    import torch  # a library's objects, and atexit handlers registered after
    print("frozen before exit", gc.get_freeze_count() > 0)
    """
)


def test_objects_left_at_exit_go_to_the_system_not_the_collector() -> None:
    """Registered first, the freeze runs after every later atexit handler and before Python's
    shutdown collections; nothing is frozen while the process works."""

    def said(mode: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", EXIT, mode], capture_output=True,
                              text=True, check=True).stdout.splitlines()  # fmt: skip

    assert said("uncollected") == ["frozen before exit False", "frozen at exit True"]
    assert said("plain") == ["frozen before exit False", "frozen at exit False"]
