"""Figures people would rather look at than read: expert load, and what a plan decided."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.base.io import write_output
from npumoe.core.base.outputs import OutputKind

MARKER = {"Software": "npumoe"}  # a PNG text chunk: how a later --plot knows the file is ours to replace


def _is_our_png(path: Path) -> bool:
    """Whether ``path`` is a PNG npumoe drew (its Software text chunk comes before the image data)."""
    try:
        with open(path, "rb") as f:
            return b"tEXtSoftware\0npumoe" in f.read(4096)
    except OSError:
        return False


FIGURE = OutputKind("an npumoe figure (PNG)", directory=False, recognise=_is_our_png)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise BackendUnavailableError("plots need matplotlib: pip install 'npumoe[plot]'.") from err
    return plt


def png(fig) -> bytes:
    """The figure as PNG bytes (closed afterwards): for files and for reports that inline their images."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight", metadata=MARKER)
    _pyplot().close(fig)
    return buf.getvalue()


def _save(fig, path) -> Path:
    return write_output(path, FIGURE, png(fig), "--plot")


def profile_heatmap(profile, path) -> Path:
    return _save(profile_heatmap_figure(profile), path)


def profile_heatmap_figure(profile):
    """Mean tokens per expert per chunk, one row per MoE layer, experts in index order."""
    plt = _pyplot()
    layers = profile.layers
    mean = np.stack([profile.loads[i].mean(axis=0) for i in layers])
    fig, ax = plt.subplots(figsize=(max(6, mean.shape[1] * 0.35), max(2.5, len(layers) * 0.45)))
    im = ax.imshow(mean, aspect="auto", cmap="magma")
    ax.set_yticks(range(len(layers)), [f"L{i} r={profile.imbalance(i):.2f}" for i in layers])
    ax.set_xlabel("expert")
    ax.set_title(f"{profile.model_name}: mean tokens per expert per chunk of {profile.chunk}")
    fig.colorbar(im, ax=ax, label="tokens")
    return fig


def plan_figure(plan, path) -> Path:
    """Each expert as a cell: colour = its largest capacity over its group's shapes, hatched = CPU-resident."""
    plt = _pyplot()
    layers = sorted(plan.layers)
    experts = sum(len(g.experts) for g in plan.layers[layers[0]].groups)
    cap = np.zeros((len(layers), experts))
    cpu = np.zeros_like(cap, dtype=bool)
    group_id = np.zeros_like(cap, dtype=int)
    for r, i in enumerate(layers):
        for j, g in enumerate(plan.layers[i].groups):
            for k, e in enumerate(g.experts):
                cap[r, e] = max((shape[k] for shape in g.shapes), default=0)
                cpu[r, e] = g.residency == "cpu"
                group_id[r, e] = j
    fig, ax = plt.subplots(figsize=(max(6, experts * 0.35), max(2.5, len(layers) * 0.45)))
    im = ax.imshow(cap, aspect="auto", cmap="viridis")
    for r, c in zip(*np.nonzero(cpu)):
        ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="///", edgecolor="white"))
    for r in range(len(layers)):
        for c in range(experts):
            ax.text(c, r, str(group_id[r, c]), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(layers)), [f"L{i}" for i in layers])
    ax.set_xlabel("expert (number = group; hatched = CPU-resident)")
    ax.set_title(f"plan for {plan.target}: largest capacity per expert, {plan.overflow} overflow, chunk {plan.chunk}")
    fig.colorbar(im, ax=ax, label="capacity")
    return _save(fig, path)


def target_costs_figure(rows: dict[str, dict]):
    """Per target: what its static shapes cost on held-out text (padding, spill, drops, %)."""
    plt = _pyplot()
    names, kinds = list(rows), ("padded_pct", "spilled_pct", "dropped_pct")
    fig, ax = plt.subplots(figsize=(6, 3))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        ax.bar(np.arange(len(names)) + k * width, [rows[n][kind] for n in names], width,
               label=kind.removesuffix("_pct"))
    ax.set_xticks(np.arange(len(names)) + width, names)
    ax.set_ylabel("%")
    ax.set_title("static shapes on held-out text: padded (of NPU slots), spilled and dropped (of routed)")
    ax.legend()
    return fig


def estimates_figure(rows: dict[str, dict]):
    """Estimated decode and prefill tokens/s per device (a cost model, labelled so)."""
    plt = _pyplot()
    bars = [(f"{target} on {device}", e) for target, row in rows.items() for device, e in row["estimated"].items()]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.4 * len(bars) + 1.5), sharey=True)
    for ax, key in zip(axes, ("decode_tok_s", "prefill_tok_s")):
        ax.barh([b[0] for b in bars], [b[1][key] for b in bars], color="tab:gray")
        ax.set_xlabel(f"{key.removesuffix('_tok_s')} tokens/s (ESTIMATE)")
    fig.suptitle("estimated from npumoe's cost model (core/planning/costmodel.py), not measured on the devices")
    return fig
