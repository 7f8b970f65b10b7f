"""`npumoe bench hvx`: the HVX kernel's instruction counts and modelled cost
(measured by :mod:`npumoe.bench.hvx_measure`)."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from npumoe.core.base.progress import task


def render(result: dict, console: Console) -> None:
    from npumoe.bench.hvx_measure import COUNTED, FORMATS
    from npumoe.luts.hvx import cost

    n, k = result["shape"]
    counts = Table(title=f"HVX instructions per {n}×{k} GEMV, group {result['group']} (compiled kernel)")
    counts.add_column("instruction")
    for name in FORMATS:
        counts.add_column(name, justify="right")
    for c in COUNTED:
        counts.add_row(c.replace("_", " "), *(f"{result[name]['counts'][c]:,}" for name in FORMATS))
    counts.add_row("bit-exact (qemu)", *("yes" if result[name]["bit_exact"] else "NO" for name in FORMATS))
    model = Table(title="Estimate from a cost model (T-MAN Tables 1–2; clocks, thread counts assumed)")
    for col in ("format", "device", "lookup cyc", "sched cyc", "HVX µs", "DMA µs", "bound",
                *(f"{m.split('-')[0]} tok/s ≤" for m in cost.MODEL_WEIGHTS)):
        model.add_column(col, justify="right")
    for name in FORMATS:
        for e in result[name]["estimate"]:
            model.add_row(name, e["device"].removeprefix("Snapdragon "), f"{e['lookup_floor_cycles']:,.0f}",
                          f"{e['schedule_cycles']:,}", f"{e['compute_us']:.1f}", f"{e['memory_us']:.1f}", e["bound"],
                          *(f"{t:.1f}" for t in e["tokens_per_s_upper_bound"].values()))
    console.print(counts)
    console.print(model)
    reported = result["tman_reported"]
    console.print("T-MAN reports: " + "; ".join(f"{what} {value} tok/s" for what, value in
                                                reported["decode_tokens_per_s"].items())
                  + f"; {reported['decode_vs_qnn']}; {reported['gemv_kernels_vs_qnn']}.")
    console.print("tok/s here are upper bounds from the linear layers' weight traffic alone (no attention, no "
                  "lm_head, no overhead), computed for every format; T-MAN runs BitNet with 2-bit weights.")


@click.command("hvx")
@click.option("--n", "n", default=4096, show_default=True, help="Output rows (a multiple of 128).")
@click.option("--k", "k", default=4096, show_default=True, help="Inputs (a multiple of the group).")
@click.option("--group", default=64, show_default=True, type=click.Choice(["32", "64", "128"]), help="Group size.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_hvx_command(n: int, k: int, group: str, as_json: bool) -> None:
    """Instruction counts and a modelled cost of the HVX LUT-GEMV, checked bit-exact under qemu-hexagon."""
    from npumoe.bench.hvx_measure import run
    from npumoe.luts import spec

    spec.check_group(int(group), k)
    with task("counting the HVX kernel's instructions under qemu-hexagon"):
        result = run(n, k, int(group))
    if as_json:
        click.echo(json.dumps(result))
    else:
        render(result, Console())
