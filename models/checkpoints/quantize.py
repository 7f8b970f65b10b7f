"""`npumoe quantize`: a Hugging Face checkpoint → an npumoe-quantised one (:mod:`.checkpoint`).

The linears (by default every one but the routers; ``linears="experts"``: the routed experts, most of an MoE's
bytes) are quantised round-to-nearest per group and stored in the LUT kernels' tiled layout, so a load maps them
as they are; every other tensor is copied unchanged. Beside the weights
and config.json, only what a checkpoint needs comes along (:data:`KEPT`: the tokenizer's files, generation
defaults, the card and licence), never the source's code or other files.
The checkpoint is written into a staging directory beside ``--out`` that replaces it only when
complete, so an interrupted run leaves nothing half-written; ``--out`` must be new, empty or an
earlier npumoe-quantised checkpoint (:mod:`npumoe.core.base.outputs`).
"""

from __future__ import annotations

import fnmatch
import json
import math
import shutil
from pathlib import Path

import torch

from npumoe.core.base.errors import InputError
from npumoe.core.base.outputs import OutputKind, check_free_space, claimed, json_object, staged_directory
from npumoe.core.base.progress import track
from npumoe.core.ir.tensorfile import SafetensorsWriter
from npumoe.core.ir.weights import Weights
from npumoe.luts import layout, spec
from npumoe.models.checkpoints import HEAD_BITS
from npumoe.models.checkpoints import lut as checkpoint
from npumoe.models.checkpoints.directory import canonical_sources, open_checkpoint
from npumoe.models.checkpoints.stored_formats import stored_format, views
from npumoe.models.loader import config_spec, is_gptq, read_config
from npumoe.models.tokenizer import MARKER

# the source's files a quantised checkpoint keeps (shell patterns, any case): Hugging Face's tokenizer files and
# npumoe's byte marker, generation defaults, and the card and licence that travel with the weights
KEPT = ("tokenizer*.json", "tokenizer.model", "*.spm", "spiece.model", "vocab.*", "merges.txt",
        "special_tokens_map.json", "added_tokens.json", "chat_template.*", MARKER, "generation_config.json",
        "readme", "readme.*", "card.*", "license", "license.*", "notice", "notice.*", "use_policy.*")
QUANTIZED_CHECKPOINT = OutputKind("an npumoe-quantised checkpoint", directory=True,
                                  recognise=lambda path: checkpoint.SECTION in json_object(path / "config.json"))


def default_head_bits(bits: int) -> int:
    """The LM head's bits when every linear is packed: the most sensitive matrix, so never fewer than HEAD_BITS
    (on the demo a 6-bit head gives the held-out perplexity an 8-bit one does: docs/formats.md)."""
    return max(bits, HEAD_BITS)


