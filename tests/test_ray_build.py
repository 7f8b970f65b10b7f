"""npumoe build --cluster: units lowered on a two-node Ray cluster the test starts on 127.0.0.1 are, byte for
byte, what a local build writes; a worker that dies is retried, a killed driver resumes from the cache, and a
bad address, cache or missing Ray is one line."""

import json
import os
import signal
import sys
import types
from pathlib import Path

import pytest
from cli_check import cli_error

import npumoe
from npumoe.backends.build_cache import BuildUnit, lower_units
from npumoe.backends.ray_local import free_port, local_cluster
from npumoe.cli import main
from npumoe.core.base.progress import task
from npumoe.core.compiler.artifacts import build

try:
    import ray
except ImportError:
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason="--cluster needs Ray (pip install 'npumoe[cluster]')")


@pytest.fixture(scope="module")
def cluster():
    """A head and a worker node on 127.0.0.1, one CPU each: the head's address."""
    with local_cluster(2) as address:
        yield address


@pytest.fixture(scope="module")
def model():
    return npumoe.load()


@pytest.fixture(scope="module")
def npu_plan(model, tmp_path_factory):
    """An intel_npu plan: its OpenVINO IR is the same bytes whichever process lowers a graph (the HTP's QNN
    context binaries are not even between two builds in one process)."""
    pytest.importorskip("openvino", reason="the intel_npu target needs OpenVINO (pip install 'npumoe[intel]')")
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
    plan = npumoe.plan(model, npumoe.calibrate(model, [text], chunk=16), target="intel_npu", residency="npu")
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return plan, path


@pytest.fixture
def lowered_here(monkeypatch):
    """Graphs intel_npu lowers in this process (a worker unpickles the class from its module, unpatched)."""
    from npumoe.backends.intel_npu.backend import IntelNpuBackend

    names, lower = [], IntelNpuBackend.lower
    monkeypatch.setattr(IntelNpuBackend, "lower", lambda self, g, w, o: names.append(g.name) or lower(self, g, w, o))
    return names


@needs_ray
def test_a_killed_drivers_build_resumes_on_the_cluster_into_what_a_local_build_writes(
        model, npu_plan, cluster, lowered_here, tmp_path, monkeypatch, capsys):
    """Layers 0-1: layer 0's lowered on the cluster by a driver that stops there, as if killed; the
    CLI's build resumes from the shared cache, lowers layer 1's on both nodes, and writes a local build's bytes."""
    from npumoe.backends.ray_cluster import connected

    plan, plan_path = npu_plan
    local = build(model, plan, "intel_npu", tmp_path / "local", progress=False, layers={0, 1})
    lowered_here.clear()
    cache = tmp_path / "shared-cache"
    monkeypatch.setenv("NPUMOE_BUILD_CACHE", str(cache))
    with connected(cluster) as on_cluster:
        first = build(model, plan, "intel_npu", tmp_path / "layer0", progress=False, layers={0}, jobs=on_cluster)
    out = tmp_path / "remote"
    main(["build", "--plan", str(plan_path), "--target", "intel_npu", "--out", str(out), "--layers", "0-1",
          "--cluster", cluster, "--cache", str(cache)])
    remote = json.loads((out / "manifest.json").read_text())
    assert lowered_here == [] and sum(on_cluster.nodes_used.values()) == len(first["graphs"])  # all on the cluster
    assert remote["files"] == local["files"]  # the same files, byte for byte (sha256)
    assert len(local["files"]) == 2 * len(local["graphs"])  # each graph's IR: its .xml and its .bin
    resumed = {name for name, g in remote["graphs"].items() if g["cached"]}
    assert resumed == set(first["graphs"]) and 0 < len(resumed) < len(remote["graphs"])
    assert f"{len(remote['graphs']) - len(resumed)} units lowered on 2 nodes" in capsys.readouterr().out


def lower_toy(attempts: Path, then, unit_dir: Path) -> dict:
    """A unit's lowering that records each attempt, then does ``then(attempt number)`` and writes one file."""
    with attempts.open("a") as f:
        f.write("attempt\n")
    then(len(attempts.read_text().splitlines()))
    (unit_dir / "toy.txt").write_text("lowered")
    return {"toy": {"format": "toy", "files": ["toy.txt"]}}


def killed_the_first_time(attempt: int) -> None:
    if attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would


def refuses(attempt: int) -> None:
    from npumoe.core.base.errors import InputError

    raise InputError("toy does not fit")


def lower_on(cluster_address: str, then, tmp_path: Path) -> dict:
    """One toy unit lowered on the cluster (this module's functions travel by value: workers cannot import it)."""
    from npumoe.backends.ray_cluster import connected

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    unit = BuildUnit(f"toy-{tmp_path.name}", [types.SimpleNamespace(name="toy")],
                     lambda unit_dir: lower_toy(tmp_path / "attempts", then, unit_dir))
    with connected(cluster_address) as on_cluster, task("toy", total=1, progress=False) as step:
        return lower_units([unit], tmp_path / "out", step, jobs=on_cluster)


