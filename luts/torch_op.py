"""``npumoe::lut_linear``: the LUT kernels as a torch custom op, and a module carrying a packed weight.

The op is a pure function of tensors (the tiled weight) and ints, with a fake
implementation that only gives the output shape, so graphs using it trace and export
with ``torch.export``. On CPU it runs the compiled kernels with :func:`kernel_threads` threads
(torch's count, unless :func:`torch_on_one_thread` holds torch to one): a LUT-GEMV per activation
row for decode-sized inputs, the fused LUT-dequant GEMM once there are enough rows to amortise
dequantising each weight once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from npumoe.core.base.errors import InputError
from npumoe.luts import kernels, layout, spec
from npumoe.luts.tuning import BF16_GEMV_MAX_ROWS

EXACT_GEMM_FROM = 64  # rows × bits from which weights above 4 bits take the exact dequantising GEMM


def uses_gemm(rows: int, bits: int, run: kernels.LutKernels | None = None) -> bool:
    """Dequantise once (GEMM) from the rows × bits this machine's crossover measured (``run.crossovers.dequant``,
    :mod:`npumoe.luts.tuning`); below, the LUT-GEMV (a few rows at a time, each tile read once for them). At 3-4
    bits the int8 GEMM comes first where the build and CPU have one (:func:`uses_int8`).

    A LUT-GEMV's table lookups grow with bits × rows; the GEMM's dequantisation costs about the same at any width.
    Above 4 bits the GEMV's 8-bit activation tables, not the weights, set its error (MXFP4 experts, 8-bit heads), so
    the exact dequantising GEMM takes over early there, whatever the machine. Measurements: docs/performance.md,
    "Prefill paths (LUT)".
    """
    dequant_from = path_crossovers(bits, run)[1]
    return dequant_from > 0 and rows * bits >= dequant_from


def path_crossovers(bits: int, run: kernels.LutKernels | None = None) -> tuple[int, int]:
    """(int8_from rows, dequant_from rows × bits) at which a product of ``bits``-bit weights leaves the LUT-GEMV for
    the int8 GEMM (:func:`uses_int8`) or the dequantising GEMM (:func:`uses_gemm`) on ``run`` 's build; 0: never. The
    one statement of the rule: an exported program carries these numbers for the C side's choice
    (``npumoe_lut_linear``)."""
    crossovers = (run or _kernels()).crossovers
    int8_from = crossovers.int8 or 0 if 3 <= bits <= 4 else 0
    return int8_from, EXACT_GEMM_FROM if bits > 4 else crossovers.dequant or 0


@functools.cache
def _kernels() -> kernels.LutKernels:
    return kernels.kernels()


_held_threads: int | None = None  # torch's thread count while torch_on_one_thread holds it at one


def kernel_threads() -> int:
    return _held_threads or torch.get_num_threads()


@contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """Torch's own ops on one thread while the kernels keep torch's thread count. In a decode step whose
    matrices the kernels read, torch is left with small ops that gain nothing from threads, and its OpenMP
    workers spin after each one on the core a kernel's worker needs (docs/performance.md, "Torch's threads").
    A prompt's attention, the one large product left to torch, runs its query positions on the held threads
    instead (:func:`on_held_threads`)."""
    global _held_threads
    if _held_threads is not None:
        yield
        return
    _held_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(_held_threads)
        _held_threads = None


_helpers: tuple[int, ThreadPoolExecutor] | None = None  # (its threads, the pool) for on_held_threads


def on_held_threads(pieces: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """Each piece's result, the pieces run side by side on the threads torch_on_one_thread holds (torch on one
    thread in each: no OpenMP worker is left spinning after them, as after a threaded torch op, on the core the
    next kernel call needs). One piece per thread at most; the first runs on the caller."""
    global _helpers
    if len(pieces) > kernel_threads():
        raise ValueError(f"{len(pieces)} pieces for {kernel_threads()} threads")
    if _helpers is None or _helpers[0] < len(pieces) - 1:
        if _helpers is not None:
            _helpers[1].shutdown(wait=False)
        _helpers = (len(pieces) - 1, ThreadPoolExecutor(max(1, len(pieces) - 1), thread_name_prefix="npumoe-attention"))
    others = [_helpers[1].submit(piece) for piece in pieces[1:]]
    return [pieces[0](), *(other.result() for other in others)]


def held_threads() -> int:
    """The threads a torch_on_one_thread block holds for the kernels (and :func:`on_held_threads`); 1 outside."""
    return _held_threads or 1


def bf16_dot_available() -> bool:
    """Does this build run the dot-product GEMM (AVX-512 BF16)?"""
    return bool(getattr(_kernels().calls, "bf16_dot", False))


def kernels_take_bf16_prompts() -> bool:
    """Do the kernels take a bf16 model's prompt products themselves (the dot-product or the widening GEMM)?"""
    return bf16_dot_available() or _kernels().crossovers.bf16_gemm is not None


