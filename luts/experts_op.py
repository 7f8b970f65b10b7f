"""``npumoe::lut_swiglu_experts``: a layer's routed SwiGLU experts over stacked packed matrices as one op.

What an exported program runs for int4/int2 experts: each row of x through its k experts, weighted and summed
(``down(silu(gate x) ⊙ up x)``), every matrix read in place from the stacked tiles, scales and zeros (program
constants, so file-backed pages under a mapped load: no gathered copies, no repacking). Eager, it calls
``npumoe_lut_swiglu_rows`` of ``luts/csrc``, the engine's fused decode call per row; the native runner registers the
same C function under the same name (core/tools/npumoe_run/lut_ops.cpp). The ``.out`` overload is what ExecuTorch's
emitter looks for; the fake kernels give the shape for ``torch.export``.
"""

from __future__ import annotations

import numpy as np
import torch

from npumoe.luts import kernels, layout, torch_op

ARGS = ("Tensor x, Tensor ids, Tensor weights, Tensor gate_tiles, Tensor gate_scales, Tensor gate_zeros, "
        "Tensor up_tiles, Tensor up_scales, Tensor up_zeros, Tensor down_tiles, Tensor down_scales, "
        "Tensor down_zeros, int bits, int group, int inter")
_LIB = torch.library.Library("npumoe", "FRAGMENT")
_LIB.define(f"lut_swiglu_experts({ARGS}) -> Tensor")
_LIB.define(f"lut_swiglu_experts.out({ARGS}, *, Tensor(a!) out) -> Tensor(a!)")


def stack(matrices: list[layout.TiledWeight]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tiles, scales, zeros) of every expert's matrix of one name, stacked on a leading expert axis; zeros empty
    for symmetric weights (the op's sign of it)."""
    zeros = [m.zeros for m in matrices]
    return (torch.from_numpy(np.stack([m.tiles for m in matrices])),
            torch.from_numpy(np.stack([m.scales for m in matrices])),
            torch.zeros(0, dtype=torch.uint8) if zeros[0] is None else torch.from_numpy(np.stack(zeros)))


def _stack(tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, n: int, k: int, bits: int,
           group: int) -> kernels.LutStack:
    for t in (tiles, scales, zeros):
        if not t.is_contiguous():
            raise ValueError("npumoe::lut_swiglu_experts takes contiguous stacked matrices")
    return kernels.LutStack(tiles.data_ptr(), scales.data_ptr(), zeros.data_ptr() if zeros.numel() else None, n, k,
                            bits, group, tiles.shape[0])


def _out(x, ids, weights, gate_tiles, gate_scales, gate_zeros, up_tiles, up_scales, up_zeros, down_tiles,
         down_scales, down_zeros, bits, group, inter, *, out):
    hidden = x.shape[1]
    stacks = (_stack(gate_tiles, gate_scales, gate_zeros, inter, hidden, bits, group),
              _stack(up_tiles, up_scales, up_zeros, inter, hidden, bits, group),
              _stack(down_tiles, down_scales, down_zeros, hidden, inter, bits, group))
    x, ids = x.to(torch.float32).contiguous(), ids.contiguous()
    weights = weights.to(torch.float32).contiguous()
    torch_op._kernels().calls.lut_swiglu_rows_at(stacks, ids.data_ptr(), weights.data_ptr(), x.shape[0],
                                                 ids.shape[1], x.data_ptr(), out.data_ptr(),
                                                 torch_op.kernel_threads())
    return out


def _functional(x, *args):
    return _out(x, *args, out=torch.empty(x.shape, dtype=torch.float32))


def _fake(x, *args, **kwargs):
    return kwargs["out"] if "out" in kwargs else x.new_empty(x.shape, dtype=torch.float32)


_LIB.impl("lut_swiglu_experts", _functional, "CPU")
_LIB.impl("lut_swiglu_experts.out", _out, "CPU")
torch.library.register_fake("npumoe::lut_swiglu_experts", _fake, lib=_LIB)
torch.library.register_fake("npumoe::lut_swiglu_experts.out", _fake, lib=_LIB)


def lut_swiglu_experts(x, ids, weights, stacks, bits: int, group: int, inter: int) -> torch.Tensor:
    """y [rows, H] = Σ_j weights[r, j] · expert_{ids[r, j]}(x[r]) for x [rows, H] fp32, ids [rows, k] int64 and
    ``stacks`` the (tiles, scales, zeros) of gate, up and down (:func:`stack`)."""
    return torch.ops.npumoe.lut_swiglu_experts(x, ids, weights, *stacks[0], *stacks[1], *stacks[2], bits, group, inter)