def quantize_checkpoint(src: str | Path, out: str | Path, bits: int, group: int, symmetric: bool = False,
                        progress: bool | None = None, linears: str = "all", head_bits: int | None = None) -> dict:
    """Write the quantised checkpoint of ``src`` to ``out``; returns its config section. ``linears`` is
    "all" (every linear but the routers, :func:`checkpoint.quantized_names`: what the CPU decodes fastest) or
    "experts" (the routed experts, for the NPU paths that take only those); ``head_bits`` the LM head's bits when
    it is packed (default :func:`default_head_bits`); ``progress``: see :mod:`npumoe.core.base.progress`."""
    src, out = Path(src), Path(out)
    cfg = read_config(src)
    if checkpoint.SECTION in cfg:
        raise InputError(f"{src} is already quantised by npumoe; quantise the original checkpoint instead.")
    if is_gptq(cfg):
        raise InputError(f"{src} is a GPTQ export, which npumoe loads as it is (routed experts run packed on the LUT "
                         "kernels); quantise the original checkpoint instead to choose other bits.")
    stored_format(cfg)  # FP8 and MXFP4 sources are widened tensor by tensor; other quantisations refused
    adapter, model_spec = config_spec(cfg, str(src / "config.json"), src)
    if linears not in checkpoint.LINEARS:
        raise InputError(f"--linears {linears!r} is not one of {', '.join(checkpoint.LINEARS)}.")
    spec.check_format(bits, group, symmetric=symmetric)
    head_bits = default_head_bits(bits) if head_bits is None and linears == "all" else head_bits
    if head_bits is not None:
        spec.check_format(head_bits, group, symmetric=symmetric)
    if out.resolve() == src.resolve():
        raise InputError(f"--out {out} is the source directory; write the quantised checkpoint somewhere else.")
    with claimed(out, QUANTIZED_CHECKPOINT):
        sources = canonical_sources(views(open_checkpoint(src), cfg), adapter)
        weights = Weights(sources, model_spec, source=str(src))  # refuse an incomplete or misshaped source, unread
        names = set(checkpoint.quantized_names(model_spec, linears))
        if not names:
            raise InputError(f"{src} has no routed experts to quantise; npumoe quantize is for MoE checkpoints.")
        for name in sorted(names):
            k = weights.source(name).shape[1]
            if k % group:
                raise InputError(f"{name} has K = {k} inputs, not a multiple of the group size {group}; pick a group "
                                 f"size that divides {k}.")
        info = checkpoint.section(bits, group, symmetric, linears, head_bits if checkpoint.HEAD in names else None)
        bits_of = {name: head_bits if name == checkpoint.HEAD and head_bits is not None else bits for name in names}
        plain = {k: v for k, v in cfg.items() if k != "quantization_config"}  # the source's format is gone
        check_free_space(out, output_bytes(weights, bits_of, group, symmetric))
        with staged_directory(out) as staging:
            _write_weights(staging / checkpoint.WEIGHTS_FILE, weights, bits_of, group, symmetric, progress)
            for file in src.iterdir():
                if file.is_file() and kept(file.name):
                    shutil.copyfile(file, staging / file.name)
            (staging / "config.json").write_text(json.dumps(plain | {checkpoint.SECTION: info}, indent=2))
        return info


def _write_weights(path: Path, weights: Weights, packed: dict[str, int], group: int, symmetric: bool,
                   progress: bool | None) -> None:
    """Stream tensor by tensor from the mapped source into the output file: memory holds one matrix."""
    writer = SafetensorsWriter(path, tensors=len(weights) * (len(checkpoint.PARTS) + 1))  # + the tiles' padding
    meta = {}
    try:
        for name in track(weights, f"quantising {len(packed)} matrices", "tensors", progress):
            stored = weights.source(name).read()
            if name not in packed:
                writer.add(name, stored)
                continue
            tiled = layout.quantize_tiles(lambda start, stop: stored[start:stop].float().numpy(), tuple(stored.shape),
                                          packed[name], group, symmetric)
            for part, array in checkpoint.stored_parts(tiled):
                writer.add(f"{name}.{part}", torch.from_numpy(array), align=checkpoint.TILES_ALIGN if part == "tiles"
                           else 1)
            meta[name] = {"bits": tiled.bits, "group": group, "symmetric": symmetric, "shape": list(tiled.shape),
                          "checksum": layout.tiles_checksum(tiled)}
        writer.finish({checkpoint.METADATA_KEY: json.dumps(meta, sort_keys=True)})
    except BaseException:
        writer.abort()
        raise


def output_bytes(weights: Weights, packed: dict[str, int], group: int, symmetric: bool) -> int:
    """The quantised weights' bytes, known before any is written: packed matrices tiled, each tiles array on a
    cache line as :func:`_write_weights` places it, the rest as stored."""
    offset = 0
    for name in weights:
        shape = weights.source(name).shape
        if name not in packed:
            offset += math.prod(shape) * weights.source(name).dtype.itemsize
            continue
        offset += -offset % checkpoint.TILES_ALIGN
        offset += sum(layout.tiled_bytes(packed[name], group, shape, symmetric).values())
    return offset


def kept(name: str) -> bool:
    """Whether a quantised checkpoint keeps the source's file ``name`` (its weights and config are written anew)."""
    return any(fnmatch.fnmatch(name.lower(), pattern.lower()) for pattern in KEPT)