def _tiled(tiles, scales, zeros, bits: int, group: int, out_features: int, in_features: int) -> layout.TiledWeight:
    """The op's tensors as the kernels' weight (which they check before use)."""
    return layout.TiledWeight(bits, group, (out_features, in_features), tiles.numpy(), scales.numpy(),
                              None if zeros is None else zeros.numpy())


def _compute(x: torch.Tensor, weight: layout.TiledWeight) -> torch.Tensor:
    """The CPU work behind the op: a LUT-GEMV per row for few rows, else the fused GEMM."""
    if x.device.type != "cpu":
        raise InputError(f"npumoe::lut_linear runs on the CPU; move the activations from {x.device} to cpu.")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise InputError(f"activations of shape {list(x.shape)} do not fit a weight with {k} inputs.")
    rows = x.detach().reshape(-1, k).to(torch.float32).contiguous().numpy()
    y, _ = lut_product(_kernels(), weight, rows, kernel_threads())
    return torch.from_numpy(np.ascontiguousarray(y)).reshape(*x.shape[:-1], n).to(x.dtype)


def lut_product(run: kernels.LutKernels, weight: layout.TiledWeight, rows: np.ndarray, threads: int):
    """(y [M, N] = rows · Wᵀ, the path's name) by the path the op takes for M rows on ``run`` 's build: the
    dequantising GEMM, the int8 GEMM or the LUT-GEMV."""
    path = product_path(rows.shape[0], weight.bits, run)
    if path == "int8":
        if (y := run.gemm_int8(weight, rows, threads)) is not None:
            return y, "int8 GEMM"
        path = product_path(rows.shape[0], weight.bits, run, int8=False)  # the int8 GEMM declined this weight
    if path == "gemm":
        return run.gemm(weight, rows, threads), "dequant GEMM"
    return run.gemv(weight, rows, threads=threads), "LUT-GEMV"


def product_path(rows: int, bits: int, run: kernels.LutKernels, int8: bool = True) -> str:
    """The one rule that picks a packed product's kernel for ``rows`` rows on ``run`` 's build, whether a matrix
    runs alone or batched: "int8" (the int8 GEMM, unless ``int8`` is False), "gemm" (the dequantising GEMM) or
    "gemv" (the LUT-GEMV)."""
    if int8 and uses_int8(rows, bits, run):
        return "int8"
    return "gemm" if uses_gemm(rows, bits, run) else "gemv"


def uses_int8(rows: int, bits: int, run: kernels.LutKernels | None = None) -> bool:
    """Quantise the activations to int8 and take byte dot products (AVX-512 VNNI, AVX2, NEON on ARMv8.2's sdot) at
    3-4 bits from the rows this machine's crossover measured (``run.crossovers.int8``, :mod:`npumoe.luts.tuning`),
    ahead of the dequantising GEMM: a LUT-GEMV row costs two lookups and two dot products per bit plane, an int8
    row one or two instructions per vector of weights once each tile is unpacked. Its error is the LUT-GEMV's kind
    and size (spec.int8_gemv; NMSE against fp32 3.5e-5 where the LUT-GEMV's is 5.7e-5 on Gaussian weights and
    activations). Measurements: docs/performance.md, "Prefill paths (LUT)" and "bench neon"."""
    int8_from = path_crossovers(bits, run)[0]
    return int8_from > 0 and rows >= int8_from


# Rows from which a bf16 matrix takes the dot-product GEMM (AVX-512 BF16, spec.bf16_dot_gemm) on activations
# rounded to bf16, as torch's bf16 matmul and llama.cpp's F16 path (to fp16) round them: two products per lane
# and instruction where widening the weights to fp32 makes one, so a prompt runs several times faster
# (docs/performance.md, "bf16 paths"). From two rows: a prompt's rarely chosen experts get a few rows each, which
# the dot GEMM reads at the GEMV's speed and computes in less time. One row (decode) stays on the exact GEMV.
BF16_DOT_FROM = 2


