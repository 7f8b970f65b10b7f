"""Build units lowered on a Ray cluster (``npumoe build --cluster``), into a build cache every node mounts.

The units are the build cache's own (:mod:`npumoe.backends.build_cache`): content-addressed and independent.
The driver keys them, sends the ones not yet cached to the cluster, then links every unit from the cache and
writes the manifest. A unit travels as its graphs, the backend (options and calibration included) and where
to map the weights from, never the weights' bytes (:meth:`npumoe.core.ir.weights.Weights.__reduce__`); its
worker lowers it into the cache and returns only its key. A worker that dies (out of memory, a lost node)
has its unit retried by Ray; a killed driver loses nothing finished, since finished units are cached.
Every node needs the same npumoe and toolchains, and the checkpoint and the cache at the same paths.
``ray`` is imported only here and in :mod:`npumoe.backends.ray_local`, only when a cluster is named or started
(the ``cluster`` extra).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from npumoe.core.base.errors import ArtifactError, BackendUnavailableError, InputError, NpumoeError

MAX_RETRIES = 3  # a unit whose worker dies is lowered again, by Ray, up to this many times
CONNECT_SECONDS = 5  # an address that accepts no connection by then is reported, not waited on


class RayCluster:
    """A connected cluster that lowers build units; ``lower_units`` takes it in place of a job count."""

    def __init__(self, address: str):
        self.address = address
        self.nodes_used: dict[str, int] = {}  # node id → units it lowered, over every fill
        self.workers: int | None = None  # units lowering at once (bench scale --cluster adds one at a time); None: all

    def cpus(self) -> int:
        import ray

        return int(ray.cluster_resources().get("CPU", 0))

    def fill(self, units: list, cache_root: Path, step) -> set[str]:
        """Lower ``units`` on the cluster into the cache at ``cache_root``; the keys lowered. The first unit
        that fails stops the build with its error, the others cancelled."""
        import ray

        from npumoe.backends.build_cache import BuildCache, code_digest

        lower = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False,
                           scheduling_strategy="SPREAD")(_lower_unit)
        shared, root, code = ray.put(units), str(Path(cache_root).resolve()), code_digest()
        waiting = list(enumerate(units))[::-1]
        running = {}

        def submit() -> None:
            while waiting and len(running) < (self.workers or len(units)):
                i, unit = waiting.pop()
                running[lower.remote(shared, i, root, code)] = unit
        step.describe(f"{len(units)} units on {self.address} ({self.cpus()} CPUs)")
        done = set()
        try:
            submit()
            while running:
                (ready,), _ = ray.wait(list(running), num_returns=1)
                unit = running.pop(ready)
                key, node = _result(ray, ready, unit.label)
                if not BuildCache(cache_root).has(key):
                    raise InputError(f"node {node[:12]} lowered {unit.label} into {cache_root}, but not the one this "
                                     "machine sees at that path: give --cache a directory every node mounts.")
                done.add(key)
                self.nodes_used[node] = self.nodes_used.get(node, 0) + 1
                step.describe(f"done: {unit.label}")
                step.advance(len(unit.graphs))
                submit()
        finally:
            for ref in running:  # a failed unit fails the build: stop the rest now
                ray.cancel(ref)
        return done


def _result(ray, ref, label: str) -> tuple[str, str]:
    """A finished task's (key, node), or its error: npumoe's own as it is, a worker that kept dying as one line."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, NpumoeError):
            raise err.cause from None
        raise
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OutOfMemoryError) as err:
        raise InputError(f"the worker lowering {label} died {MAX_RETRIES + 1} times ({type(err).__name__}), most "
                         "likely out of memory: each holds one unit's weights while it compiles; give the nodes "
                         "more memory or fewer CPUs (units finished so far are cached).") from None


def _lower_unit(units: list, index: int, cache_root: str, code: str) -> tuple[str, str]:
    """On a worker: lower ``units[index]`` into the cache; its key and this node's id."""
    import ray

    from npumoe.backends.build_cache import BuildCache, code_digest

    node = ray.get_runtime_context().get_node_id()
    if code_digest() != code:
        raise ArtifactError(f"node {node[:12]} runs other npumoe code than the driver (sources {code_digest()}, not "
                            f"{code}), so what it builds would be filed under the wrong key; install the same npumoe "
                            "on every node.")
    unit = units[index]
    BuildCache(Path(cache_root)).fill(unit.key, unit.lower)
    return unit.key, node


@contextmanager
def connected(address: str) -> Iterator[RayCluster]:
    """The cluster at ``address`` (``auto``: ``$RAY_ADDRESS``), connected for the duration."""
    try:
        import ray
    except ImportError:
        raise BackendUnavailableError("--cluster needs Ray, which is not installed here; install it with "
                                      "pip install 'npumoe[cluster]'.") from None
    address = _resolve(address)
    try:
        socket.create_connection(_host_port(address), timeout=CONNECT_SECONDS).close()
    except OSError as err:
        raise InputError(f"nothing answers at {address} ({err.strerror or err}); start the cluster (ray start "
                         "--head) or give the address it printed.") from None
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        ray.shutdown()  # a half-made connection would refuse the next ray.init in this process
        last = [line for line in str(err).splitlines() if line.strip()][-1:] or [type(err).__name__]
        raise InputError(f"{address} answers, but no Ray cluster there let this Ray {ray.__version__} join "
                         f"({last[0].strip()}).") from None
    try:
        yield RayCluster(address)
    finally:
        ray.shutdown()


def _resolve(address: str) -> str:
    if address != "auto":
        return address
    if not os.environ.get("RAY_ADDRESS"):
        raise InputError("--cluster auto joins the cluster named by RAY_ADDRESS, which is not set; set it, or give "
                         "the address (ray://HOST:10001 from anywhere, HOST:6379 on one of its nodes).")
    return os.environ["RAY_ADDRESS"]


def _host_port(address: str) -> tuple[str, int]:
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "ray" or not parts.hostname or port is None:
        raise InputError(f"--cluster {address!r} is not a Ray address; give ray://HOST:PORT (from anywhere), "
                         "HOST:PORT (on one of its nodes) or auto (RAY_ADDRESS).")
    return parts.hostname, port
