"""The conformance suite, for every installed backend (`pytest --backend NAME` for one): each passes
the checks at its declared tolerance, and a backend that computes something else does not."""

import json
from dataclasses import replace

import pytest

from npumoe.backends.cpu.backend import CpuBackend
from npumoe.core.compiler.interpreter import TorchGraphExecutor
from npumoe.core.ir import backend as registry
from npumoe.core.tools.conformance import run_conformance


@pytest.fixture(scope="module")
def outcomes(conformance_target):
    return {o.check: o for o in run_conformance(conformance_target)}


def test_every_check_passes_or_is_excused_with_a_reason(conformance_target, outcomes):
    failed = {c: o.detail for c, o in outcomes.items() if o.status == "failed"}
    assert not failed, failed
    required = {"build", "graph.experts", "graph.experts.capacities", "input.missing", "engine.prefill_decode",
                "artifacts.fresh_process", "build.deterministic"}
    if conformance_target != "cpu":  # the CPU target keeps dense graphs as they are: its own reference
        required |= {"graph.attention", "input.wrong_shape"}
    claimed = registry.plugin(conformance_target).caps.ops - {"lut_linear"}  # lut_linear needs a packed checkpoint
    required |= {f"op.{op}" for op in claimed}
    assert required <= {c for c, o in outcomes.items() if o.status == "passed"}
    assert all(o.detail for o in outcomes.values() if o.status == "skipped")


class PerturbingExecutor(TorchGraphExecutor):
    """The reference's outputs, each nudged by 1 %: what a subtly wrong lowering looks like."""

    def __call__(self, inputs):
        return {n: t * 1.01 if t.is_floating_point() else t for n, t in super().__call__(inputs).items()}


class PerturbingBackend(CpuBackend):
    name = "perturbing"

    def load(self, artifact, out_dir, graph, weights):
        return PerturbingExecutor(graph, weights)


def test_a_backend_that_computes_something_else_fails(monkeypatch):
    cpu = registry.plugin("cpu")
    wrong = replace(cpu, name="perturbing", factory="test_conformance:PerturbingBackend")
    found, broken = registry._registry()
    monkeypatch.setattr(registry, "_registry", lambda: ({**found, "perturbing": wrong}, broken))
    outcomes = {o.check: o for o in run_conformance("perturbing")}
    assert (outcomes["graph.experts"].status == "failed"
            and "relative error 1.00e-02" in outcomes["graph.experts"].detail)
    assert outcomes["engine.prefill_decode"].status == "failed"
    assert outcomes["op.linear"].status == "failed" and outcomes["op.rmsnorm"].status == "failed"


def test_conformance_cli_prints_json_and_exits_by_result(capsys):
    from npumoe.cli import main

    main(["conformance", "--target", "cpu", "--json"])  # returns: every check passed
    result = json.loads(capsys.readouterr().out)
    assert result["target"] == "cpu" and not result["failed"] and "engine.prefill_decode" in result["passed"]
