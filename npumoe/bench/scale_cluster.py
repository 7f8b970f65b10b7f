"""``npumoe bench scale --cluster``: what each worker added to a Ray cluster buys a build.

The same build units are lowered from a cold build cache by 1, 2, … workers at once (a worker: one unit on one
CPU), up to the cluster's CPUs. The target is intel_npu: its OpenVINO IR is the same bytes whichever process
lowers a graph, so every run is checked against a local build of the same plan, byte for byte. Ray keeps a job's
worker processes, so they are started (npumoe and OpenVINO imported) before the first timed run, not in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

TARGET = "intel_npu"
CHUNK = 256  # the prefill chunk the plan's graphs take, as bench scale calibrates


def run_cluster(ckpt: Path, address: str, work: Path, text: Path) -> dict:
    """Lower ``ckpt``'s units locally, then on 1, 2, … workers of the cluster at ``address`` (``local``: one of
    1-CPU nodes on 127.0.0.1, as many as this machine has cores); each run's figures."""
    import npumoe
    from npumoe.backends.ray_cluster import connected
    from npumoe.backends.ray_local import local_cluster
    from npumoe.commands.build import build_cache_at
    from npumoe.core.compiler.artifacts import build

    started = local_cluster(os.cpu_count() or 1) if address == "local" else contextlib.nullcontext(address)
    runs = []
    with started as where, connected(where) as cluster:  # first: a bad address is named before any work
        model = npumoe.load(ckpt)
        plan = npumoe.plan(model, npumoe.calibrate(model, [text.read_text()], chunk=CHUNK), target=TARGET,
                           residency="npu")

        def cold_build(name: str, jobs) -> tuple[dict, float]:
            with build_cache_at(str(work / f"cache-{name}")):
                start = time.perf_counter()
                manifest = build(model, plan, TARGET, work / name, jobs=jobs)
                return manifest, time.perf_counter() - start

        local, local_s = cold_build("local", 1)
        _start_workers(cluster.cpus())
        for workers in range(1, cluster.cpus() + 1):
            cluster.workers, cluster.nodes_used = workers, {}
            manifest, seconds = cold_build(f"workers-{workers}", cluster)
            per_node = sorted(cluster.nodes_used.values(), reverse=True)
            runs.append({"workers": workers, "seconds": seconds, "units_per_node": per_node,
                         "identical": manifest["files"] == local["files"]})
            for leftover in (work / f"workers-{workers}", work / f"cache-workers-{workers}"):
                shutil.rmtree(leftover)
    return {"cluster": address, "target": TARGET, "graphs": len(local["graphs"]), "files": len(local["files"]),
            "local_seconds": local_s, "runs": runs}


def _start_workers(count: int) -> None:
    """``count`` worker processes of this job started, each with the backend imported (held a moment, so that
    Ray gives each its own worker)."""
    import ray

    ray.get([ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(_imported).remote() for _ in range(count)])


def _imported() -> None:
    import npumoe.backends.intel_npu.backend  # noqa: F401

    time.sleep(1)


def print_cluster(result: dict, console: Console) -> None:
    r = result["cluster"]
    one = r["runs"][0]["seconds"]
    table = Table("workers", "wall s", "speed-up vs 1", "units lowered per node", "bytes = local build",
                  title=f"npumoe bench scale --cluster {r['cluster']}: {result['checkpoint']}, {r['target']}, "
                        f"{r['graphs']} graphs")
    for run in r["runs"]:
        table.add_row(str(run["workers"]), f"{run['seconds']:.1f}", f"{one / run['seconds']:.2f}×",
                      " + ".join(map(str, run["units_per_node"])), "yes" if run["identical"] else "NO")
    console.print(table)
    console.print(f"local build (this process, --jobs 1): {r['local_seconds']:.1f} s. Each run starts from an empty "
                  "build cache.")
    if r["cluster"] == "local":
        console.print(f"The cluster ran on this machine's {result['machine']['cpus']} cores, beside whatever else "
                      "runs here: its speed-up is bounded by them. On a real cluster, give its address.")
