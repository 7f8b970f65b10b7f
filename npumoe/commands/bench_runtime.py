"""`npumoe bench runtime`: what the shared host runtime costs, and what the planner buys.

Part 1 reproduces NPUMoE's Table 4 breakdown (router, gather, pad, expert FFN, scatter,
residual) for one MoE layer at Phi-3.5-MoE shapes, with the experts on the CPU, and
reports host-op time over expert-FFN time (the paper measured 2.2).

Part 2 runs the demo model over held-out text under three plans — NPUMoE's single
capacity and its tiers (both dropping overflow, as the paper does) and our optimiser
(spilling) — and reports measured padding, drops and the NPU's share of routed slots.
"""

from __future__ import annotations

import json
import time

import click
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from npumoe.core.calibrate import RoutingProfile, calibrate
from npumoe.core.graphs import experts_graph
from npumoe.core.interpreter import TorchGraphExecutor
from npumoe.core.plan import optimal_tiers, plan
from npumoe.core.program import ExpertGroup
from npumoe.core.runtime.metrics import Metrics
from npumoe.core.runtime.moe import MoELayer
from npumoe.core.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec, RopeSpec, RouterSpec

HOST_OPS = ("router", "gather", "pad", "scatter", "residual")
PHI = dict(hidden=4096, intermediate=6400, experts=16, top_k=2, chunk=256)


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
            w[f"layers.0.moe.experts.{e}.{name}.weight"] = torch.empty(shape).normal_(0, shape[1] ** -0.5, generator=gen)
    return w


def host_breakdown(chunk: int, repeats: int, **shapes) -> dict:
    """Seconds per op for one MoE layer over a chunk, static groups sized by our optimiser."""
    spec = phi_layer_spec(**shapes)
    moe = spec.layers[0].ffn
    weights = random_moe_weights(spec)
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randn(chunk, spec.hidden_size, generator=gen) for _ in range(8)]
    router = weights["layers.0.moe.router.weight"]
    loads = np.stack([torch.bincount(torch.topk(z @ router.T, moe.top_k).indices.flatten(),
                                     minlength=moe.num_experts).numpy() for z in samples])
    tiers, tier_of = optimal_tiers(loads, 1, max_overflow=0.0)
    groups = [ExpertGroup(f"g{t}", tuple(e for e in range(moe.num_experts) if tier_of[e] == t), c)
              for t, c in enumerate(tiers)]
    graphs = {g.graph: TorchGraphExecutor(experts_graph(spec, 0, g.experts, g.capacity, g.graph), weights)
              for g in groups}
    cpu_experts = {e: TorchGraphExecutor(experts_graph(spec, 0, (e,), 1, f"e{e}"), weights)
                   for e in range(moe.num_experts)}
    layer = MoELayer(0, moe, weights, groups, cpu_experts, "spill")
    m = Metrics()
    run = lambda name, inputs: graphs[name](inputs)  # noqa: E731
    with torch.inference_mode():
        for r in range(repeats + 1):
            if r == 1:
                m.reset()  # the first pass warms allocators and caches
            z = samples[r % len(samples)]
            y = layer(z, z, chunk, run, m)
            with m.time("residual"):
                z + y
    seconds = {k: v / repeats for k, v in m.seconds.items()}
    seconds["expert_ffn"] = seconds.get("expert_ffn", 0.0) + seconds.pop("cpu_expert_ffn", 0.0)
    host = sum(seconds.get(k, 0.0) for k in HOST_OPS)
    return {"seconds": seconds, "host_over_ffn": host / seconds["expert_ffn"], "tiers": tiers}


DEMO_TEXTS, DEMO_TEXT_BYTES = 24, 4096  # ~96 K tokens each side: minutes on 2 cores, hundreds of chunks


def demo_texts() -> tuple[list[str], list[str]]:
    """The demo model's own calibration and held-out texts (split by file, as it was trained),
    the first 4 KB of 24 documents each."""
    from npumoe.models.demo import corpus

    calib, held = corpus.calibration_texts(DEMO_TEXTS), corpus.heldout_texts(DEMO_TEXTS)
    return [t[:DEMO_TEXT_BYTES] for t in calib], [t[:DEMO_TEXT_BYTES] for t in held]


