"""``npumoe::lut_linear_rows``: one packed linear over rows of activations, as an exported program runs it; and
``npumoe::f32_linear_rows``, one fp32 linear read in place (a cpu program's LM head, of which XNNPACK would keep a
packed fp32 copy in anonymous memory).

``npumoe::lut_linear`` (:mod:`npumoe.luts.torch_op`) is the engine's op; this sibling is what ExecuTorch can emit and
the native runner can run: an ``.out`` overload, a fake kernel for ``torch.export``, symmetric weights as empty zeros,
and the path choice's crossovers as arguments (the runner cannot measure them), so that eagerly and in npumoe-run it
calls one C function, ``npumoe_lut_linear`` of ``luts/csrc``, which takes the path the engine's op takes for the same
rows (the LUT-GEMV for decode rows, the int8 or dequantising GEMM for a prompt's chunk). The tiles, scales and zeros are
program constants, read where the loader mapped them (core/tools/npumoe_run/lut_ops.cpp registers the same names).
"""

from __future__ import annotations

import torch

from npumoe.luts import layout, torch_op

ARGS = ("Tensor x, Tensor valid, Tensor tiles, Tensor scales, Tensor zeros, int bits, int group, int out_features, "
        "int int8_from, int dequant_from")
_LIB = torch.library.Library("npumoe", "FRAGMENT")
_LIB.define(f"lut_linear_rows({ARGS}) -> Tensor")
_LIB.define(f"lut_linear_rows.out({ARGS}, *, Tensor(a!) out) -> Tensor(a!)")
_LIB.define("f32_linear_rows(Tensor x, Tensor w) -> Tensor")
_LIB.define("f32_linear_rows.out(Tensor x, Tensor w, *, Tensor(a!) out) -> Tensor(a!)")


def fits(weight: layout.TiledWeight) -> bool:
    """Does the op take this matrix (whole row blocks: its outputs are the kernels' rows, unpadded)?"""
    return weight.shape[0] % layout.ROWS == 0


def _out(x, valid, tiles, scales, zeros, bits, group, out_features, int8_from, dequant_from, *, out):
    weight = torch_op._tiled(tiles, scales, zeros if zeros.numel() else None, bits, group, out_features,
                             tiles.shape[1] * layout.TILE_K)
    if not fits(weight) or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"npumoe::lut_linear_rows takes rows [M, {weight.shape[1]}] and whole row blocks")
    x = x.to(torch.float32).contiguous()
    torch_op._kernels().calls.lut_linear_at(weight, x.data_ptr(), x.shape[0], int(valid[0]), out.data_ptr(), int8_from,
                                            dequant_from, torch_op.kernel_threads())
    return out


def _functional(x, valid, tiles, *args):
    return _out(x, valid, tiles, *args, out=torch.empty(x.shape[0], tiles.shape[0] * layout.ROWS))


def _fake(x, valid, tiles, scales, zeros, bits, group, out_features, *args, **kwargs):
    return kwargs["out"] if "out" in kwargs else x.new_empty((x.shape[0], out_features), dtype=torch.float32)


def _f32_out(x, w, *, out):
    if w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous() or x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"npumoe::f32_linear_rows takes rows [M, K] and a contiguous fp32 [N, K], got {x.shape} and "
                         f"{w.dtype} {w.shape}")
    x = x.to(torch.float32).contiguous()
    torch_op._kernels().calls.f32_linear_at(w.data_ptr(), w.shape[0], w.shape[1], x.data_ptr(), x.shape[0],
                                            out.data_ptr(), torch_op.kernel_threads())
    return out


def _f32_functional(x, w):
    return _f32_out(x, w, out=torch.empty(x.shape[0], w.shape[0]))


def _f32_fake(x, w, **kwargs):
    return kwargs["out"] if "out" in kwargs else x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


_LIB.impl("f32_linear_rows", _f32_functional, "CPU")
_LIB.impl("f32_linear_rows.out", _f32_out, "CPU")
torch.library.register_fake("npumoe::f32_linear_rows", _f32_fake, lib=_LIB)
torch.library.register_fake("npumoe::f32_linear_rows.out", _f32_fake, lib=_LIB)
_LIB.impl("lut_linear_rows", _functional, "CPU")
_LIB.impl("lut_linear_rows.out", _out, "CPU")
torch.library.register_fake("npumoe::lut_linear_rows", _fake, lib=_LIB)
torch.library.register_fake("npumoe::lut_linear_rows.out", _fake, lib=_LIB)


def lut_linear_rows(x: torch.Tensor, valid: torch.Tensor | None, tiles: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """y [..., N] = x [..., K] · Wᵀ (fp32) for W the tiled matrix (zeros empty: symmetric), for the first ``valid``
    [1] (int64) of x's rows, or all of them (None); the others (a prefill chunk's padding) come out zero. The path is
    the one this machine's crossovers (:func:`npumoe.luts.torch_op.path_crossovers`) give for all of x's rows: the
    engine runs a padded chunk whole, and a short prompt's rows by the LUT-GEMV instead would put that path's error
    into the KV cache every decode step reads (issue 33)."""
    out_features = tiles.shape[0] * layout.ROWS
    rows = x.reshape(-1, x.shape[-1])
    valid = torch.full((1,), rows.shape[0], dtype=torch.int64) if valid is None else valid
    y = torch.ops.npumoe.lut_linear_rows(rows, valid, tiles, scales, zeros, bits, group, out_features,
                                         *torch_op.path_crossovers(bits))
    return y.reshape(*x.shape[:-1], out_features)


def f32_linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] · Wᵀ for W [N, K] fp32, read where it lies."""
    return torch.ops.npumoe.f32_linear_rows(x, w)