def fast_compute_dtypes() -> frozenset[torch.dtype]:
    """Stored dtypes the kernels compute from faster than torch from fp32 copies, in decode and prompts alike:
    bf16 where they take its prompt products too (a build without the bf16 GEMMs leaves those to torch)."""
    return frozenset({torch.bfloat16}) if kernels_take_bf16_prompts() else frozenset()


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] (fp32) · Wᵀ for a C-contiguous bf16 W through the bf16 kernels, reading W once at
    2 bytes a weight; None where they do not apply (more rows than the GEMV pays for on a CPU without the
    dot-product GEMM, a strided W)."""
    path = _bf16_path(x, w)
    if path is None:
        return None
    k = x.shape[-1]
    rows = x.numel() // k
    calls = _kernels().calls
    if not hasattr(calls, "bf16_gemv_at"):  # emulated kernels (another ISA under qemu): through arrays
        product = _kernels().bf16_gemm if path == "gemm" else _kernels().bf16_gemv
        y = product(w.detach().view(torch.int16).numpy(), x.detach().reshape(rows, k).contiguous().numpy(),
                    kernel_threads())
        return torch.from_numpy(y).reshape(*x.shape[:-1], w.shape[0])
    # addresses, not arrays: a numpy view of each tensor costs a noticeable share of a decode GEMV
    # (docs/performance.md, "Call overhead")
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], w.shape[0])
    if path == "dot":
        calls.bf16_dot_gemm_many_at([(w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, *w.shape)], kernel_threads())
    else:
        run = calls.bf16_gemm_at if path == "gemm" else calls.bf16_gemv_at
        run(w.data_ptr(), x.data_ptr(), rows, w.shape[0], k, y.data_ptr(), kernel_threads())
    return y


def rms_norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x's rows · rsqrt(mean(x²) + eps) · w in one pass of C (the decode block's own norm) where torch makes five
    over a prompt's rows; fp32 x and a fp32 or bf16 w as wide as its rows, else None (and under a tracer)."""
    if not (_eager(x) and x.dtype == torch.float32 and w.dim() == 1 and w.shape[0] == x.shape[-1]
            and w.dtype in (torch.float32, torch.bfloat16) and x.numel()):
        return None  # (a tracer first: it cannot follow the kernels' loading)
    calls = _kernels().calls
    if not hasattr(calls, "rms_norm_rows_at"):
        return None
    x, w = x.contiguous(), w.float().contiguous()
    out = torch.empty_like(x)
    calls.rms_norm_rows_at(x.data_ptr(), w.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, out.data_ptr())
    return out


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """x [rows, heads, d] rotated by cos and sin [rows, d] in one pass of C (the decode block's own rotation); None
    where the shapes or dtypes differ from those, and under a tracer."""
    if not (_eager(x) and x.dim() == 3 and x.dtype == cos.dtype == sin.dtype == torch.float32
            and cos.shape == sin.shape == (x.shape[0], x.shape[2]) and x.shape[2] % 2 == 0):
        return None  # (a tracer first: it cannot follow the kernels' loading)
    calls = _kernels().calls
    if not hasattr(calls, "rope_rows_at"):
        return None
    out, cos, sin = x.contiguous().clone(), cos.contiguous(), sin.contiguous()
    calls.rope_rows_at(out.data_ptr(), cos.data_ptr(), sin.data_ptr(), *out.shape, interleaved)
    return out


def bf16_linear_many(xs: list[torch.Tensor], ws: list[torch.Tensor],
                     outs: list[torch.Tensor] | None = None) -> list[torch.Tensor | None] | None:
    """``bf16_linear`` of each (x, W) pair the kernels take, in one kernel call per path (the GEMV, the dot-product
    GEMM, the widening GEMM); None in the place of a pair they do not take (the caller runs that one its own way),
    and None for all when they take none or the kernels run emulated. ``outs``: contiguous fp32 tensors to write
    each pair's product into (the caller's slices of one buffer), else new ones."""
    calls = _kernels().calls
    paths = [_bf16_path(x, w) for x, w in zip(xs, ws)]
    if not hasattr(calls, "bf16_gemv_many_at") or not any(paths):
        return None
    xs = [x.contiguous() if path else x for x, path in zip(xs, paths)]
    outs = outs or [torch.empty(*x.shape[:-1], w.shape[0]) if path else None for x, w, path in zip(xs, ws, paths)]
    ys = [out if path else None for out, path in zip(outs, paths)]
    for path, run in (("gemv", calls.bf16_gemv_many_at), ("dot", getattr(calls, "bf16_dot_gemm_many_at", None)),
                      ("gemm", calls.bf16_gemm_many_at)):
        tasks = [(w.data_ptr(), x.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], *w.shape)
                 for x, w, y, p in zip(xs, ws, ys, paths) if p == path]
        if tasks:
            run(tasks, kernel_threads())
    return ys


