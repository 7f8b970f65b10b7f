"""`npumoe bench runtime`: what the shared host runtime costs, and what the planner buys.

Part 1 reproduces NPUMoE's Table 4 breakdown (router, gather, pad, expert FFN, scatter,
residual) for one MoE layer at Phi-3.5-MoE shapes, with the experts on the CPU, and
reports host-op time over expert-FFN time (the paper measured 2.2).

Part 2 runs the demo model over held-out text under four plans — NPUMoE's single
capacity and its tiers (both dropping overflow, as the paper does), and our optimiser
(spilling) with one compiled shape per expert group and with its default several —
and reports measured padding, drops, the NPU's share of routed slots and NPU graphs per layer.
(The measurements are :mod:`npumoe.bench.runtime_measure`, imported when the command runs.)
"""

from __future__ import annotations

import json
import time

import click
from rich.console import Console
from rich.table import Table

PHI = dict(hidden=4096, intermediate=6400, experts=16, top_k=2, chunk=256)


@click.command("runtime")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1))
@click.option("--chunk", default=PHI["chunk"], show_default=True, type=click.IntRange(1))
@click.option("--small", is_flag=True, help="Quarter-size Phi shapes (for a quick look; not the reported figure).")
@click.option("--skip-demo", is_flag=True, help="Only the host-op breakdown.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_runtime_command(repeats, chunk, small, skip_demo, as_json):
    """Host-runtime cost at Phi-3.5-MoE shapes, and planner padding/drop figures on the demo model."""
    from npumoe.bench.runtime_measure import demo_texts, host_breakdown, overlap_figures, plan_figures
    from npumoe.core.runtime.calibrate import calibrate

    shapes = {k: v for k, v in PHI.items() if k != "chunk"}
    if small:
        shapes.update(hidden=1024, intermediate=1600)
    start = time.perf_counter()
    breakdown = host_breakdown(chunk, repeats, **shapes)
    result = {"shapes": {**shapes, "chunk": chunk}, **breakdown}
    if not skip_demo:
        from npumoe.models.loader import load

        model = load()
        calib_texts, heldout = demo_texts()
        calib = calibrate(model, calib_texts, chunk=chunk)
        result["demo"] = {t: plan_figures(model, calib, heldout, chunk, t) for t in ("htp", "ane")}
        result["overlap"] = overlap_figures(model, calib, heldout, chunk)
        ours = result["demo"]["htp"]["optimal+spill, buffered"]
        result.update(dropped_pct=ours["dropped_pct"], padded_pct=ours["padded_pct"],
                      npu_share_pct=ours["npu_share_pct"])
    result["bench_seconds"] = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    from npumoe.bench.runtime_measure import HOST_OPS

    console = Console()
    table = Table("op", "ms per chunk", title=f"one MoE layer, H={shapes['hidden']} I={shapes['intermediate']} "
                  f"E={shapes['experts']} top-{shapes['top_k']}, chunk {chunk}, fp32 CPU experts")
    for op in (*HOST_OPS[:3], "expert_ffn", *HOST_OPS[3:]):
        table.add_row(op, f"{breakdown['seconds'].get(op, 0.0) * 1e3:.2f}")
    console.print(table)
    console.print(f"host ops / expert FFN = [bold]{breakdown['host_over_ffn']:.4f}[/bold] "
                  "(NPUMoE Table 4: 2.2; goal ≤ 0.05)")
    for target, figures in result.get("demo", {}).items():
        t = Table("plan", "graphs", "padded %", "dropped %", "spilled %", "NPU share %", "launches",
                  title=f"demo model, held-out text, chunk {chunk}, target {target}, every group on the NPU",
                  caption="graphs: NPU expert graphs per layer and sequence length; padded: % of NPU slots; "
                          "dropped, spilled, NPU share: % of routed token-slots; launches: expert-group launches "
                          "per 1,000 tokens (all layers); buffered: a prompt's tokens wait per expert for full "
                          "launches across its chunks", caption_justify="left")
        t.columns[0].no_wrap = True
        for name, f in figures.items():
            t.add_row(name, str(f["npu_graphs_per_layer"]),
                      *(f"{f[k]:.1f}" for k in ("padded_pct", "dropped_pct", "spilled_pct", "npu_share_pct")),
                      f"{f['launches_per_1k']:.0f}")
        console.print(t)
    if "overlap" in result:
        render_overlap(result["overlap"], console)


def render_overlap(figures: dict, console: Console) -> None:
    t = Table("run", "wall s", "CPU experts s", "NPU groups s", "CPU time hidden %",
              title="spilled tokens' CPU experts beside the NPU launches (demo, held-out text, optimal+spill)",
              caption="The NPU groups run on a CPU worker thread (no NPU here), torch on one thread in each: the "
                      "stand-in NPU competes with the CPU experts for the GIL and memory, so wall time does not fall "
                      f"here as it would beside a device. 'modelled NPU': each NPU expert graph takes "
                      f"{figures['device']}'s modelled time (cost model), never less than this CPU needs to compute "
                      "it.", caption_justify="left")
    for name, f in figures.items():
        if name != "device":
            t.add_row(name, f"{f['seconds']:.2f}", f"{f['cpu_expert_s']:.2f}", f"{f['npu_expert_s']:.2f}",
                      f"{f['hidden_pct']:.0f}")
    console.print(t)
