"""`npumoe quantize`: a Hugging Face checkpoint → an npumoe-quantised one (:mod:`.checkpoint`).

Routed-expert matrices, most of an MoE's bytes and the ones cold experts stream from
memory, are quantised round-to-nearest per group; everything else is copied unchanged.
Each file is written under a temporary name and renamed, config.json last: an interrupted
run leaves no half-written file, and a fresh directory does not load until it is complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from safetensors.torch import save

from npumoe.core.cli import model_option
from npumoe.core.io import atomic_write_bytes, atomic_write_text
from npumoe.core.weights import Weights, expected_shapes
from npumoe.errors import InputError
from npumoe.luts import checkpoint, spec
from npumoe.models.loader import PICKLE_SUFFIXES, is_gptq, read_config, read_tensors, refuse_quantized
from npumoe.models.registry import adapter_for


def quantize_checkpoint(src: str | Path, out: str | Path, bits: int, group: int, symmetric: bool = False) -> dict:
    """Write the quantised checkpoint of ``src`` to ``out``; returns its config section."""
    src, out = Path(src), Path(out)
    cfg = read_config(src)
    if checkpoint.SECTION in cfg:
        raise InputError(f"{src} is already quantised by npumoe; quantise the original checkpoint instead.")
    if is_gptq(cfg):
        raise InputError(f"{src} is a GPTQ export, which npumoe loads as it is (routed experts run packed on the LUT "
                         "kernels); quantise the original checkpoint instead to choose other bits.")
    refuse_quantized(cfg)
    adapter = adapter_for(cfg.get("model_type"))
    model_spec = adapter.spec(cfg)
    spec.check_format(bits, group, symmetric=symmetric)
    _check_destination(src, out)
    tensors = read_tensors(src, adapter)
    Weights(tensors, model_spec, source=str(src))  # refuse an incomplete or misshaped source before any work
    names = checkpoint.quantized_names(model_spec)
    if not names:
        raise InputError(f"{src} has no routed experts to quantise; npumoe quantize is for MoE checkpoints.")
    for name in names:
        k = tensors[name].shape[1]
        if k % group:
            raise InputError(f"{name} has K = {k} inputs, not a multiple of the group size {group}; pick a group "
                             f"size that divides {k}.")
    packed = {name: spec.quantize_pack(tensors.pop(name).float().numpy(), bits, group, symmetric) for name in names}
    kept = {name: tensors[name] for name in expected_shapes(model_spec) if name not in packed}
    info = checkpoint.section(bits, group, symmetric)
    atomic_write_bytes(out / checkpoint.WEIGHTS_FILE, save(*checkpoint.to_safetensors(kept, packed)))
    for file in src.iterdir():
        if file.is_file() and file.name != "config.json" and not _is_weights(file):
            atomic_write_bytes(out / file.name, file.read_bytes())
    atomic_write_text(out / "config.json", json.dumps(cfg | {checkpoint.SECTION: info}, indent=2))
    return info


def _is_weights(file: Path) -> bool:
    return file.name.endswith((".safetensors", ".safetensors.index.json")) or file.suffix in PICKLE_SUFFIXES


def _check_destination(src: Path, out: Path) -> None:
    if out.resolve() == src.resolve():
        raise InputError(f"--out {out} is the source directory; write the quantised checkpoint somewhere else.")
    if out.is_dir():
        stray = [f.name for f in out.iterdir() if _is_weights(f) and f.name != checkpoint.WEIGHTS_FILE]
        if stray:
            raise InputError(f"{out} already holds other weights ({', '.join(sorted(stray))}) that would load with "
                             "the quantised ones; choose an empty --out directory.")
    elif out.exists():
        raise InputError(f"--out {out} is a file; give a directory.")


@click.command("quantize")
@model_option
@click.option("--bits", default=4, show_default=True, type=int, help="Bits per weight: 1, 2, 3, 4 or 8.")
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
    info = quantize_checkpoint(model_dir, out_dir, bits, group, symmetric)
    kind = "symmetric" if info["symmetric"] else "asymmetric"
    click.echo(f"wrote {out_dir}: routed experts at {bits} bits, group {group}, {kind}")