def lut_linear_many(xs: list[torch.Tensor], linears: list[LutLinear]) -> list[torch.Tensor | None] | None:
    """Each packed linear on its activations in as few kernel calls as take them (q, k and v; gate and up; a decode
    step's experts): one-row activations in one LUT-GEMV call, a prompt's rows through :func:`lut_linear_rows_many`;
    bit for bit what calling each computes. None where it does not apply (a tracer, kernels run emulated), and None
    in the place of a linear the prompt's calls do not take (the caller runs that one)."""
    calls = _kernels().calls
    if not hasattr(calls, "lut_gemv_many_at") or not all(
            _eager(x) and x.dtype == torch.float32 and x.shape[-1] == lin.in_features for x, lin in zip(xs, linears)):
        return None
    if any(x.numel() != x.shape[-1] for x in xs):
        return _prompt_linears(xs, linears)
    xs = [x.contiguous() for x in xs]
    weights = [lin.tiled() for lin in linears]
    ys = [torch.empty(w.row_blocks * layout.ROWS) for w in weights]
    calls.lut_gemv_many_at([(w.native, x.data_ptr(), y.data_ptr()) for w, x, y in zip(weights, xs, ys)], 8,
                           kernel_threads())
    out = [y[: lin.out_features].reshape(*x.shape[:-1], lin.out_features) for x, y, lin in zip(xs, ys, linears)]
    return [y if lin.bias is None else y + lin.bias for y, lin in zip(out, linears)]


def _prompt_linears(xs: list[torch.Tensor], linears: list[LutLinear]) -> list[torch.Tensor | None] | None:
    rows = [x.reshape(-1, x.shape[-1]).contiguous() for x in xs]  # (views: linears reading one x share it)
    ys = lut_linear_rows_many(rows, linears, [torch.empty(r.shape[0], lin.out_features) for r, lin in zip(rows, linears)])
    return ys and [None if y is None else y.reshape(*x.shape[:-1], lin.out_features)
                   for x, y, lin in zip(xs, ys, linears)]


def lut_linear_rows_many(xs: list[torch.Tensor], linears: list[LutLinear],
                         outs: list[torch.Tensor]) -> list[torch.Tensor | None] | None:
    """Each packed linear on its rows of activations (a prompt's experts) into ``outs`` (contiguous fp32, the caller's
    slices of one buffer), one kernel call for all those the op would give the int8 GEMM and one for those it would
    give the LUT-GEMV (:func:`lut_product`), none with a bias or padded rows: bit for bit what calling each computes.
    None in the place of a pair they do not take (the caller runs that one), and None for all where they take none."""
    run = _kernels()
    if not hasattr(run.calls, "gemm_i8_many_at"):  # emulated kernels
        return None
    paths = [_rows_path(run, x, lin) for x, lin in zip(xs, linears)]
    for path in ("int8", "gemv"):
        tasks = [(lin.tiled().native, x.data_ptr(), out.data_ptr(), x.shape[0])
                 for x, lin, out, p in zip(xs, linears, outs, paths) if p == path]
        if not tasks:
            continue
        if path == "gemv":
            run.calls.gemv_rows_many_at(tasks, kernel_threads())
        elif not run.calls.gemm_i8_many_at(tasks, kernel_threads()):
            paths = [None if p == "int8" else p for p in paths]
    return [out if p else None for out, p in zip(outs, paths)] if any(paths) else None


def _rows_path(run: kernels.LutKernels, x: torch.Tensor, lin: LutLinear) -> str | None:
    """The batched call that takes these rows through this linear as :func:`lut_product` would: "int8", "gemv", or
    None (the dequantising GEMM's rows, a bias, padded outputs, a tracer, no rows)."""
    if not (x.shape[0] and _eager(x) and x.dtype == torch.float32 and x.is_contiguous() and lin.bias is None
            and lin.out_features % layout.ROWS == 0):
        return None
    path = product_path(x.shape[0], lin.bits, run)
    return None if path == "gemm" else path


