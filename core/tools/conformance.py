"""What "a working backend" means, as checks every backend runs (compare ggml's test-backend-ops).

Each check has a stable id and compares the backend with the reference interpreter at the tolerance
the backend declares (``BackendPlugin.conformance``): every graph kind lowered, loaded and run; the
engine's prefill and decode under a plan that puts every group on the NPU; artifacts loaded and run in
a fresh process; a rebuild from an empty build cache. A check the backend is excused from is skipped
with the reason its plugin gives. Runs on the demo model, so it needs no checkpoint.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from npumoe.core.base.progress import task
from npumoe.core.compiler.interpreter import TorchGraphExecutor, value_shapes
from npumoe.core.ir.backend import Lowered, get_backend, plugin
from npumoe.core.ir.graph import OPS, WEIGHT_PREFIX, Graph, Op, Role, TensorType

CHUNK, MAX_CONTEXT = 16, 64
PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
KINDS = ("attention", "experts", "ffn", "lm_head")


class NotApplicable(Exception):
    """The check has nothing to test on this model or backend: reported as skipped, with the reason."""


@dataclass(frozen=True)
class Outcome:
    check: str
    status: str  # passed | failed | skipped
    detail: str  # the measured error against the tolerance, or why it failed or was skipped

    def to_json(self) -> dict:
        return {"check": self.check, "status": self.status, "detail": self.detail}


class Conformance:
    """The checks for one target, sharing one build of the demo model's planned graphs."""

    def __init__(self, target: str, work: Path):
        from npumoe.core.planning.plan import plan
        from npumoe.core.runtime.calibrate import calibrate
        from npumoe.models.loader import load

        self.target, self.work = target, Path(work)
        self.declared = plugin(target).conformance
        self.model = load()
        self.ids = np.asarray(self.model.tokenizer.encode(PROMPT))[: MAX_CONTEXT - 16]  # room to generate
        profile = calibrate(self.model, [PROMPT * 8], chunk=CHUNK)
        self.plan = plan(self.model, profile, target=target, residency="npu")
        self.artifacts = self.work / "artifacts"

    def checks(self) -> dict[str, Callable[[], str]]:
        """Check id → a function returning what it measured (raising AssertionError when it fails)."""
        op_checks = {f"op.{op}": (lambda op=op: self.one_op(op)) for op in sorted(OPS)}
        graph_checks = {f"graph.{kind}": (lambda kind=kind: self.graph_kind(kind)) for kind in KINDS}
        return {"build": self.build, **op_checks, **graph_checks, "graph.experts.capacities": self.capacities,
                "input.missing": self.missing_input,
                "input.wrong_shape": self.wrong_shape, "engine.prefill_decode": self.engine,
                "artifacts.fresh_process": self.fresh_process, "build.deterministic": self.rebuild}

    def run(self, progress: bool | None = None) -> list[Outcome]:
        skips = dict(self.declared.skips)
        outcomes = []
        checks = self.checks()
        with task(f"conformance {self.target}", len(checks), "checks", progress) as step:
            for check, fn in checks.items():
                step.describe(f"conformance {self.target}: {check}")
                outcomes.append(self._outcome(check, fn, outcomes, skips))
                step.advance()
        return outcomes

    @staticmethod
    def _outcome(check: str, fn: Callable[[], str], before: list[Outcome], skips: dict[str, str]) -> Outcome:
        if before and before[0].check == "build" and before[0].status == "failed":
            return Outcome(check, "failed", "not run: the build failed")
        if check in skips:
            return Outcome(check, "skipped", skips[check])
        try:
            return Outcome(check, "passed", fn())
        except NotApplicable as why:
            return Outcome(check, "skipped", str(why))
        except Exception as err:  # a failing backend may raise anything; the table names it
            return Outcome(check, "failed", f"{type(err).__name__}: {err}"[:300])

    # -- the checks -----------------------------------------------------------------------------
    def build(self) -> str:
        from npumoe.core.compiler.artifacts import build

        manifest = build(self.model, self.plan, self.target, self.artifacts, max_context=MAX_CONTEXT)
        return f"{len(manifest['graphs'])} graphs"

    def one_op(self, op: str) -> str:
        """One IR op as a graph of its own, built, loaded and run against the interpreter: what a backend
        claims (Capabilities.ops), its lowering must take. Ops come from the demo's planned graphs, or as
        small synthetic graphs for those the demo does not use."""
        if op not in self.op_graphs:
            raise NotApplicable(f"no single-op graph of {op} here (it needs a packed low-bit checkpoint)")
        graph, weights = self.op_graphs[op]
        if op not in plugin(self.target).caps.ops:
            raise NotApplicable(f"{self.target} does not claim {op}; the planner keeps it on the CPU")
        return self._alone(graph, weights)

    def capacities(self) -> str:
        """An expert group whose experts hold different capacities (1, 2 and 3 × the alignment: each expert its own
        slice of the input, as a plan's shapes have them), built alone, against the interpreter."""
        from npumoe.core.compiler.graphs import experts_graph

        a = plugin(self.target).caps.alignment
        layer = self.model.spec.moe_layers[0]
        return self._alone(experts_graph(self.model.spec, layer, (0, 1, 2), (a, 2 * a, 3 * a), "experts_capacities"),
                           self.model.weights)

    def _alone(self, graph: Graph, weights: Mapping[str, torch.Tensor]) -> str:
        """``graph`` built on its own, loaded and run on random inputs against the interpreter."""
        backend = get_backend(self.target)
        out = self.work / "alone" / graph.name
        entry = backend.build([graph], weights, out, progress=False)[graph.name]
        executor = backend.load(Lowered.from_entry(entry), out, graph, weights)
        feed = random_feed(graph)
        return self._within(executor(feed), TorchGraphExecutor(graph, weights)(feed))

    @functools.cached_property
    def op_graphs(self) -> dict[str, tuple[Graph, Mapping[str, torch.Tensor]]]:
        from npumoe.core.compiler.program import build_program

        found: dict[str, tuple[Graph, Mapping[str, torch.Tensor]]] = {}
        program = build_program(self.model.spec, chunk=self.plan.chunk, max_context=MAX_CONTEXT, plan=self.plan)
        for graph in program.graphs.values():
            shapes = value_shapes(graph, self.model.weights)
            for op in graph.ops:
                if op.op not in found:
                    found[op.op] = (single_op_graph(graph, op, shapes), self.model.weights)
        return found | {op: made for op, made in synthetic_op_graphs().items() if op not in found}

    def graph_kind(self, kind: str) -> str:
        """One built graph of ``kind`` on random inputs (empty KV cache) against the interpreter."""
        from npumoe.core.compiler.artifacts import load_executors
        from npumoe.core.compiler.program import build_program

        program = build_program(self.model.spec, chunk=self.plan.chunk, max_context=MAX_CONTEXT, plan=self.plan)
        graphs = [g for g in program.graphs.values() if g.kind == kind and g.placement == "npu"]
        if not graphs:
            raise NotApplicable(f"the demo model has no {kind} graph on the NPU under this plan")
        graph = max(graphs, key=lambda g: g.inputs[next(iter(g.inputs))].shape[0])  # its prefill chunk
        executor = load_executors(get_backend(self.target), self.artifacts, [graph], self.model.weights,
                                  self.model)[graph.name]
        feed = random_feed(graph)
        got = executor({n: t for n, t in feed.items()
                        if not (executor.keeps_state and graph.inputs[n].role == Role.KV_CACHE)})
        want = TorchGraphExecutor(graph, self.model.weights)(feed)
        return self._within(got, want)

    def missing_input(self) -> str:
        """A feed without one of the inputs the executor reads: a typed error naming it, not a crash."""
        graph, executor = self._attention()
        feed = random_feed(graph)
        del feed["x"]
        return self._refused(executor, feed, "'x'")

    def wrong_shape(self) -> str:
        """A compiled graph fed an input of another shape: a typed error, never a wrong answer."""
        graph, executor = self._attention()
        if isinstance(executor, TorchGraphExecutor):
            raise NotApplicable("the reference interpreter takes any shape")
        feed = random_feed(graph)
        feed["x"] = torch.zeros(feed["x"].shape[0] + 1, feed["x"].shape[1])
        return self._refused(executor, feed, "shape")

    def _attention(self):
        from npumoe.core.compiler.artifacts import load_executors
        from npumoe.core.compiler.program import build_program

        program = build_program(self.model.spec, chunk=self.plan.chunk, max_context=MAX_CONTEXT, plan=self.plan)
        graph = program.graphs[program.layers[0].attention[self.plan.chunk]]
        if graph.placement != "npu":
            return graph, TorchGraphExecutor(graph, self.model.weights)
        executor = load_executors(get_backend(self.target), self.artifacts, [graph], self.model.weights,
                                  self.model)[graph.name]
        return graph, executor

    @staticmethod
    def _refused(executor, feed, naming: str) -> str:
        from npumoe.core.base.errors import NpumoeError

        try:
            executor(feed)
        except NpumoeError as err:
            assert naming in str(err), f"the error does not name the problem: {err}"
            return f"{type(err).__name__}: {err}"
        raise AssertionError("the executor ran on a bad feed without a word")

    def engine(self) -> str:
        from npumoe.core.runtime.engine import Engine

        run = Engine(self.model, backend=self.target, artifacts=self.artifacts)
        reference = Engine(self.model, chunk=run.program.chunk, max_context=run.cache.capacity)
        got, want = run.forward(self.ids), reference.forward(self.ids)
        cosine = float(np.min(_cosines(got, want)))
        assert cosine >= self.declared.min_cosine, f"prefill logits cosine {cosine:.6f} < {self.declared.min_cosine}"
        same = np.array_equal(run.generate(self.ids, 16), reference.generate(self.ids, 16))
        assert same, "greedy decode differs from the reference's"
        return f"prefill cosine ≥ {cosine:.6f}, 16 greedy tokens equal"

    def fresh_process(self) -> str:
        """The artifacts loaded and run by a new interpreter: nothing lives only in the builder's memory."""
        from npumoe.core.runtime.engine import Engine

        here = Engine(self.model, backend=self.target, artifacts=self.artifacts).forward(self.ids)
        out = self.work / "fresh.npy"
        script = ("import json, sys, numpy as np, npumoe\n"
                  "m = npumoe.load()\n"
                  "eng = npumoe.Engine(m, backend=sys.argv[1], artifacts=sys.argv[2])\n"
                  "np.save(sys.argv[4], eng.forward(np.asarray(json.loads(sys.argv[3]))))\n")
        done = subprocess.run([sys.executable, "-c", script, self.target, str(self.artifacts),
                               json.dumps(self.ids.tolist()), str(out)], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert done.returncode == 0, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"
        gap = float(np.abs(np.load(out) - here).max())
        assert gap <= 1e-5, f"logits differ by {gap:.2e} between processes"
        return f"max |Δ| {gap:.1e} between processes"

    def rebuild(self) -> str:
        """A rebuild from an empty build cache runs to the same logits (bytes may differ: timestamps)."""
        from npumoe.core.compiler.artifacts import build
        from npumoe.core.runtime.engine import Engine

        again = self.work / "again"
        previous = os.environ.get("NPUMOE_BUILD_CACHE")
        os.environ["NPUMOE_BUILD_CACHE"] = str(self.work / "empty-cache")
        try:
            build(self.model, self.plan, self.target, again, max_context=MAX_CONTEXT)
        finally:
            if previous is None:
                os.environ.pop("NPUMOE_BUILD_CACHE", None)
            else:
                os.environ["NPUMOE_BUILD_CACHE"] = previous
        first = Engine(self.model, backend=self.target, artifacts=self.artifacts).forward(self.ids)
        second = Engine(self.model, backend=self.target, artifacts=again).forward(self.ids)
        gap = float(np.abs(first - second).max())
        assert gap == 0.0, f"a rebuild's logits differ by {gap:.2e}"
        return "identical logits"

    def _within(self, got: dict, want: dict) -> str:
        worst_cos, worst_rel = 1.0, 0.0
        for name, w in want.items():
            g = got[name].float()
            assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)}, the reference's {tuple(w.shape)}"
            rel = float((g - w).abs().max() / (w.abs().max() + 1e-30))
            cos = float(torch.nn.functional.cosine_similarity(g.flatten(), w.flatten(), dim=0))
            worst_cos, worst_rel = min(worst_cos, cos), max(worst_rel, rel)
        limit = self.declared
        assert worst_cos >= limit.min_cosine and worst_rel <= limit.max_relative_error, (
            f"cosine {worst_cos:.6f} (≥ {limit.min_cosine}), relative error {worst_rel:.2e} "
            f"(≤ {limit.max_relative_error:.0e})")
        return f"cosine {worst_cos:.6f}, relative error {worst_rel:.1e}"


