"""gpt-oss MXFP4 checkpoints with their routed experts on the LUT kernels, code for code.

gpt-oss stores its experts as stacked MXFP4 tensors (:mod:`npumoe.models.checkpoints.stored_formats`). Their
E2M1 codes and E8M0 scales are exactly npumoe 5-bit symmetric codes with fp16 scales
(:mod:`npumoe.luts.mxfp4`), so each routed expert matrix loads as a :class:`Deferred` packed
matrix: the CPU executor runs it through ``npumoe::lut_linear`` with no second rounding. A matrix
with a scale outside float16 keeps the widened bf16 source every other tensor reads through.

Which stored rows make which canonical matrix (gpt-oss interleaves gate and up rows in
``gate_up_proj``) is asked of the family adapter, the rule its widened tensors go through too,
rather than restated here.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch

from npumoe.core.base.errors import UnsupportedModelError
from npumoe.core.ir.spec import ModelSpec
from npumoe.core.ir.tensorfile import Checkpoint
from npumoe.core.ir.weights import TensorSource
from npumoe.luts import mxfp4
from npumoe.luts.mxfp4 import MX_BLOCK
from npumoe.models.checkpoints.lut import Deferred, quantized_names
from npumoe.models.checkpoints.stored_formats import mxfp4_stacks, views


def read(path: Path, cfg: dict, adapter, model_spec: ModelSpec) -> tuple[dict[str, TensorSource], dict[str, Deferred]]:
    """(every canonical tensor's source, the routed experts as deferred packed matrices)."""
    from npumoe.models.checkpoints.directory import canonical_sources, open_checkpoint

    ckpt = open_checkpoint(path)
    sources = canonical_sources(views(ckpt, cfg), adapter)
    routed = set(quantized_names(model_spec))
    packed = {}
    for base, (experts, rows, _) in mxfp4_stacks(ckpt).items():
        for name, expert, picked in stacked_rows(adapter, base, experts, rows, path):
            if name in routed:
                part = partial(_rows, ckpt, base, expert, picked)
                packed[name] = Deferred(mxfp4.BITS, MX_BLOCK, lambda part=part: mxfp4.exact_in_fp16(part("scales")),
                                        lambda part=part: mxfp4.from_mxfp4(part("blocks"), part("scales")))
    return sources, packed


def stacked_rows(adapter, base: str, experts: int, rows: int, path: Path) -> Iterator[tuple[str, int, np.ndarray]]:
    """(canonical name, expert, its stored output rows) for each matrix the adapter makes of a stacked tensor.

    The adapter's rules run on the row numbers laid out like the widened [E, in, out] view with a
    single input, so each matrix it yields is the list of stored rows it takes, in order.
    """
    numbers = torch.arange(experts * rows).reshape(experts, 1, rows)
    for name, picked in adapter.canonical(base, numbers):
        flat = picked.reshape(-1).numpy()
        expert = flat // rows
        if picked.dim() != 2 or picked.shape[1] != 1 or np.any(expert != expert[0]):
            raise UnsupportedModelError(f"{path}: MXFP4 tensor {base} maps to {name} in a way other than whole output "
                                        "rows of one expert, so npumoe cannot read it; this model type's MXFP4 layout "
                                        "is not supported.")
        yield name, int(expert[0]), flat % rows


def _rows(ckpt: Checkpoint, base: str, expert: int, rows: np.ndarray, part: str) -> np.ndarray:
    """Those rows of one expert's ``blocks`` or ``scales``, read from the mapped file."""
    return ckpt.tensor(f"{base}_{part}")[expert].numpy()[rows]