@needs_ray
def test_a_unit_whose_worker_dies_is_lowered_again(cluster, tmp_path):
    entries = lower_on(cluster, killed_the_first_time, tmp_path)
    assert entries["toy"]["cached"] is False and (tmp_path / "out" / "toy.txt").read_text() == "lowered"
    assert len((tmp_path / "attempts").read_text().splitlines()) == 2


@needs_ray
def test_a_unit_that_fails_stops_the_build_with_its_error_untried_again(cluster, tmp_path):
    from npumoe.core.base.errors import InputError

    with pytest.raises(InputError, match="toy does not fit"):
        lower_on(cluster, refuses, tmp_path)
    assert len((tmp_path / "attempts").read_text().splitlines()) == 1


# -- bad input: one line, before any work -----------------------------------------------------------
@pytest.fixture
def plan_args(tmp_path):
    """Build arguments up to the cluster's: none of the errors below gets as far as reading the plan."""
    return ["build", "--plan", str(tmp_path / "plan.json"), "--target", "htp", "--out", str(tmp_path / "out")]


@needs_ray
def test_an_address_nothing_answers_at_is_one_line(plan_args, capsys):
    port = free_port()
    assert f"nothing answers at 127.0.0.1:{port}" in cli_error(capsys, *plan_args, "--cluster", f"127.0.0.1:{port}")
    assert "nothing answers at ray://127.0.0.1" in cli_error(capsys, *plan_args, "--cluster", f"ray://127.0.0.1:{port}")


@needs_ray
def test_bench_scale_names_an_address_nothing_answers_at_before_any_work(capsys):  # one line: no progress yet
    from npumoe.models.demo import DEMO_DIR

    port = free_port()
    assert f"nothing answers at 127.0.0.1:{port}" in cli_error(
        capsys, "bench", "scale", "--ckpt", str(DEMO_DIR), "--layers", "1", "--cluster", f"127.0.0.1:{port}")


@needs_ray
@pytest.mark.parametrize("address, message", [
    ("http://127.0.0.1:8265", "is not a Ray address"),
    ("127.0.0.1", "is not a Ray address"),
    ("auto", "RAY_ADDRESS, which is not set"),
])
def test_addresses_that_name_no_cluster_are_one_line(plan_args, capsys, monkeypatch, address, message):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert message in cli_error(capsys, *plan_args, "--cluster", address)


def test_a_missing_ray_names_the_extra(plan_args, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    assert "pip install 'npumoe[cluster]'" in cli_error(capsys, *plan_args, "--cluster", "auto")


def test_a_cache_that_cannot_be_written_is_one_line(plan_args, capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    assert "--cache" in cli_error(capsys, *plan_args, "--cache", str(tmp_path / "a-file" / "cache"))
    assert "not the URL s3://bucket/cache" in cli_error(capsys, *plan_args, "--cache", "s3://bucket/cache")
    assert "drop --jobs" in cli_error(capsys, *plan_args, "--cluster", "auto", "--jobs", "2")
    assert not (tmp_path / "out").exists()


def test_a_file_url_cache_is_its_directory(plan_args, capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    assert "a-file/cache is not a directory" in cli_error(capsys, *plan_args, "--cache", f"file://{tmp_path}/a-file/cache")
    assert "plan.json" in cli_error(capsys, *plan_args, "--cache", f"file://localhost{tmp_path}/my%20cache")
    assert (tmp_path / "my cache").is_dir()  # made, proved writable, then the missing plan stopped the build


def test_weights_travel_as_where_to_map_them_not_as_their_bytes():
    import pickle

    from npumoe.core.base.errors import InputError
    from npumoe.core.ir.weights import Weights

    model = npumoe.load()
    sent = pickle.dumps(model.weights)
    assert len(sent) < 1000 < sum(model.weights.stored_dtypes.values())  # a path and a dtype, not 3.3 M weights
    names, received = list(model.weights), pickle.loads(sent)
    assert received.digest(names) == model.weights.digest(names) and received.dtype == model.weights.dtype
    in_memory = Weights({n: model.weights[n] for n in model.weights}, model.spec)
    with pytest.raises(InputError, match="made in memory"):
        pickle.dumps(in_memory)


@needs_ray
def test_bench_scale_cluster_lowers_every_unit_on_one_then_two_workers_into_a_local_builds_bytes(cluster, capsys):
    from npumoe.models.demo import DEMO_DIR

    main(["bench", "scale", "--ckpt", str(DEMO_DIR), "--layers", "1", "--cluster", cluster, "--json"])
    result = json.loads(capsys.readouterr().out)["cluster"]
    assert [run["workers"] for run in result["runs"]] == [1, 2]  # one per CPU of the cluster
    assert all(sum(run["units_per_node"]) == result["graphs"] > 4 for run in result["runs"])
    assert len(result["runs"][1]["units_per_node"]) == 2 and all(run["identical"] for run in result["runs"])