def single_op_graph(source: Graph, op: Op, shapes: dict[str, tuple[int, ...]]) -> Graph:
    """``op`` of ``source`` alone: its value inputs become graph inputs (keeping their roles), its outputs
    the graph's outputs, its weights still named."""
    values = dict.fromkeys(n for n in op.inputs if not n.startswith(WEIGHT_PREFIX))
    inputs = {n: source.inputs.get(n, TensorType(shapes[n])) for n in values}
    return Graph(f"op_{op.op}", "ffn", inputs, {n: TensorType(shapes[n]) for n in op.outputs}, [op], layer=source.layer)


def synthetic_op_graphs() -> dict[str, tuple[Graph, Mapping[str, torch.Tensor]]]:
    """One small graph per op a model may use beyond the demo's (activations, affine maps, LayerNorm)."""
    g = torch.Generator().manual_seed(1)
    weights = {"ln.w": torch.randn(32, generator=g), "ln.b": torch.randn(32, generator=g)}
    attrs = {"gelu": {"approximate": "tanh"}, "affine": {"scale": 0.5, "shift": 0.25},
             "clamp": {"min": -1.0, "max": 1.0}, "layernorm": {"eps": 1e-5}}
    made = {}
    for op in ("relu", "sigmoid", "silu", "gelu", "affine", "clamp", "layernorm"):
        args = ("x", "w:ln.w", "w:ln.b") if op == "layernorm" else ("x",)
        ir_op = Op(op, args, ("y",), tuple(attrs.get(op, {}).items()))
        made[op] = (Graph(f"op_{op}", "ffn", {"x": TensorType((16, 32))}, {"y": TensorType((16, 32))}, [ir_op]),
                    weights)
    return made


def random_feed(graph) -> dict[str, torch.Tensor]:
    """Inputs a graph accepts: random activations and tables, an open mask, an empty cache, position 0."""
    g = torch.Generator().manual_seed(0)
    feed = {}
    for name, t in graph.inputs.items():
        if t.role == Role.POSITION:
            feed[name] = torch.zeros(t.shape, dtype=torch.int32)
        elif t.role in (Role.MASK, Role.KV_CACHE):
            feed[name] = torch.zeros(t.shape)
        else:
            feed[name] = torch.randn(t.shape, generator=g)
    return feed


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30)


def run_conformance(target: str, progress: bool | None = None) -> list[Outcome]:
    """Every check for ``target`` (``progress``: shown on stderr; None: as the process says, see
    :mod:`npumoe.core.base.progress`)."""
    with tempfile.TemporaryDirectory(prefix="npumoe-conformance-") as work:
        with task(f"conformance {target}: loading, calibrating and planning the demo model", progress=progress):
            checks = Conformance(target, Path(work))
        return checks.run(progress)