def plan_figures(model, calib: RoutingProfile, heldout: list[str], chunk: int, target: str) -> dict:
    """Measured (not predicted) padding / drops / NPU share on held-out text, per planning method."""
    from npumoe.core.runtime.engine import Engine

    ids = [model.tokenizer.encode(t) for t in heldout]
    windows = [t[s:s + 4 * chunk] for t in ids for s in range(0, len(t) - chunk + 1, 4 * chunk)]
    out, experts = {}, model.spec.layers[model.spec.moe_layers[0]].ffn.num_experts
    settings = {  # name → plan() arguments
        "uniform+drop": dict(method="uniform", overflow="drop"),
        "paper+drop": dict(method="paper", overflow="drop"),
        "optimal+spill": dict(method="optimal", overflow="spill"),
        "optimal+spill, 20 % budget, per-expert tiers": dict(method="optimal", overflow="spill", max_overflow=0.2,
                                                              max_tiers=experts),
    }
    for name, kwargs in settings.items():
        p = plan(model, calib, target=target, residency="npu", **kwargs)
        eng = Engine(model, plan=p, max_context=4 * chunk)
        for w in windows:
            eng.forward(np.asarray(w[: len(w) // chunk * chunk]))
        m = eng.metrics
        npu_slots = m["routed"] - m["spilled"] - m["dropped"] + m["padded"]
        out[name] = {
            "padded_pct": 100 * m["padded"] / max(npu_slots, 1),
            "dropped_pct": 100 * m["dropped"] / m["routed"],
            "spilled_pct": 100 * m["spilled"] / m["routed"],
            "npu_share_pct": 100 * (m["routed"] - m["spilled"] - m["dropped"]) / m["routed"],
        }
    return out


@click.command("runtime")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1))
@click.option("--chunk", default=PHI["chunk"], show_default=True, type=click.IntRange(1))
@click.option("--small", is_flag=True, help="Quarter-size Phi shapes (for a quick look; not the reported figure).")
@click.option("--skip-demo", is_flag=True, help="Only the host-op breakdown.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_runtime_command(repeats, chunk, small, skip_demo, as_json):
    """Host-runtime cost at Phi-3.5-MoE shapes, and planner padding/drop figures on the demo model."""
    shapes = {k: v for k, v in PHI.items() if k != "chunk"}
    if small:
        shapes.update(hidden=1024, intermediate=1600)
    torch.set_num_threads(torch.get_num_threads())
    start = time.perf_counter()
    breakdown = host_breakdown(chunk, repeats, **shapes)
    result = {"shapes": {**shapes, "chunk": chunk}, **breakdown}
    if not skip_demo:
        from npumoe.models.loader import load

        model = load()
        calib_texts, heldout = demo_texts()
        calib = calibrate(model, calib_texts, chunk=chunk)
        result["demo"] = {t: plan_figures(model, calib, heldout, chunk, t) for t in ("htp", "ane")}
        ours = result["demo"]["htp"]["optimal+spill"]
        result.update(dropped_pct=ours["dropped_pct"], padded_pct=ours["padded_pct"],
                      npu_share_pct=ours["npu_share_pct"])
    result["bench_seconds"] = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    console = Console()
    table = Table("op", "ms per chunk", title=f"one MoE layer, H={shapes['hidden']} I={shapes['intermediate']} "
                  f"E={shapes['experts']} top-{shapes['top_k']}, chunk {chunk}, fp32 CPU experts")
    for op in (*HOST_OPS[:3], "expert_ffn", *HOST_OPS[3:]):
        table.add_row(op, f"{breakdown['seconds'].get(op, 0.0) * 1e3:.2f}")
    console.print(table)
    console.print(f"host ops / expert FFN = [bold]{breakdown['host_over_ffn']:.4f}[/bold] (NPUMoE Table 4: 2.2; goal ≤ 0.05)")
    for target, figures in result.get("demo", {}).items():
        t = Table("plan", "padded % of NPU slots", "dropped %", "spilled %", "NPU share %",
                  title=f"demo model, held-out text, chunk {chunk}, target {target}, every group on the NPU")
        for name, f in figures.items():
            t.add_row(name, *(f"{f[k]:.1f}" for k in ("padded_pct", "dropped_pct", "spilled_pct", "npu_share_pct")))
        console.print(t)
