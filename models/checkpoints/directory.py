"""A checkpoint directory's safetensors, as the loaders read them: files found (pickles refused), headers mapped,
stored tensors turned into canonical names by a family adapter without reading their data.

Only safetensors are read. Pickle checkpoints (.bin, .pt, .pth) can run arbitrary code when loaded, so npumoe
refuses them and says how to convert.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import torch

from npumoe.core.base.errors import WeightError
from npumoe.core.ir.tensorfile import Checkpoint
from npumoe.core.ir.weights import TensorSource
from npumoe.models.checkpoints.stored_formats import StoredView, plain_views

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


QUANTIZED = "npumoe_quantization"  # config.json section of npumoe.models.checkpoints.lut


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise WeightError(
            f"{path} holds only pickle checkpoints ({', '.join(pickles)}); npumoe never unpickles weights. "
            "Convert them to safetensors first (e.g. save_pretrained(..., safe_serialization=True))."
        )
    raise WeightError(f"{path} has no *.safetensors weights.")


def open_checkpoint(path: Path) -> Checkpoint:
    """The directory's safetensors, mapped (headers read and checked, no tensor data)."""
    return Checkpoint.open(path, safetensors_files(path))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files the checkpoint is read from (through its index when it has one)."""
    return [f.path for f in open_checkpoint(path).files.values()]


def stored_tensors(path: Path):
    """(name as stored, mapped tensor) for every tensor in the directory's safetensors files."""
    ckpt = open_checkpoint(path)
    for key in ckpt.entries:
        yield key, ckpt.tensor(key)


def canonical_sources(views: list[StoredView], adapter) -> dict[str, TensorSource]:
    """Canonical name → where to read it. The adapter's rules run on shape-only (meta) tensors
    here and on the stored tensor when one is read; an expert of a stacked tensor is read alone
    (a view of it, or for a compressed format only its expert widened)."""
    sources: dict[str, TensorSource] = {}
    for view in views:
        shaped = torch.empty(view.shape, dtype=view.dtype, device="meta")
        for name, t in adapter.canonical(view.key, shaped):
            expert = EXPERT.search(name)
            read = partial(_read_canonical, view, adapter, name)
            if expert and view.read_expert is not None and not EXPERT.search(view.key):  # one of a stack
                read = partial(_read_stacked_expert, view, adapter, name, int(expert.group(1)))
            sources[name] = TensorSource(tuple(t.shape), view.dtype, read)
    return sources


EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _read_canonical(view: StoredView, adapter, name: str) -> torch.Tensor:
    return dict(adapter.canonical(view.key, view.read()))[name]


def _read_stacked_expert(view: StoredView, adapter, name: str, expert: int) -> torch.Tensor:
    """Expert ``expert``'s tensor from a stack of one: the adapter names it expert 0."""
    return dict(adapter.canonical(view.key, view.read_expert(expert)))[EXPERT.sub(".experts.0.", name, count=1)]


def read_tensors(path: Path, adapter) -> dict[str, torch.Tensor]:
    """Every canonical tensor of a plain checkpoint, read (mapped views where the stored layout allows)."""
    return {name: src.read() for name, src in canonical_sources(plain_views(open_checkpoint(path)), adapter).items()}
