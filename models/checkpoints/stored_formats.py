"""Checkpoints whose weights are stored in a compressed float format, read as stored and widened per tensor.

* **Block FP8** (DeepSeek-V3 as published: ``quant_method: fp8``): each quantised ``X.weight`` is
  float8 E4M3 with ``X.weight_scale_inv`` (fp32, one per 128×128 block); the weight is
  ``fp8 · scale`` of its block.
* **MXFP4** (gpt-oss as published: ``quant_method: mxfp4``, the OCP Microscaling format): the
  stacked expert tensors ``X_blocks`` [E, out, K/32, 16] hold two FP4 E2M1 codes a byte (low
  nibble first) and ``X_scales`` [E, out, K/32] one E8M0 exponent (bias 127) per 32 inputs; the
  weight is ``fp4 · 2^(e − 127)``, exact in bf16, laid out [E, in, out] as gpt-oss stores its
  unquantised experts. ``npumoe.load`` holds routed MXFP4 experts as LUT codes instead
  (:mod:`npumoe.models.checkpoints.mxfp4`); the widened view is what stays for the rest.

Nothing is widened at load: a :class:`StoredView` reads one tensor, or one expert of a stacked
one, when a graph asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from npumoe.core.base.errors import UnsupportedModelError, WeightError
from npumoe.core.ir.tensorfile import Checkpoint
from npumoe.luts.mxfp4 import FP4_VALUES, MX_BLOCK

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class StoredView:
    """One tensor as an adapter sees it: its name, shape and dtype as stored (after widening), how to
    read it, and for a stacked expert tensor how to read one expert (as a stack of one)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]
    read_expert: Callable[[int], torch.Tensor] | None = None


def plain_views(ckpt: Checkpoint) -> list[StoredView]:
    return [StoredView(key, e.shape, e.dtype, lambda key=key: ckpt.tensor(key),
                       lambda i, key=key: ckpt.tensor(key)[i:i + 1]) for key, e in ckpt.entries.items()]


def stored_format(cfg: dict) -> str | None:
    """"fp8", "mxfp4", or None for plain weights; other quantisations are refused by name."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method in ("fp8", "mxfp4"):
        return method
    raise UnsupportedModelError(
        f"this checkpoint is quantized ({method or 'an unknown method'}); npumoe reads bf16/fp16/fp32 weights, "
        "block-FP8 (DeepSeek-V3), MXFP4 (gpt-oss) and GPTQ exports, so use a dequantized copy of the model."
    )


def views(ckpt: Checkpoint, cfg: dict) -> list[StoredView]:
    fmt = stored_format(cfg)
    if fmt == "fp8":
        return fp8_views(ckpt, tuple(cfg["quantization_config"].get("weight_block_size") or (128, 128)))
    if fmt == "mxfp4":
        return mxfp4_views(ckpt)
    return plain_views(ckpt)


# -- block FP8 -----------------------------------------------------------------------------------------
def fp8_views(ckpt: Checkpoint, block: tuple[int, int]) -> list[StoredView]:
    out = []
    for view in plain_views(ckpt):
        if view.key.endswith("_scale_inv"):
            continue
        if view.dtype not in FP8_DTYPES:
            out.append(view)
            continue
        scale_key = f"{view.key}_scale_inv"
        if scale_key not in ckpt.entries:
            raise WeightError(f"FP8 weight {view.key} has no {scale_key}, so its values cannot be known; the "
                              "checkpoint is incomplete.")
        rows, cols = view.shape[-2:]
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if ckpt.entries[scale_key].shape[-2:] != want:
            raise WeightError(f"{scale_key} has shape {list(ckpt.entries[scale_key].shape)}, but a {rows}×{cols} FP8 "
                              f"weight in {block[0]}×{block[1]} blocks needs {list(want)}; the checkpoint is damaged.")
        out.append(StoredView(view.key, view.shape, torch.float32,
                              lambda key=view.key: fp8_dequantize(ckpt.tensor(key), ckpt.tensor(f"{key}_scale_inv"),
                                                                  block)))
    return out


def fp8_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 weight: each ``block`` of the FP8 weight times its scale."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return weight.float() * scale[..., :rows, :cols]


# -- MXFP4 ---------------------------------------------------------------------------------------------
def mxfp4_stacks(ckpt: Checkpoint) -> dict[str, tuple[int, int, int]]:
    """Stacked MXFP4 tensors by base name X (stored as ``X_blocks`` / ``X_scales``): (experts, output
    rows, input groups of 32), each one's blocks checked against its scales."""
    stacks = {}
    for key, entry in ckpt.entries.items():
        if not key.endswith("_blocks"):
            continue
        base = key[: -len("_blocks")]
        scales = ckpt.entries.get(f"{base}_scales")
        codes = entry.dtype == torch.uint8 and len(entry.shape) == 4 and entry.shape[-1] == MX_BLOCK // 2
        if scales is None or not codes or scales.shape != entry.shape[:-1]:
            got = "none" if scales is None else list(scales.shape)
            raise WeightError(f"MXFP4 tensor {key} {entry.dtype}{list(entry.shape)} needs uint8 [experts, rows, "
                              f"K/32, 16] codes and {base}_scales of shape {list(entry.shape[:-1])} (one exponent per "
                              f"32 codes), found {got}; the checkpoint is damaged.")
        stacks[base] = tuple(entry.shape[:3])
    return stacks


def mxfp4_views(ckpt: Checkpoint) -> list[StoredView]:
    stacks = mxfp4_stacks(ckpt)
    out = [view for view in plain_views(ckpt) if not view.key.endswith(("_blocks", "_scales"))]
    for base, (experts, rows, groups) in stacks.items():
        out.append(StoredView(
            base, (experts, groups * MX_BLOCK, rows), torch.bfloat16,
            lambda base=base: mxfp4_dequantize(ckpt.tensor(f"{base}_blocks"), ckpt.tensor(f"{base}_scales")),
            lambda i, base=base: mxfp4_dequantize(ckpt.tensor(f"{base}_blocks")[i:i + 1],
                                                  ckpt.tensor(f"{base}_scales")[i:i + 1])))
    return out


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, in, out] bf16 from blocks [E, out, G, 16] and E8M0 scales [E, out, G] (exact: FP4 values have
    two significant bits, and bf16 has fp32's exponent range)."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # low nibble first
    values = torch.ldexp(table[codes].flatten(-2), (scales.long() - 127)[..., None].float())
    return values.flatten(-2).transpose(1, 2).to(torch.bfloat16)
