"""`npumoe compare`: every target of a multi-target build side by side."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table


@click.command("compare")
@click.argument("out", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (targets → metrics) instead of tables.")
@click.option("--html", "html_path", default=None, type=click.Path(),
              help="Also write a self-contained HTML report (tables and figures inlined) here.")
def compare_command(out, as_json, html_path):
    """Accuracy, static-shape costs, artifact sizes and estimated tokens/s per device, per target.

    \b
    Example:
      npumoe build --targets htp,ane --out build && npumoe compare build --html report.html
    """
    if html_path:
        from npumoe.core.base.outputs import claim
        from npumoe.core.tools.report import REPORT

        claim(html_path, REPORT, "--html")  # before reading anything: an unwritable path fails first
    from npumoe.core.tools.compare import compare

    result = compare(out)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        render(result, Console())
    if html_path:
        from npumoe.core.tools.report import write_html

        click.echo(f"wrote {write_html(result, out, html_path)}", err=as_json)


def render(result: dict, console: Console) -> None:
    from npumoe.core.tools.report import ACCURACY_COLUMNS, COLUMNS, cell

    rows = result["targets"]
    accuracy, costs = COLUMNS[:ACCURACY_COLUMNS], COLUMNS[ACCURACY_COLUMNS:]  # two tables fit 80 columns
    for columns, title in ((accuracy, f"{result['model']}: every target against the fp32 reference "
                                      f"({result['heldout_tokens']} held-out tokens)"),
                           (costs, "what the static shapes cost on that text, and what was built")):
        table = Table("target", *(h for _, h, _, _ in columns), title=title)
        for target, row in rows.items():
            table.add_row(target, *(cell(row, key, fmt) for key, _, fmt, _ in columns))
        console.print(table)
        for _, header, _, meaning in columns:
            console.print(f"[dim]{header}: {meaning}[/dim]")
    estimates = Table("target", "device", "decode tok/s", "prefill tok/s",
                      title="ESTIMATED per device (npumoe's cost model, core/planning/costmodel.py; not measured)")
    for target, row in rows.items():
        for device, e in row["estimated"].items():
            estimates.add_row(target, device, f"{e['decode_tok_s']:.1f}", f"{e['prefill_tok_s']:.0f}")
    console.print(estimates)
    render_split(result.get("disaggregated", []), console)
    for target, row in rows.items():
        if row.get("budget_lines"):
            need = row["footprint"]
            console.print(f"what each {target} device can hold of this build at {need['precision']}, context "
                          f"{need['max_context']} (npumoe's estimate; each figure's source: --json, devices):")
            for line in row["budget_lines"]:
                click.echo(f"  {line}")  # whole, however narrow the terminal
    check = Table("device", "published figure", "published tok/s", "estimate", "estimate / published",
                  title="the cost model against published figures it was not fitted to")
    for c in result["cost_model_check"]:
        check.add_row(c["device"], c["label"], f"{c['published_tok_s']:.1f}", f"{c['estimate_tok_s']:.1f}",
                      f"{c['ratio']:.2f}")
    console.print(check)
    console.print("[dim]each figure's workload assumptions and source: npumoe compare --json (cost_model_check)[/dim]")


def render_split(rows: list[dict], console: Console) -> None:
    """Per chip two built targets share: prefill on one, the KV cache handed over, decode on the other."""
    if not rows:
        return
    from npumoe.core.tools.compare import SPLIT_HEADERS, SPLIT_TITLE, split_cells

    table = Table(*SPLIT_HEADERS, title=SPLIT_TITLE)
    for cells in split_cells(rows):
        table.add_row(*cells)
    console.print(table)
    for line in rows[0]["assumptions"]:
        click.echo(f"  assumed: {line}")
