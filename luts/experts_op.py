"""``npumoe::lut_swiglu_experts`` and ``npumoe::swiglu_experts``: a layer's routed SwiGLU experts over stacked
matrices as one op, packed (int4/int2 experts) or fp32 (an unquantised checkpoint).

What an exported program runs for its routed experts: each row of x through its k experts, weighted and summed
(``down(silu(gate x) ⊙ up x)``), every matrix read in place from the stacks (program constants, so file-backed pages
under a mapped load: no gathered copies, no repacking, no transposes). Eager, they call ``npumoe_lut_swiglu_rows``
or ``npumoe_f32_swiglu_rows`` of ``luts/csrc``, the engine's fused decode call per row; the native runner registers
the same C functions under the same names (core/tools/npumoe_run/lut_ops.cpp). The ``.out`` overloads are what
ExecuTorch's emitter looks for; the fake kernels give the shape for ``torch.export``.
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
F32_ARGS = "Tensor x, Tensor ids, Tensor weights, Tensor gate, Tensor up, Tensor down"
_LIB.define(f"swiglu_experts({F32_ARGS}) -> Tensor")
_LIB.define(f"swiglu_experts.out({F32_ARGS}, *, Tensor(a!) out) -> Tensor(a!)")


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


def _rows(stacks, x, ids, weights, out):
    x, ids = x.to(torch.float32).contiguous(), ids.contiguous()
    weights = weights.to(torch.float32).contiguous()
    torch_op._kernels().calls.swiglu_rows_at(stacks, ids.data_ptr(), weights.data_ptr(), x.shape[0], ids.shape[1],
                                             x.data_ptr(), out.data_ptr(), torch_op.kernel_threads())
    return out


def _out(x, ids, weights, gate_tiles, gate_scales, gate_zeros, up_tiles, up_scales, up_zeros, down_tiles,
         down_scales, down_zeros, bits, group, inter, *, out):
    hidden = x.shape[1]
    stacks = (_stack(gate_tiles, gate_scales, gate_zeros, inter, hidden, bits, group),
              _stack(up_tiles, up_scales, up_zeros, inter, hidden, bits, group),
              _stack(down_tiles, down_scales, down_zeros, hidden, inter, bits, group))
    return _rows(stacks, x, ids, weights, out)


def _f32_out(x, ids, weights, gate, up, down, *, out):
    for t in (gate, up, down):
        if t.dtype != torch.float32 or t.dim() != 3 or not t.is_contiguous():
            raise ValueError("npumoe::swiglu_experts takes contiguous fp32 stacks [experts, out, in]")
    stacks = tuple(kernels.F32Stack(t.data_ptr(), t.shape[1], t.shape[2], t.shape[0]) for t in (gate, up, down))
    return _rows(stacks, x, ids, weights, out)


def _functional(x, *args):
    return _out(x, *args, out=torch.empty(x.shape, dtype=torch.float32))


def _f32_functional(x, *args):
    return _f32_out(x, *args, out=torch.empty(x.shape, dtype=torch.float32))


def _fake(x, *args, **kwargs):
    return kwargs["out"] if "out" in kwargs else x.new_empty(x.shape, dtype=torch.float32)


_LIB.impl("lut_swiglu_experts", _functional, "CPU")
_LIB.impl("lut_swiglu_experts.out", _out, "CPU")
torch.library.register_fake("npumoe::lut_swiglu_experts", _fake, lib=_LIB)
torch.library.register_fake("npumoe::lut_swiglu_experts.out", _fake, lib=_LIB)
_LIB.impl("swiglu_experts", _f32_functional, "CPU")
_LIB.impl("swiglu_experts.out", _f32_out, "CPU")
torch.library.register_fake("npumoe::swiglu_experts", _fake, lib=_LIB)
torch.library.register_fake("npumoe::swiglu_experts.out", _fake, lib=_LIB)


def lut_swiglu_experts(x, ids, weights, stacks, bits: int, group: int, inter: int) -> torch.Tensor:
    """y [rows, H] = Σ_j weights[r, j] · expert_{ids[r, j]}(x[r]) for x [rows, H] fp32, ids [rows, k] int64 and
    ``stacks`` the (tiles, scales, zeros) of gate, up and down (:func:`stack`)."""
    return torch.ops.npumoe.lut_swiglu_experts(x, ids, weights, *stacks[0], *stacks[1], *stacks[2], bits, group, inter)


def swiglu_experts(x, ids, weights, gate, up, down) -> torch.Tensor:
    """:func:`lut_swiglu_experts` over fp32 stacks gate, up [experts, inter, H] and down [experts, H, inter]."""
    return torch.ops.npumoe.swiglu_experts(x, ids, weights, gate, up, down)
