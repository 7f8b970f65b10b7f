"""`npumoe quantize`: the routed experts in the LUT kernels' low-bit format."""

from __future__ import annotations

import click

from npumoe.commands.options import model_option
from npumoe.luts.quantize import quantize_checkpoint


@click.command("quantize")
@model_option
@click.option("--bits", default=4, show_default=True, type=int, help="Bits per weight: 1, 2, 3, 4, 5 or 8.")
@click.option("--group", default=64, show_default=True, type=int,
              help="Weights per scale and zero point along K: 32, 64 or 128.")
@click.option("--symmetric", is_flag=True, help="Zero point fixed at 2^(bits−1) (signed int4 for QNN's HTP).")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Directory for the quantised checkpoint.")
def quantize_command(model_dir, bits, group, symmetric, out_dir):
    """Quantise the routed experts' weights to the npumoe LUT format (npumoe.load reads the result).

    \b
    Example:
      npumoe quantize --model DIR --bits 4 --group 64 --out DIR2
      npumoe generate --model DIR2
    """
    info = quantize_checkpoint(model_dir, out_dir, bits, group, symmetric, progress=True)
    kind = "symmetric" if info["symmetric"] else "asymmetric"
    click.echo(f"wrote {out_dir}: routed experts at {bits} bits, group {group}, {kind}")
