"""The cross-vendor comparison of a multi-target build (``npumoe build --targets``), as one record.

Everything is read from the build directory, so a comparison needs neither the model nor a toolchain:
the top-level manifest holds each target's validation and workload, each target's own manifest its
graphs and their sizes, and :mod:`npumoe.core.planning.costmodel` turns workloads into per-device estimates.
"""

from __future__ import annotations

from pathlib import Path

from npumoe.core.base.errors import ArtifactError, InputError
from npumoe.core.compiler.artifacts import MANIFEST, read_manifest, read_targets, target_directory
from npumoe.core.planning.costmodel import (
    Footprint,
    Workload,
    budget_lines,
    check_published,
    devices,
    disaggregated,
    estimate,
    verdicts,
)
from npumoe.core.planning.plan import Plan

SPLIT_TITLE = "ESTIMATED disaggregated generation per chip (cost model; not measured)"
SPLIT_HEADERS = ("chip", "prefill → decode", "prompt + new", "seconds", "hand-off ms", "speed-up vs alone")


def split_cells(rows: list[dict]) -> list[tuple[str, ...]]:
    """:data:`SPLIT_HEADERS`' cells for each request of each chip in ``compare``'s ``disaggregated`` rows: what the
    text table and the HTML report show alike."""
    return [(row["chip"], f"{row['prefill']['target']} → {row['decode']['target']}", f"{r['prompt']} + {r['new']}",
             f"{r['seconds']:.3g}", f"{1e3 * r['handoff_seconds']:.3g}",
             ", ".join(f"{t} {x:.2f}x" for t, x in r["speedup"].items())) for row in rows for r in row["requests"]]


def compare(out_dir) -> dict:
    """``{"model", "targets": {target: row}, "disaggregated", "devices", "cost_model_check"}``; each row holds at
    least cosine, top1_agreement, greedy_match, padded_pct, spilled_pct, dropped_pct, npu_launches_per_chunk,
    artifact_bytes and ``estimated`` (device → prefill_tok_s, decode_tok_s); ``disaggregated``: per chip two built
    targets share, prefill on one and decode on the other, estimated (:func:`~npumoe.core.planning.costmodel.
    disaggregated`)."""
    out_dir = Path(out_dir)
    if not (out_dir / MANIFEST).is_file():
        raise InputError(f"{out_dir} holds no manifest.json; compare takes the --out of npumoe build --targets.")
    manifest = read_targets(out_dir)
    if manifest is None:
        raise InputError(f"{out_dir} is a single target's build; compare takes the --out of npumoe build --targets "
                         "htp,ane (several targets from one model).")
    rows = {}
    for target, entry in manifest["targets"].items():
        rows[target] = _row(out_dir, manifest, target, entry)
    cached = [r["footprint"]["kv_bytes"] / r["footprint"]["max_context"] for r in rows.values() if "footprint" in r]
    split = disaggregated({t: r["estimated"] for t, r in rows.items()}, cached[0]) if cached else []
    return {"model": manifest["model_name"], "heldout_tokens": manifest["heldout_tokens"], "targets": rows,
            "disaggregated": split,
            "devices": [{"name": d.name, "npu": target, "npu_tops": d.npu_tops, "dram_gb_s": d.dram_gb_s,
                         "launch_us": d.launch_us, "ram_gb": d.ram_gb, "app_share": d.app_share,
                         "max_package_gb": d.max_package_gb, "graph_overhead_mb": d.graph_overhead_mb, "chip": d.chip,
                         "sources": dict(d.sources)} for target, d in devices()],
            "cost_model_check": check_published()}


def _row(out_dir: Path, manifest: dict, target: str, entry: dict) -> dict:
    directory = target_directory(out_dir, target)
    if not (directory / MANIFEST).is_file():
        raise InputError(f"{directory} has no manifest.json, so {target} cannot be compared; rebuild with npumoe "
                         "build --targets.")
    built = read_manifest(directory, verify=False)
    if (built["model"], built.get("weights")) != (manifest["model"], manifest.get("weights")):
        raise InputError(f"{directory} holds artifacts of {built.get('model_name')}, not of {manifest['model_name']} "
                         "like the rest of this build: a comparison needs one model; rebuild with npumoe build "
                         "--targets.")
    try:
        work = Workload(**entry["workload"])
        validation = dict(entry["validation"])
    except (KeyError, TypeError) as err:
        raise ArtifactError(f"{out_dir / MANIFEST} lacks {target}'s validation or workload ({err}); the manifest "
                            "was altered, rebuild with npumoe build --targets.") from None
    graphs = built["graphs"]
    layers = Plan.from_json(built["plan"], f"{directory / MANIFEST}'s plan").layers
    return {
        **validation,
        "graphs": len(graphs),
        "graph_bytes": {name: g["bytes"] for name, g in graphs.items()},
        "artifact_bytes": sum(g["bytes"] for g in graphs.values()),
        "npu_launches_per_decode": work.decode_launches,
        "decode_weight_bytes": work.decode_weight_bytes,
        "groups": {str(layer): [{"experts": len(g.experts), "rows": [sum(s) for s in g.shapes],
                                 "residency": g.residency} for g in lp.groups] for layer, lp in layers.items()},
        "cpu_graphs": entry.get("cpu_graphs", {}),
        "estimated": {d.name: {"decode_tok_s": e.decode_tok_s, "prefill_tok_s": e.prefill_tok_s}
                      for _, d in devices(target) for e in [estimate(d, work)]},
        **_budget(out_dir, target, entry.get("footprint")),
    }


def _budget(out_dir: Path, target: str, recorded: dict | None) -> dict:
    """What each device can hold of the build (builds from before footprints were recorded: nothing)."""
    if recorded is None:
        return {}
    try:
        need = Footprint(**recorded)
    except TypeError as err:
        raise ArtifactError(f"{out_dir / MANIFEST} holds a damaged footprint for {target} ({err}); the manifest was "
                            "altered, rebuild with npumoe build --targets.") from None
    return {"footprint": recorded, "fits": [v.to_json() for v in verdicts(target, need)],
            "budget_lines": budget_lines(target, need)}
