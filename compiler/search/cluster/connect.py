"""The driver's connection to a Ray cluster, and what room it has for candidates: an
address that does not answer, or a cluster with no node that holds one candidate's
resources, is a usage error naming it before any work."""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kiln.runtime.base.errors import UsageError

ENV_PREFIX = "KILN_"  # the driver's environment that reaches the workers
REACH_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """Where the candidates run: a Ray cluster's address and one candidate's resources."""

    address: str
    gpus_per_candidate: float | None = None  # None: 1 where the cluster has GPUs, else 0
    cpus_per_candidate: float = 1.0

    def __post_init__(self) -> None:
        gpus = self.gpus_per_candidate
        if gpus is not None and gpus > 1 and not float(gpus).is_integer():
            raise UsageError(
                f"--gpus-per-candidate {gpus:g}: Ray gives a task a fraction of one GPU or "
                "whole GPUs; give a fraction below 1 or a whole number"
            )
        if not gpus and not self.cpus_per_candidate:
            raise UsageError(
                "--cpus-per-candidate 0 with no GPU per candidate would start every candidate "
                "at once: give a candidate at least one CPU or a GPU"
            )


@contextmanager
def connected(address: str) -> Iterator[Any]:
    """The `ray` module, connected to the cluster at `address` as its driver (the driver's
    KILN_* environment passed on to the workers); a usage error naming the address when no
    Ray cluster answers there."""
    _check_reachable(address)
    try:
        import ray
    except ImportError:
        raise UsageError(
            f"--ray {address}: Ray is not installed here; install kiln's `cluster` extra "
            "(pip install -e '.[cluster]') or the Ray version the cluster runs"
        ) from None
    previous = signal.getsignal(signal.SIGTERM)  # ray.init installs a handler of its own
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    try:
        ray.init(address=address, namespace="kiln-search", log_to_driver=False,
                 logging_level=logging.ERROR, runtime_env={"env_vars": env})  # fmt: skip
    except Exception as exc:  # Ray's refusal, whatever its class, is about the address
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise UsageError(
            f"--ray {address}: cannot join the Ray cluster there ({text[:300]})"
        ) from None
    try:
        yield ray
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, previous)


def _check_reachable(address: str) -> None:
    """Refuse at once an address whose port does not answer (Ray itself retries for minutes)."""
    if address == "auto":
        return  # Ray finds the cluster this machine is a node of, or says it found none
    if "://" in address:
        raise UsageError(
            f"--ray {address}: kiln runs as the cluster's driver on a node that mounts the "
            "shared filesystem, not through Ray Client; give the head's host:port (port 6379 "
            "by default) or `auto`, or run kiln with `ray job submit`"
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(
            f"--ray {address!r}: not a Ray address; give the head node's host:port (port 6379 "
            "by default, e.g. 10.0.0.5:6379) or `auto`"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise UsageError(
            f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc}); start one "
            "(`ray start --head`) or give its head node's address"
        ) from None


def alive(ray: Any) -> list[dict[str, Any]]:
    """The cluster's live nodes (`ray.nodes()` rows)."""
    return [n for n in ray.nodes() if n.get("Alive")]


def per_candidate(ray: Any, cluster: ClusterSettings) -> dict[str, float]:
    """What one candidate's task declares: GPUs (by default 1 where the cluster has GPUs,
    else none) and CPUs."""
    gpus = cluster.gpus_per_candidate
    if gpus is None:
        gpus = 1.0 if any(n["Resources"].get("GPU", 0) >= 1 for n in alive(ray)) else 0.0
    return {"CPU": float(cluster.cpus_per_candidate), "GPU": float(gpus)}


def room(node: dict[str, Any], need: dict[str, float]) -> int:
    """How many candidates needing `need` the node holds at once."""
    held = node.get("Resources", {})
    return min(int(held.get(r, 0.0) / amount + 1e-9) for r, amount in need.items() if amount)


def check_room(ray: Any, address: str, need: dict[str, float]) -> None:
    """Refuse a cluster with no node that holds one candidate."""
    nodes = alive(ray)
    if not any(room(n, need) for n in nodes):
        wanted = " and ".join(f"{v:g} {r}" for r, v in need.items() if v)
        raise UsageError(
            f"--ray {address}: no node of the cluster has {wanted} for a candidate (its "
            f"nodes: {'; '.join(describe(n) for n in nodes) or 'none'}); give "
            "--gpus-per-candidate / --cpus-per-candidate that a node holds, or add such a node"
        )


def describe(node: dict[str, Any]) -> str:
    """A node as a report names it: host, address and its CPUs and GPUs."""
    held = node.get("Resources", {})
    have = ", ".join(f"{held.get(r, 0):g} {r}" for r in ("CPU", "GPU"))
    name = node.get("NodeManagerHostname") or "?"
    return f"{name} ({node.get('NodeManagerAddress')}; {have})"
