"""`npumoe calibrate` and `npumoe plan`."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from npumoe.commands.options import dtype_option, model_option, target_option
from npumoe.core.base.errors import InputError
from npumoe.core.base.io import existing_file
from npumoe.core.base.outputs import claim
from npumoe.core.ir.backend import capabilities
from npumoe.core.planning import (
    DECODE_GRAPHS_PER_LAYER,
    GRAPH_OVERHEAD_SHARE,
    GRAPHS_PER_LAYER,
    METHODS,
    OVERFLOW_POLICIES,
    RESIDENCY,
)


def read_texts(paths: tuple[str, ...]) -> dict[str, str]:
    texts = {}
    for p in paths:
        path = existing_file(p, "calibration text (--text FILE)")
        texts[str(path)] = path.read_text(encoding="utf-8", errors="replace")
    if not any(t.strip() for t in texts.values()):
        raise InputError("the calibration text is empty; give files with text in them.")
    return texts


@click.command("calibrate")
@model_option
@dtype_option
@click.option("--text", "text_files", multiple=True, type=click.Path(),
              help="Calibration text file (repeatable) [default: Python's pydoc topics, always on disk].")
@click.option("--chunk", default=256, show_default=True, type=click.IntRange(1), help="Prefill chunk size B.")
@click.option("--out", default="profile.json", show_default=True, type=click.Path(), help="Profile JSON to write.")
@click.option("--plot", type=click.Path(), default=None, help="Also write a heatmap PNG of expert load per layer.")
@click.option("--compare", nargs=2, type=click.Path(), default=None,
              help="Instead of calibrating: print per-layer Overlap@K of two saved profiles.")
def calibrate_command(model_dir, dtype, text_files, chunk, out, plot, compare):
    """Measure how the experts are really used: per-chunk loads, imbalance r_l, popularity.

    \b
    Examples:
      npumoe calibrate --text my_prompts.txt --chunk 256 --out profile.json --plot load.png
      npumoe calibrate --compare code.json prose.json
    """
    from npumoe.core.planning.profile import PROFILE, RoutingProfile
    from npumoe.core.runtime.calibrate import calibrate, default_calibration_texts
    from npumoe.models.loader import load

    console = Console()
    if compare:
        return print_overlap(console, RoutingProfile.load(compare[0]), RoutingProfile.load(compare[1]))
    claim_outputs(out, PROFILE, plot)
    model = load(model_dir, dtype=dtype)
    texts = read_texts(text_files) if text_files else default_calibration_texts()
    profile = calibrate(model, list(texts.values()), chunk=chunk, sources=list(texts)[:50])
    profile.save(out)
    table = Table("layer", "chunks", "r = max/mean", "hottest experts", "p50 / p99 / max load")
    for i in profile.layers:
        q = profile.quantiles(i)
        table.add_row(str(i), str(profile.loads[i].shape[0]), f"{profile.imbalance(i):.2f}",
                      " ".join(map(str, profile.popularity(i)[:4])),
                      f"{q[0.5].mean():.0f} / {q[0.99].mean():.0f} / {q[1.0].max():.0f}")
    console.print(table)
    console.print(f"wrote {out}")
    if plot:
        from npumoe.core.tools.plots import profile_heatmap

        console.print(f"wrote {profile_heatmap(profile, plot)}")


def claim_outputs(out: str, kind, plot: str | None) -> None:
    """Refuse an --out or --plot path that may not be written before the minutes of work that fill it."""
    from npumoe.core.tools.plots import FIGURE

    claim(out, kind)
    if plot:
        claim(plot, FIGURE, "--plot")


def print_overlap(console: Console, a, b) -> None:
    """Per-layer Overlap@K of two :class:`~npumoe.core.planning.profile.RoutingProfile` s."""
    from npumoe.core.planning.profile import overlap_at_k

    if a.model != b.model:
        raise InputError(f"the two profiles come from different models ({a.model_name} and {b.model_name}).")
    experts = a.num_experts(a.layers[0])
    ks = sorted({1, a.top_k[a.layers[0]], experts // 2})
    overlaps = {k: overlap_at_k(a, b, k) for k in ks}
    table = Table("layer", *[f"Overlap@{k}" for k in ks])
    for i in a.layers:
        table.add_row(str(i), *[f"{overlaps[k][i]:.2f}" for k in ks])
    table.add_row("mean", *[f"{sum(overlaps[k].values()) / len(overlaps[k]):.2f}" for k in ks])
    console.print(table)


@click.command("plan")
@model_option
@click.option("--profile", "profile_path", required=True, type=click.Path(), help="Profile from npumoe calibrate.")
@target_option("htp", "The device whose Capabilities shape the plan.")
@click.option("--overflow", type=click.Choice(OVERFLOW_POLICIES), default="spill", show_default=True,
              help="Tokens past capacity: spill to CPU (lossless), drop (lowest saliency), reroute.")
@click.option("--residency", type=click.Choice(RESIDENCY), default="auto", show_default=True,
              help="auto: NPU only where a launch pays for itself; npu/cpu: force every group.")
@click.option("--method", type=click.Choice(METHODS), default="optimal", show_default=True,
              help="Capacities: optimal (ours: per-expert, several shapes fitted to routing patterns), paper "
                   "(NPUMoE's tiers), uniform (one capacity).")
@click.option("--max-overflow", default=0.10, show_default=True, type=click.FloatRange(0, 1),
              help="Budget of routed slots allowed past capacity (optimal method).")
@click.option("--graphs-per-layer", default=GRAPHS_PER_LAYER, show_default=True, type=click.IntRange(1),
              help="Compiled NPU expert graphs per layer (optimal method), shared by its groups: each group gets "
                   "several shapes when it can, and the runtime launches the one that fits a chunk's routing.")
@click.option("--decode-graphs-per-layer", default=None, type=click.IntRange(1),
              help="At most this many decode graphs per layer: the cost model cuts a group into graphs of fewer "
              "experts when a launch costs less than reading experts a token did not hit; the cap bounds the graphs "
              "a build compiles and a device loads. Default: what the target's device records allow, the MoE layers' "
              f"decode graphs at each one's per-graph overhead within {GRAPH_OVERHEAD_SHARE:.0%} of what an app may "
              f"hold on the tightest device ({DECODE_GRAPHS_PER_LAYER} where no device records an overhead); plan "
              "prints the figure and its sources.")
@click.option("--precision", default="fp16", show_default=True,
              help="Weights' precision the build will use (the target's --precision): what the device budget counts.")
@click.option("--max-context", default=512, show_default=True, type=click.IntRange(1),
              help="KV cache length the build will use (npumoe build --max-context): what the device budget counts.")
@click.option("--out", default="plan.json", show_default=True, type=click.Path())
@click.option("--plot", type=click.Path(), default=None, help="Also draw capacities, groups and residency to a PNG.")
def plan_command(model_dir, profile_path, target, overflow, residency, method, max_overflow, graphs_per_layer,
                 decode_graphs_per_layer, precision, max_context, out, plot):
    """Plan static shapes for a target: expert groups, their capacity shapes, residency, overflow.

    Example: npumoe plan --profile profile.json --target ane --residency npu --out plan.json
    """
    from npumoe.core.planning.costmodel import budget_lines, devices, footprint, weight_bits
    from npumoe.core.planning.plan import PLAN, DecodeCap, decode_graph_cap, plan
    from npumoe.core.planning.profile import RoutingProfile
    from npumoe.models.loader import load

    console = Console()
    claim_outputs(out, PLAN, plot)
    weight_bits(target, precision)  # an unknown precision fails before any work
    model = load(model_dir)
    cap = DecodeCap(decode_graphs_per_layer, "given by --decode-graphs-per-layer") if decode_graphs_per_layer \
        else decode_graph_cap(target, len(model.spec.moe_layers))
    p = plan(model, RoutingProfile.load(profile_path), target=target, overflow=overflow, residency=residency,
             method=method, max_overflow=max_overflow, graphs_per_layer=graphs_per_layer,
             decode_graphs_per_layer=cap.graphs)
    p.save(out)
    table = Table("layer", "groups", "padded %", "overflow %", "launches / chunk", "decode launches", "decode MB",
                  caption="groups: experts, rows per shape, residency[, experts per decode graph]")
    for i, lp in p.layers.items():
        groups = "; ".join(f"{len(g.experts)}, {'/'.join(str(sum(s)) for s in g.shapes) or '-'} {g.residency}"
                           + (f", {g.decode_experts}" if g.decode_experts else "") for g in lp.groups)
        pr = lp.predicted
        table.add_row(str(i), groups, f"{pr['padded_pct']:.1f}", f"{pr['overflow_pct']:.1f}",
                      f"{pr['npu_launches']:.1f}", f"{pr['decode_launches']:.1f}", f"{pr['decode_weight_mb']:.1f}")
    console.print(table)
    for name, reason in p.cpu_graphs.items():
        console.print(f"[yellow]{name}[/yellow] runs on the CPU: {reason}")
    for note in capabilities(target).notes:
        console.print(f"[dim]{target}: {note}[/dim]")
    t = p.predicted
    console.print(f"predicted: padded {t['padded_pct']:.1f}% of NPU slots, overflow {t['overflow_pct']:.1f}% "
                  f"of routed ({overflow}), NPU share {t['npu_share_pct']:.1f}% (per prefill chunk); a decode token "
                  f"launches {t['decode_launches']:.1f} expert graphs a layer, reading {t['decode_weight_mb']:.1f} MB "
                  f"of expert weights (fp16); wrote {out}")
    click.echo(f"decode graphs per layer at most {cap.graphs}: {cap.source}")  # whole, as the verdicts below
    if devices(target):
        console.print(f"what each {target} device can hold of this build at {precision}, context {max_context} "
                      "(npumoe's estimate; each figure's source: npumoe compare --json):")
        for line in budget_lines(target, footprint(model.spec, p, max_context, precision)):
            click.echo(f"  {line}")  # whole, however narrow the terminal
    if plot:
        from npumoe.core.tools.plots import plan_figure

        console.print(f"wrote {plan_figure(p, plot)}")
