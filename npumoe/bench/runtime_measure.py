"""What `npumoe bench runtime` measures: one MoE layer's host ops at Phi-3.5-MoE shapes, and the planner's
padding, drops and overlap on the demo model (:mod:`npumoe.bench.runtime` runs it and prints the tables).
Long phases report their progress on stderr (:mod:`npumoe.core.base.progress`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from npumoe.core.base.progress import task, track
from npumoe.core.compiler.graphs import experts_graph
from npumoe.core.compiler.interpreter import TorchGraphExecutor
from npumoe.core.compiler.program import ExpertGroup, StaticShape
from npumoe.core.ir.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec, RopeSpec, RouterSpec
from npumoe.core.ir.weights import compute_bytes
from npumoe.core.planning.plan import optimal_shapes, plan
from npumoe.core.planning.profile import RoutingProfile
from npumoe.core.runtime.cpu_experts import CpuExperts
from npumoe.core.runtime.metrics import Metrics
from npumoe.core.runtime.moe import MoELayer

HOST_OPS = ("router", "gather", "pad", "scatter", "residual")


def phi_layer_spec(hidden: int, intermediate: int, experts: int, top_k: int) -> ModelSpec:
    att = AttentionSpec("gqa", 32, 8, 128, 128, 128**-0.5, RopeSpec())
    moe = MoESpec(experts, RouterSpec(top_k=top_k, normalize=True), MLPSpec(intermediate))
    return ModelSpec("bench", 32064, hidden, (LayerSpec(att, moe),), LayerSpec(att, moe).norm)


def random_moe_weights(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 random router and experts for layer 0 (attention is not part of this benchmark)."""
    gen = torch.Generator().manual_seed(seed)
    moe = spec.layers[0].ffn
    h, i = spec.hidden_size, moe.expert.intermediate
    w = {"layers.0.moe.router.weight": torch.randn(moe.num_experts, h, generator=gen) * h**-0.5}
    for e in range(moe.num_experts):
        for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            w[f"layers.0.moe.experts.{e}.{name}.weight"] = torch.empty(shape).normal_(
                0, shape[1] ** -0.5, generator=gen)
    return w


def host_breakdown(chunk: int, repeats: int, **shapes) -> dict:
    """Seconds per op for one MoE layer over a chunk, static groups sized by our optimiser."""
    torch.set_num_threads(torch.get_num_threads())
    spec = phi_layer_spec(**shapes)
    moe = spec.layers[0].ffn
    weights = random_moe_weights(spec)
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randn(chunk, spec.hidden_size, generator=gen) for _ in range(8)]
    router = weights["layers.0.moe.router.weight"]
    loads = np.stack([torch.bincount(torch.topk(z @ router.T, moe.top_k).indices.flatten(),
                                     minlength=moe.num_experts).numpy() for z in samples])
    (shapes,), _ = optimal_shapes([loads], 1, max_overflow=0.0, count=1)
    group = ExpertGroup("g0", tuple(range(moe.num_experts)), (StaticShape("g0.p0", tuple(shapes[0])),))
    graphs = {"g0.p0": TorchGraphExecutor(experts_graph(spec, 0, group.experts, tuple(shapes[0]), "g0.p0"), weights)}
    cpu_experts = {e: TorchGraphExecutor(experts_graph(spec, 0, (e,), (1,), f"e{e}"), weights)
                   for e in range(moe.num_experts)}
    layer = MoELayer(0, moe, weights, [group], CpuExperts(cpu_experts), "spill")
    m = Metrics()
    run = lambda name, inputs: graphs[name](inputs)  # noqa: E731
    with torch.inference_mode():
        for r in track(range(repeats + 1), "host-op breakdown", "passes"):
            if r == 1:
                m.reset()  # the first pass warms allocators and caches
            z = samples[r % len(samples)]
            y = layer(z, z, chunk, run, m)
            with m.time("residual"):
                z + y
    seconds = {k: v / repeats for k, v in m.seconds.items()}
    seconds["expert_ffn"] = seconds.get("expert_ffn", 0.0) + seconds.pop("cpu_expert_ffn", 0.0)
    host = sum(seconds.get(k, 0.0) for k in HOST_OPS)
    return {"seconds": seconds, "host_over_ffn": host / seconds["expert_ffn"], "capacities": shapes[0].tolist()}


DEMO_TEXTS, DEMO_TEXT_BYTES = 24, 4096  # ~96 K tokens each side: minutes on 2 cores, hundreds of chunks


def demo_texts() -> tuple[list[str], list[str]]:
    """The demo model's own calibration and held-out texts (split by file, as it was trained),
    the first 4 KB of 24 documents each."""
    from npumoe.models.demo import corpus

    calib, held = corpus.calibration_texts(DEMO_TEXTS), corpus.heldout_texts(DEMO_TEXTS)
    return [t[:DEMO_TEXT_BYTES] for t in calib], [t[:DEMO_TEXT_BYTES] for t in held]


