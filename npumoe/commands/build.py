"""`npumoe build`: lower a planned program's NPU graphs to a target's artifacts."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from npumoe.commands.options import build_options, chosen_build_options, dtype_option, model_option, target_option
from npumoe.core.artifacts import build
from npumoe.core.plan import Plan
from npumoe.errors import InputError
from npumoe.models.loader import load


@click.command("build")
@model_option
@dtype_option
@click.option("--plan", "plan_path", required=True, type=click.Path(), help="Plan from npumoe plan.")
@target_option(None, "Where the artifacts will run.", npu_only=True)
@click.option("--out", required=True, type=click.Path(), help="Artifact directory (replaced only when complete).")
@click.option("--max-context", default=512, show_default=True, type=click.IntRange(1),
              help="KV cache length compiled into the attention graphs.")
@click.option("--layers", default=None, help="Build only these layers' graphs, e.g. 0 or 0-3,7: a quick look at a "
                                             "large model (the result does not run).")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(1),
              help="Compile this many units (graphs; ANE: packages) at once, each in its own process: faster on a "
                   "machine with cores and memory to spare (each holds one unit's weights while it compiles).")
@build_options
def build_command(model_dir, dtype, plan_path, target, out, max_context, layers, jobs, **options):
    """Compile every NPU-placed graph of the plan, write the artifacts and manifest.json.

    Example: npumoe build --plan plan.json --target htp --precision w8a16 --out build/htp
    """
    model = load(model_dir, dtype=dtype)
    options = chosen_build_options(target, options)
    manifest = build(model, Plan.load(plan_path), target, out, max_context=max_context,
                     layers=parse_layers(layers) if layers else None, jobs=jobs, **options)
    table = Table("graph", "kind", "inputs", "MB", "compile s", "files")
    for name, g in manifest["graphs"].items():
        table.add_row(name, g["kind"], " ".join(f"{k}{v}" for k, v in g["inputs"].items()), f"{g['bytes'] / 1e6:.1f}",
                      "cached" if g["cached"] else f"{g['seconds']:.1f}", ", ".join(g.get("files", [])))
    Console().print(table)
    cached = sum(g["cached"] for g in manifest["graphs"].values())
    total = sum((Path(out) / rel).stat().st_size for rel in manifest["files"])  # graphs may share a package
    click.echo(f"wrote {out}: {len(manifest['graphs'])} graphs ({cached} from the build cache), "
               f"{len(manifest['files'])} files, {total / 1e6:.1f} MB, manifest.json")


def parse_layers(text: str) -> set[int]:
    """"0-3,7" → {0, 1, 2, 3, 7}."""
    layers: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            layers.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise InputError(f"--layers takes layer numbers and ranges like 0-3,7, not {text!r}.") from None
    return layers