def _bf16_path(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Which bf16 kernel takes x · Wᵀ: "dot" (the dot-product GEMM, from BF16_DOT_FROM rows where the CPU has
    it and K is a multiple of 32), else "gemm" (the widening GEMM, on SIMD builds from the rows this machine's
    crossover measured, ``crossovers.bf16_gemm``, :mod:`npumoe.luts.tuning`; K a multiple of 16), "gemv" (up to
    BF16_GEMV_MAX_ROWS[isa] rows), or None; fp32 activations, a C-contiguous bf16 W, outside any tracer."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not (rows and x.dtype == torch.float32 and w.dtype == torch.bfloat16 and w.is_contiguous()
            and w.shape[-1] == k and _eager(x)):
        return None
    if rows >= BF16_DOT_FROM and k % 32 == 0 and bf16_dot_available():
        return "dot"
    run = _kernels()
    isa, gemm_from = run.isa, run.crossovers.bf16_gemm
    if gemm_from is not None and rows >= gemm_from and k % 16 == 0:
        return "gemm"
    return "gemv" if rows <= BF16_GEMV_MAX_ROWS[isa] else None


@torch.library.custom_op("npumoe::lut_linear", mutates_args=())
def lut_linear(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
               group: int, out_features: int) -> torch.Tensor:
    """y = x Wᵀ with W in the tiled npumoe format (see :mod:`npumoe.luts.layout`)."""
    return _compute(x, _tiled(tiles, scales, zeros, bits, group, out_features, tiles.shape[1] * layout.TILE_K))


def _eager(x) -> bool:
    """A plain CPU tensor outside any tracer (export, compile, jit, fx all pass other types or set a flag)."""
    return type(x) is torch.Tensor and x.device.type == "cpu" and not (torch.compiler.is_compiling()
                                                                       or torch.jit.is_tracing())


@lut_linear.register_fake
def _(x, tiles, scales, zeros, bits, group, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


class LutLinear(torch.nn.Module):
    """A linear layer whose weight is stored packed; its buffers are the op's tensors (a tiled weight's own arrays,
    not copies: a mapped checkpoint's stay mapped)."""

    def __init__(self, weight: spec.Packed | layout.TiledWeight, bias: torch.Tensor | None = None):
        super().__init__()
        tiled = weight if isinstance(weight, layout.TiledWeight) else layout.to_tiles(weight)
        self.bits, self.group = tiled.bits, tiled.group
        self.out_features, self.in_features = tiled.shape
        self.register_buffer("tiles", torch.from_numpy(tiled.tiles))
        self.register_buffer("scales", torch.from_numpy(tiled.scales))
        self.register_buffer("zeros", None if tiled.zeros is None else torch.from_numpy(tiled.zeros))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())
        self._tiled_cache: tuple[tuple[int, ...], layout.TiledWeight] | None = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, bits: int, group: int, symmetric: bool = False) -> LutLinear:
        weight = linear.weight.detach().to(torch.float32).numpy()
        return cls(spec.quantize_pack(weight, bits, group, symmetric), linear.bias)

    def tiled(self) -> layout.TiledWeight:
        """The buffers as the kernels' weight, checked once and rebuilt only if a buffer moved.

        Building and checking it is a noticeable share of a small expert's decode GEMV (docs/performance.md,
        "Call overhead"), so it is kept.
        """
        key = tuple(0 if b is None else b.data_ptr() for b in (self.tiles, self.scales, self.zeros))
        if self._tiled_cache is None or self._tiled_cache[0] != key:
            weight = _tiled(self.tiles, self.scales, self.zeros, self.bits, self.group, self.out_features,
                            self.in_features)
            self._tiled_cache = key, weight
        return self._tiled_cache[1]

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [out, in], through the kernels' LUT dequantiser."""
        return torch.from_numpy(_kernels().dequantize(self.tiled(), kernel_threads()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # skips the dispatcher, a large share of a small expert's decode GEMV (docs/performance.md, "Call overhead")
        if _eager(x):
            y = _compute(x, self.tiled())
        else:
            y = torch.ops.npumoe.lut_linear(x, self.tiles, self.scales, self.zeros, self.bits, self.group,
                                            self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, group={self.group}"
