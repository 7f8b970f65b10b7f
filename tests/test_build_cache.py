"""Builds go through a content-addressed per-graph cache: a killed build resumes, an unchanged graph is
never compiled twice, and a change to a graph's weights or the backend's options compiles it again."""

import dataclasses

import pytest
import torch

import npumoe
from npumoe.backends.cpu.backend import CpuBackend
from npumoe.core.compiler.artifacts import build, load_executors
from npumoe.core.compiler.program import build_program
from npumoe.core.ir.weights import Weights


@pytest.fixture(scope="module")
def model():
    return npumoe.load()


@pytest.fixture(scope="module")
def cpu_plan(model):
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 8
    return npumoe.plan(model, npumoe.calibrate(model, [text], chunk=16), target="cpu", residency="npu")


@pytest.fixture
def lowered(monkeypatch, tmp_path):
    """The names of the graphs the CPU backend really lowers, with a fresh cache."""
    monkeypatch.setenv("NPUMOE_BUILD_CACHE", str(tmp_path / "cache"))
    names = []
    lower = CpuBackend.lower

    def counting(self, graph, weights, out_dir):
        names.append(graph.name)
        return lower(self, graph, weights, out_dir)

    monkeypatch.setattr(CpuBackend, "lower", counting)
    return names


def test_a_killed_build_resumes_with_its_finished_graphs(model, cpu_plan, lowered, tmp_path, monkeypatch):
    first = build(model, cpu_plan, "cpu", tmp_path / "full", progress=False)
    graphs = len(first["graphs"])
    assert graphs > 4 and len(lowered) == graphs and not any(g["cached"] for g in first["graphs"].values())
    lowered.clear()
    monkeypatch.setenv("NPUMOE_BUILD_CACHE", str(tmp_path / "cache2"))
    lower = CpuBackend.lower

    def killed_after_three(self, graph, weights, out_dir):
        if len(lowered) == 3:
            raise KeyboardInterrupt  # Ctrl-C, or the OOM killer, mid-build
        return lower(self, graph, weights, out_dir)

    monkeypatch.setattr(CpuBackend, "lower", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        build(model, cpu_plan, "cpu", tmp_path / "killed", progress=False)
    assert not (tmp_path / "killed").exists()
    monkeypatch.setattr(CpuBackend, "lower", lower)
    lowered.clear()
    resumed = build(model, cpu_plan, "cpu", tmp_path / "killed", progress=False)
    assert sum(g["cached"] for g in resumed["graphs"].values()) == 3
    assert len(lowered) == graphs - 3
    assert {n: {k: v for k, v in g.items() if k not in ("cached", "seconds")} for n, g in resumed["graphs"].items()} \
        == {n: {k: v for k, v in g.items() if k not in ("cached", "seconds")} for n, g in first["graphs"].items()}


def test_only_graphs_whose_weights_changed_are_compiled_again(model, cpu_plan, lowered, tmp_path):
    build(model, cpu_plan, "cpu", tmp_path / "a", progress=False)
    lowered.clear()
    build(model, cpu_plan, "cpu", tmp_path / "b", progress=False)
    assert lowered == []  # all from the cache
    tensors = {n: model.weights[n] for n in model.weights}
    name = "layers.1.moe.experts.0.up.weight"
    tensors[name] = tensors[name] + 1e-3  # a fine-tune of one expert
    tuned = dataclasses.replace(model, weights=Weights(tensors, model.spec))
    manifest = build(tuned, cpu_plan, "cpu", tmp_path / "c", progress=False)
    holding = [g for g, entry in manifest["graphs"].items() if not entry["cached"]]
    assert sorted(lowered) == sorted(holding) and lowered, lowered
    holding_expert = {shape.graph for seq in (cpu_plan.chunk, 1) for group in cpu_plan.groups(1, seq)
                      if 0 in group.experts for shape in group.shapes}  # layer 1's graphs with expert 0
    assert sorted(lowered) == sorted(holding_expert) and len(lowered) < len(manifest["graphs"]) / 3


def test_every_graph_records_its_compile_time(model, cpu_plan, lowered, tmp_path):
    manifest = build(model, cpu_plan, "cpu", tmp_path / "a", progress=False)
    assert all(g["seconds"] >= 0 and g["cached"] is False for g in manifest["graphs"].values())


def test_weights_digest_reads_stored_bytes(model):
    """A bf16-computed model and its fp32 twin hash the same stored bytes; one flipped bit does not."""
    names = list(model.weights)[:5]
    tensors = {n: model.weights[n].clone() for n in model.weights}
    assert Weights(tensors, model.spec).digest(names) == model.weights.digest(names)
    tensors[names[2]].view(torch.int32)[0, 0] ^= 1
    assert Weights(tensors, model.spec).digest(names) != model.weights.digest(names)


def test_layers_builds_a_subset_that_says_it_cannot_run(model, cpu_plan, lowered, tmp_path, capsys):
    from cli_check import cli_error

    from npumoe.core.base.errors import ArtifactError, InputError

    manifest = build(model, cpu_plan, "cpu", tmp_path / "one", progress=False, layers={1})
    assert (manifest["layers"] == [1] and manifest["graphs"]
            and all(g["layer"] == 1 for g in manifest["graphs"].values()))
    program = build_program(model.spec, chunk=cpu_plan.chunk, max_context=512, plan=cpu_plan)
    npu = [g for g in program.graphs.values() if g.placement == "npu"]
    with pytest.raises(ArtifactError, match=r"holds only layers \[1\] \(built with --layers\)"):
        load_executors(CpuBackend(), tmp_path / "one", npu, model.weights, model)
    with pytest.raises(InputError, match="--layers names layer 9"):
        build(model, cpu_plan, "cpu", tmp_path / "x", progress=False, layers={0, 9})
    plan_path = tmp_path / "plan.json"
    cpu_plan.save(plan_path)
    assert "ranges like 0-3,7" in cli_error(capsys, "build", "--plan", str(plan_path), "--target", "htp",
                                            "--out", str(tmp_path / "x"), "--layers", "a-b")


def test_jobs_lower_in_worker_processes_to_the_same_artifacts(model, cpu_plan, lowered, tmp_path, monkeypatch):
    serial = build(model, cpu_plan, "cpu", tmp_path / "serial", progress=False)
    monkeypatch.setenv("NPUMOE_BUILD_CACHE", str(tmp_path / "cache-parallel"))
    lowered.clear()
    parallel = build(model, cpu_plan, "cpu", tmp_path / "parallel", progress=False, jobs=2)
    assert lowered == []  # every graph was lowered in a forked worker, none in this process
    assert not any(g["cached"] for g in parallel["graphs"].values())
    assert parallel["files"] == serial["files"]  # the same files, byte for byte (sha256)
    strip = lambda m: {n: {k: v for k, v in g.items() if k not in ("cached", "seconds")}  # noqa: E731
                       for n, g in m.items()}
    assert strip(parallel["graphs"]) == strip(serial["graphs"])


def test_a_failing_worker_stops_the_build_with_its_error(model, cpu_plan, lowered, tmp_path, monkeypatch):
    from npumoe.core.base.errors import InputError

    def refuses(self, graph, weights, out_dir):
        raise InputError(f"{graph.name} does not fit")

    monkeypatch.setattr(CpuBackend, "lower", refuses)
    with pytest.raises(InputError, match="does not fit"):
        build(model, cpu_plan, "cpu", tmp_path / "failed", progress=False, jobs=2)
    assert not (tmp_path / "failed").exists()


def test_a_worker_killed_midway_is_named_with_the_fix(model, cpu_plan, lowered, tmp_path, monkeypatch):
    import os
    import signal

    from npumoe.core.base.errors import InputError

    monkeypatch.setattr(CpuBackend, "lower", lambda self, graph, weights, out_dir: os.kill(os.getpid(), signal.SIGKILL))
    with pytest.raises(InputError, match="fewer --jobs"):  # as the OOM killer would
        build(model, cpu_plan, "cpu", tmp_path / "killed", progress=False, jobs=2)


def test_a_change_to_npumoes_code_compiles_again(model, cpu_plan, lowered, tmp_path, monkeypatch):
    from npumoe.backends import build_cache

    first = build(model, cpu_plan, "cpu", tmp_path / "a", progress=False)
    lowered.clear()
    monkeypatch.setattr(build_cache, "code_digest", lambda: "an edited lowering")
    again = build(model, cpu_plan, "cpu", tmp_path / "b", progress=False)
    assert len(lowered) == len(first["graphs"]) and not any(g["cached"] for g in again["graphs"].values())


def test_a_damaged_cache_entry_is_built_again_not_signed(model, cpu_plan, lowered, tmp_path, monkeypatch):
    """Artifacts are hard links into the cache: a byte flipped in a built artifact is flipped in its cache entry
    too. The next build must lower that unit again, not link the damaged file in and record its sha256."""
    import os

    from npumoe.backends.build_cache import graph_fingerprint
    from npumoe.core.base.errors import ArtifactError
    from npumoe.core.compiler.artifacts import read_manifest

    counting = CpuBackend.lower

    def writing_a_file(self, graph, weights, out_dir):  # as an NPU backend does (the CPU's lowering writes none)
        (out_dir / f"{graph.name}.bin").write_text(repr(graph_fingerprint(graph)))
        return dataclasses.replace(counting(self, graph, weights, out_dir), files=(f"{graph.name}.bin",))

    monkeypatch.setattr(CpuBackend, "lower", writing_a_file)
    first = build(model, cpu_plan, "cpu", tmp_path / "a", progress=False)
    name, entry = next(iter(first["graphs"].items()))
    damaged = tmp_path / "a" / entry["files"][0]
    os.chmod(damaged, 0o644)  # read-only as built: damage needs a chmod, or root, or a tool writing in place
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(data)
    lowered.clear()
    again = build(model, cpu_plan, "cpu", tmp_path / "b", progress=False)
    assert lowered == [name] and not again["graphs"][name]["cached"]  # that unit only, lowered afresh
    assert again["files"] == first["files"]  # the bytes the first build signed, not the damaged ones
    read_manifest(tmp_path / "b")
    with pytest.raises(ArtifactError, match="no longer matches the sha256 in its manifest"):
        read_manifest(tmp_path / "a")  # the damaged artifact itself is refused
    lowered.clear()
    build(model, cpu_plan, "cpu", tmp_path / "c", progress=False)
    assert lowered == []  # the rebuilt entry is cached again


def _fill_slowly(root: str, log: str, start) -> None:
    """A unit lowered in half a second, each lowering logged: what a second process asking for it must wait on."""
    import time

    from npumoe.backends.build_cache import BuildCache

    def lower(unit_dir):
        with open(log, "a") as f:
            f.write("lowered\n")
        time.sleep(0.5)
        (unit_dir / "unit.bin").write_text("unit")
        return {"g": {"files": ["unit.bin"]}}

    start.wait()
    BuildCache(root).fill("k" * 32, lower)


def test_two_processes_asking_for_one_unit_lower_it_once(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("fork")
    start = context.Event()
    workers = [context.Process(target=_fill_slowly, args=(str(tmp_path / "cache"), str(tmp_path / "log"), start))
               for _ in range(2)]
    for w in workers:
        w.start()
    start.set()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0, 0]
    assert (tmp_path / "log").read_text() == "lowered\n"  # the second linked what the first stored
    assert (tmp_path / "cache" / ("k" * 32) / "unit.bin").read_text() == "unit"