def plan_figures(model, calib: RoutingProfile, heldout: list[str], chunk: int, target: str) -> dict:
    """Measured (not predicted) padding / drops / NPU share / expert launches on held-out text, per planning
    method, chunk by chunk and (the default) with expert-wise token buffering across a prompt's chunks."""
    from npumoe.core.runtime.engine import Engine

    windows = _windows(model, heldout, chunk)
    out = {}
    settings = {  # name → plan() arguments, Engine() arguments
        "uniform+drop": (dict(method="uniform", overflow="drop"), {}),
        "paper+drop": (dict(method="paper", overflow="drop"), {}),
        "optimal+spill, 1 shape": (dict(method="optimal", overflow="spill", graphs_per_layer=1), dict(buffering=False)),
        "optimal+spill": (dict(method="optimal", overflow="spill"), dict(buffering=False)),
        "optimal+spill, buffered": (dict(method="optimal", overflow="spill"), {}),
    }
    with task(f"{target} plans on held-out text", len(settings) * len(windows), "windows") as step:
        for name, (plan_kwargs, engine_kwargs) in settings.items():
            p = plan(model, calib, target=target, residency="npu", **plan_kwargs)
            eng = Engine(model, plan=p, max_context=4 * chunk, **engine_kwargs)
            for w in windows:
                eng.forward(np.asarray(w))
                step.advance()
            m = eng.metrics
            npu_slots = m["routed"] - m["spilled"] - m["dropped"] + m["padded"]
            launches = sum(n for g, n in eng.metrics_.graph_runs.items()
                           if g in eng.program.graphs and eng.program.graphs[g].kind == "experts")
            out[name] = {
                "npu_graphs_per_layer": max(sum(len(g.shapes) for g in lp.groups) for lp in p.layers.values()),
                "launches_per_1k": 1000 * launches / sum(len(w) for w in windows),
                "padded_pct": 100 * m["padded"] / max(npu_slots, 1),
                "dropped_pct": 100 * m["dropped"] / m["routed"],
                "spilled_pct": 100 * m["spilled"] / m["routed"],
                "npu_share_pct": 100 * (m["routed"] - m["spilled"] - m["dropped"]) / m["routed"],
            }
    return out


class ModelledLatency:
    """An NPU graph's executor whose calls take the device's modelled time (the cost model's launch + roofline),
    never less than this CPU needs to compute the result it returns: a stand-in NPU whose time is labelled."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds, self.keeps_state = inner, seconds, getattr(inner, "keeps_state", False)

    def __call__(self, inputs):
        start = time.perf_counter()
        out = self.inner(inputs)
        time.sleep(max(0.0, self.seconds - (time.perf_counter() - start)))
        return out


def overlap_figures(model, calib: RoutingProfile, heldout: list[str], chunk: int) -> dict:
    """CPU experts (spilled tokens) beside the NPU launches on held-out text: serial, overlapped with the NPU groups
    on a CPU worker thread (measured), and overlapped with them at a Snapdragon 8 Gen 3's modelled time."""
    from npumoe.core.planning.costmodel import devices, launch_seconds
    from npumoe.core.runtime.engine import Engine

    _, device = devices("htp")[0]  # the HTP this benchmark models: its first listed device
    p = plan(model, calib, target="htp", residency="npu")
    windows = _windows(model, heldout, chunk)
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # the main thread and the stand-in NPU's worker, a core each
    runs = ("serial", "overlapped", "overlapped, modelled NPU")
    with task("CPU experts beside the NPU", len(runs) * len(windows), "windows") as step:
        for name in runs:
            eng = Engine(model, plan=p, max_context=4 * chunk, overlap=name != "serial")
            for g in eng.program.graphs.values():
                if name.endswith("modelled NPU") and g.kind == "experts" and g.placement == "npu":
                    params = compute_bytes(model.weights, g.weight_names()) / model.weights.dtype.itemsize
                    eng.executors[g.name] = ModelledLatency(eng.executors[g.name], launch_seconds(
                        device, 2 * params / len(g.meta["experts"]) * g.inputs["x"].shape[0], 2 * params))
            start = time.perf_counter()
            for w in windows:
                eng.forward(np.asarray(w))
                step.advance()
            s = eng.metrics["seconds"]
            beside = s.get("cpu_beside_npu", 0.0)
            out[name] = {"seconds": time.perf_counter() - start, "cpu_expert_s": s.get("cpu_expert_ffn", 0.0),
                         "npu_expert_s": s.get("expert_ffn", 0.0),
                         "hidden_pct": 100 * s.get("cpu_hidden", 0.0) / beside if beside else 0.0}
    torch.set_num_threads(threads)
    out["device"] = device.name
    return out


def _windows(model, texts: list[str], chunk: int) -> list[list[int]]:
    """Up to four chunks of each held-out text, whole chunks only."""
    ids = [model.tokenizer.encode(t) for t in texts]
    windows = [t[s:s + 4 * chunk] for t in ids for s in range(0, len(t) - chunk + 1, 4 * chunk)]
    return [w[: len(w) // chunk * chunk] for w in windows]

