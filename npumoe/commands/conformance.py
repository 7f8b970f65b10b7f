"""`npumoe conformance`: the checks every backend passes, as a table (or JSON), exit 1 on any failure."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

from npumoe.commands.options import target_option


@click.command("conformance")
@target_option(None, "The backend to check.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"target", "passed", "failed", "skipped"} (lists of check ids) instead of a table.')
def conformance_command(target, as_json):
    """Check a backend against the reference interpreter at its declared tolerance: every graph kind, the
    engine's prefill and decode, artifacts run in a fresh process, a rebuild. Exits 1 if any check fails.

    \b
    Example:
      npumoe conformance --target htp
    """
    from npumoe.core.tools.conformance import run_conformance

    console = Console(stderr=as_json)
    outcomes = run_conformance(target)
    by_status = {s: [o.check for o in outcomes if o.status == s] for s in ("passed", "failed", "skipped")}
    if as_json:
        click.echo(json.dumps({"target": target, **by_status,
                               "details": {o.check: o.detail for o in outcomes}}, indent=1))
    else:
        table = Table("check", "result", "measured / reason", title=f"npumoe conformance --target {target}")
        colour = {"passed": "green", "failed": "red", "skipped": "yellow"}
        for o in outcomes:
            table.add_row(o.check, f"[{colour[o.status]}]{o.status}[/]", o.detail)
        console.print(table)
        console.print(f"{len(by_status['passed'])} passed, {len(by_status['failed'])} failed, "
                      f"{len(by_status['skipped'])} skipped")
    if by_status["failed"]:
        sys.exit(1)
