"""`npumoe quantize`: every linear but the routers (or only the routed experts) in the LUT kernels' low-bit format."""

from __future__ import annotations

import click

from npumoe.commands.options import model_option
from npumoe.core.base.errors import InputError
from npumoe.core.base.io import existing_file
from npumoe.luts import BITS
from npumoe.models.checkpoints import HEAD_BITS, LINEARS

HELDOUT_TOKENS = 2048  # enough for a perplexity that moves with the format, short enough for a 30 B model on a CPU
HELDOUT_WINDOW = 256  # inside every model's trained context (the demo's is 256), as llama.cpp's perplexity windows


@click.command("quantize")
@model_option
@click.option("--bits", default=4, show_default=True, type=int, help="Bits per weight: 1, 2, 3, 4, 5, 6 or 8.")
@click.option("--group", default=64, show_default=True, type=int,
              help="Weights per scale and zero point along K: 32, 64 or 128.")
@click.option("--symmetric", is_flag=True, help="Zero point fixed at 2^(bits−1) (signed int4 for QNN's HTP).")
@click.option("--linears", type=click.Choice(list(LINEARS)), default="all", show_default=True,
              help="all: the routed experts, attention, dense and shared FFNs and the LM head (routers and the "
                   "embedding stay as stored), what the CPU decodes fastest; experts: the routed experts only (for "
                   "NPU builds that take only those).")
@click.option("--head-bits", type=click.Choice([str(b) for b in BITS]), default=None,
              callback=lambda c, p, v: None if v is None else int(v),
              help=f"Bits of the LM head with --linears all (default: {HEAD_BITS}, or --bits if more; it is the most "
                   "sensitive matrix).")
@click.option("--heldout", "heldout_file", type=click.Path(), default=None,
              help=f"Text to measure what the format costs: the held-out perplexity of the source and of the result "
                   f"on its first {HELDOUT_TOKENS} tokens, in windows of {HELDOUT_WINDOW} (both run on the CPU "
                   "afterwards).")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Directory for the quantised checkpoint.")
def quantize_command(model_dir, bits, group, symmetric, linears, head_bits, heldout_file, out_dir):
    """Quantise weights to the npumoe LUT format (npumoe.load reads the result): every linear but the routers
    (the LM head at 6 bits), or with --linears experts only the routed experts, each run by the LUT kernels on
    the CPU.

    \b
    Examples:
      npumoe quantize --model DIR --bits 4 --group 64 --out DIR2
      npumoe quantize --model DIR --bits 4 --linears experts --out DIR3   # the routed experts only
      npumoe quantize --model DIR --bits 2 --heldout text.txt --out DIR4   # and what 2 bits cost
      npumoe generate --model DIR2
    """
    from npumoe.models.checkpoints.quantize import quantize_checkpoint

    if head_bits is not None and linears != "all":
        raise InputError("--head-bits applies with --linears all (the LM head is packed only then); add --linears all.")
    source, heldout = heldout_tokens(model_dir, heldout_file) if heldout_file else (None, None)  # named before work
    info = quantize_checkpoint(model_dir, out_dir, bits, group, symmetric, linears=linears,
                               head_bits=head_bits)
    kind = "symmetric" if info["symmetric"] else "asymmetric"
    click.echo(f"wrote {out_dir}: {info['weights']} at {bits} bits, group {group}, {kind}")
    if heldout is not None:
        from npumoe.core.tools.validate import perplexity
        from npumoe.models.loader import load

        before, after = (perplexity(m, heldout, HELDOUT_WINDOW) for m in (source, load(out_dir)))
        click.echo(f"held-out perplexity on {len(heldout)} tokens ({HELDOUT_WINDOW}-token windows): "
                   f"{before:.3f} → {after:.3f} ({100 * (after / before - 1):+.2f} %)")


def heldout_tokens(model_dir, heldout_file):
    """(the source model, the first tokens of the held-out text by its tokenizer)."""
    from npumoe.core.tools.validate import MIN_TOKENS
    from npumoe.models.loader import load

    text = existing_file(heldout_file, "held-out text (--heldout FILE)").read_text(encoding="utf-8", errors="replace")
    source = load(model_dir)
    if source.tokenizer is None:
        raise InputError(f"{model_dir} has no tokenizer npumoe reads, so --heldout cannot turn text into tokens; "
                         "leave --heldout out.")
    ids = list(source.tokenizer.encode(text))[:HELDOUT_TOKENS]
    if len(ids) < MIN_TOKENS:
        raise InputError(f"--heldout {heldout_file} gives {len(ids)} tokens; a perplexity needs at least {MIN_TOKENS}.")
    return source, ids
