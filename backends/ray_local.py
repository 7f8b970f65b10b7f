"""A Ray cluster of 1-CPU nodes on 127.0.0.1, started and stopped here: what the tests and ``npumoe bench scale
--cluster`` lower units on when no cluster is given.

Each node is ``ray start --block`` in its own process group, so it is stopped by its id alone (never by name),
and started lean: no dashboard, log monitor or usage stats, an 80 MB object store (units travel as their
graphs and a path to the weights). Nodes run the ``ray`` of this interpreter, so their workers import this npumoe.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from npumoe.core.base.errors import BackendUnavailableError

JOIN_SECONDS = 120  # for every node to join, on a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(args: list[str], log: Path) -> subprocess.Popen:
    # the CLI's module, run by this interpreter: a venv that sees ray through system site-packages has no bin/ray
    return subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                             "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                             "--object-store-memory", str(80 << 20), "--disable-usage-stats",
                             "--include-log-monitor", "false", "--dashboard-agent-listen-port", str(free_port()),
                             *args], stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _stop_node(node: subprocess.Popen) -> None:
    node.terminate()  # `ray start --block` stops its node's processes on SIGTERM
    try:
        node.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(node.pid, signal.SIGKILL)  # whatever of its group is left
    except ProcessLookupError:
        pass
    node.wait()


@contextmanager
def local_cluster(nodes: int) -> Iterator[str]:
    """A head and ``nodes - 1`` worker nodes, one CPU each, joined: the head's address (HOST:PORT; not a ray://
    client address, whose per-client server failed to start in 3 of 5 pytest runs)."""
    try:
        import ray
    except ImportError:
        raise BackendUnavailableError("a local Ray cluster needs Ray, which is not installed here; install it with "
                                      "pip install 'npumoe[cluster]'.") from None
    temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    port = free_port()
    started = [_start_node(["--head", "--port", str(port), "--ray-client-server-port", str(free_port()),
                            "--include-dashboard", "false", "--dashboard-port", str(free_port()),
                            "--temp-dir", str(temp)], temp / "head.log")]
    try:
        _wait_for(ray, f"127.0.0.1:{port}", 1, temp)  # a worker started sooner gives up ("no node info for head")
        started += [_start_node(["--address", f"127.0.0.1:{port}"], temp / f"worker{i}.log") for i in range(1, nodes)]
        _wait_for(ray, f"127.0.0.1:{port}", nodes, temp)
        yield f"127.0.0.1:{port}"
    finally:
        for node in reversed(started):
            _stop_node(node)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for(ray, address: str, nodes: int, temp: Path) -> None:
    """Until ``nodes`` nodes of the cluster at ``address`` are alive (a head still registering itself makes
    ray.init raise a bare Exception: tried again)."""
    deadline = time.monotonic() + JOIN_SECONDS
    while time.monotonic() < deadline:
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except Exception:
            ray.shutdown()
            time.sleep(1)
            continue
        try:
            while time.monotonic() < deadline:
                if sum(n["Alive"] for n in ray.nodes()) == nodes:
                    return
                time.sleep(0.5)
        finally:
            ray.shutdown()
    last = {p.name: (p.read_text().strip().splitlines() or [""])[-1][-200:] for p in sorted(temp.glob("*.log"))}
    raise BackendUnavailableError(f"{nodes} local Ray nodes did not all join in {JOIN_SECONDS} s (their logs end: "
                                  f"{last}); is this machine out of memory or processes?")
