"""Figures people would rather look at than read: expert load, and what a plan decided."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from npumoe.core.io import atomic_write_bytes
from npumoe.core.outputs import OutputKind, claim
from npumoe.errors import BackendUnavailableError

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


def _save(fig, path) -> Path:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight", metadata=MARKER)
    _pyplot().close(fig)
    return atomic_write_bytes(claim(path, FIGURE, "--plot"), buf.getvalue())


def profile_heatmap(profile, path) -> Path:
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
    return _save(fig, path)


def plan_figure(plan, path) -> Path:
    """Each expert as a cell: colour = its group's capacity, hatched = CPU-resident."""
    plt = _pyplot()
    layers = sorted(plan.layers)
    experts = len(plan.layers[layers[0]].expert_tier)
    cap = np.zeros((len(layers), experts))
    cpu = np.zeros_like(cap, dtype=bool)
    group_id = np.zeros_like(cap, dtype=int)
    for r, i in enumerate(layers):
        for j, g in enumerate(plan.layers[i].groups):
            for e in g.experts:
                cap[r, e] = g.capacity or plan.layers[i].tiers[plan.layers[i].expert_tier[e]]
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
    ax.set_title(f"plan for {plan.target}: capacity per expert, {plan.overflow} overflow, chunk {plan.chunk}")
    fig.colorbar(im, ax=ax, label="capacity")
    return _save(fig, path)
