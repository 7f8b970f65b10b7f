"""The compiled LUT kernels behind one small class, the instruction set chosen at run time.

``kernels()`` picks the best kernel this CPU runs (AVX-512 → AVX2 → NEON → portable C);
``kernels("avx2")`` or ``NPUMOE_LUT_KERNEL=avx2`` forces one, and a CPU that lacks the
instructions gets a :class:`BackendUnavailableError` instead of a crash. The portable
kernel runs everywhere a C compiler does. :class:`LutKernels` validates and allocates;
the raw calls go to the library through ctypes (or, for tests of another architecture,
to an emulated executable: :mod:`npumoe.luts.emulated`).
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from npumoe.core.base.errors import BackendUnavailableError, InputError
from npumoe.luts import build, spec, tuning
from npumoe.luts.layout import ROWS, NativeWeight, TiledWeight

PREFERENCE = ("avx512", "avx2", "neon", "portable")
FEATURE_BITS = {"avx2": 1, "avx512": 2, "neon": 4}
NEEDS = {"avx2": "AVX2, FMA and F16C", "avx512": "AVX-512 F/BW/VL/DQ with VBMI and VNNI", "neon": "an AArch64 CPU"}

_P, _I, _W = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(NativeWeight)


class Bf16Task(ctypes.Structure):
    """One product of ``npumoe_bf16_gemv_many`` and the GEMMs': W [n, k] bf16, x [m, k] and y [m, n] fp32, by
    address."""

    _fields_ = [("w", _P), ("x", _P), ("y", _P), ("m", _I), ("n", _I), ("k", _I)]


class LutTask(ctypes.Structure):
    """One one-row GEMV of ``npumoe_lut_gemv_many``: a prepared weight, x [k] and y [row_blocks·16] fp32."""

    _fields_ = [("w", _W), ("x", _P), ("y", _P)]


class LutRowsTask(ctypes.Structure):
    """One product of ``npumoe_lut_gemm_i8_many`` or ``npumoe_lut_gemv_rows_many``: a prepared weight, x [m, k] and
    y [m, row_blocks·16] fp32."""

    _fields_ = [("w", _W), ("x", _P), ("y", _P), ("m", _I)]


class Matrix(ctypes.Structure):
    """One matrix of the fused decode calls: a prepared packed weight, or a bf16 or fp32 [n, k] one by address (the
    other fields NULL)."""

    _fields_ = [("lut", _W), ("bf16", _P), ("f32", _P), ("n", _I), ("k", _I)]


class Swiglu(ctypes.Structure):
    """One routed expert of ``npumoe_swiglu_experts``: down(silu(gate x) ⊙ up x)."""

    _fields_ = [("gate", Matrix), ("up", Matrix), ("down", Matrix)]


class LutStack(ctypes.Structure):
    """Every expert's packed matrix of one name, stacked (``npumoe_lut_swiglu_rows``): arrays by address, zeros 0
    for symmetric weights."""

    _fields_ = [("tiles", _P), ("scales", _P), ("zeros", _P), ("n", _I), ("k", _I), ("bits", _I), ("group", _I),
                ("experts", _I)]


class F32Stack(ctypes.Structure):
    """Every expert's fp32 matrix of one name, stacked [experts, n, k] (``npumoe_f32_swiglu_rows``), by address."""

    _fields_ = [("f32", _P), ("n", _I), ("k", _I), ("experts", _I)]


class MoE(ctypes.Structure):
    """One MoE layer for ``npumoe_moe_decode``: an fp32 router [experts, hidden] by address, every expert's record,
    and the softmax routing's parameters."""

    _fields_ = [("router", _P), ("experts", ctypes.POINTER(ctypes.POINTER(Swiglu))), ("num_experts", _I),
                ("hidden", _I), ("top_k", _I), ("normalize", _I), ("scaling", ctypes.c_float)]


class Attention(ctypes.Structure):
    """One decode token's attention block for ``npumoe_attention_decode`` (luts/csrc/decode.c): matrices as in
    :class:`Matrix`, fp32 vectors by address (NULL where absent)."""

    _fields_ = [("q", Matrix), ("k", Matrix), ("v", Matrix), ("o", Matrix),
                *((name, _P) for name in ("q_bias", "k_bias", "v_bias", "o_bias", "attn_norm", "ffn_norm", "q_norm",
                                          "k_norm")),
                *((name, ctypes.c_float) for name in ("norm_eps", "qk_norm_eps", "scale")),
                *((name, _I) for name in ("hidden", "heads", "kv_heads", "head_dim", "qk_norm_full", "interleaved"))]


class Layer(ctypes.Structure):
    """One layer of ``npumoe_decode_step``: its attention and MoE records, its caches and rope tables by address,
    and the positions both hold."""

    _fields_ = [("attention", ctypes.POINTER(Attention)), ("moe", ctypes.POINTER(MoE)), ("k_cache", _P),
                ("v_cache", _P), ("cos", _P), ("sin", _P), ("capacity", _I)]


class Model(ctypes.Structure):
    """A whole model for ``npumoe_decode_step``: its layers, embedding, final RMS norm and LM head."""

    _fields_ = [("layers", ctypes.POINTER(Layer)), ("count", _I), ("embedding", Matrix),
                ("embedding_scale", ctypes.c_float), ("norm", _P), ("norm_eps", ctypes.c_float), ("head", Matrix)]


_SIGNATURES = {
    "npumoe_lut_isa": ([], ctypes.c_char_p),
    "npumoe_cpu_features": ([], ctypes.c_uint),
    "npumoe_lut_tables": ([_P, _I, _I, _I, _P, _P, _P], None),
    "npumoe_lut_gemv": ([_W, _P, _I, _I, _P, _P, _I], ctypes.c_int),
    "npumoe_lut_dequant": ([_W, _P, _I], None),
    "npumoe_lut_gemm": ([_W, _P, _I, _P, _I], ctypes.c_int),
    "npumoe_lut_gemm_i8": ([_W, _P, _I, _P, _I], ctypes.c_int),
    "npumoe_lut_linear": ([_W, _P, _I, _I, _P, _I, _I, _I], ctypes.c_int),
    "npumoe_f32_linear_rows": ([_P, _I, _I, _P, _I, _P, _I], None),
    "npumoe_stream_read": ([_P, ctypes.c_size_t, _I, ctypes.c_size_t], ctypes.c_uint64),
    "npumoe_bf16_gemv": ([_P, _P, _I, _I, _I, _P, _I], ctypes.c_int),
    "npumoe_bf16_gemv_many": ([ctypes.POINTER(Bf16Task), _I, _I], ctypes.c_int),
    "npumoe_bf16_dot_available": ([], ctypes.c_int),
    "npumoe_bf16_amx_set": ([_I], ctypes.c_int),
    "npumoe_bf16_gemm": ([_P, _P, _I, _I, _I, _P, _I], ctypes.c_int),
    "npumoe_bf16_gemm_many": ([ctypes.POINTER(Bf16Task), _I, _I], ctypes.c_int),
    "npumoe_bf16_dot_gemm_many": ([ctypes.POINTER(Bf16Task), _I, _I], ctypes.c_int),
    "npumoe_lut_gemv_many": ([ctypes.POINTER(LutTask), _I, _I, _I], ctypes.c_int),
    "npumoe_lut_gemm_i8_many": ([ctypes.POINTER(LutRowsTask), _I, _I], ctypes.c_int),
    "npumoe_lut_gemv_rows_many": ([ctypes.POINTER(LutRowsTask), _I, _I], ctypes.c_int),
    "npumoe_lut_set_prefetch": ([_I], ctypes.c_int),
    "npumoe_swiglu_experts": ([ctypes.POINTER(ctypes.POINTER(Swiglu)), _P, _I, _P, _P, _I], ctypes.c_int),
    "npumoe_lut_swiglu_rows": ([ctypes.POINTER(LutStack)] * 3 + [_P, _P, _I, _I, _P, _P, _I], ctypes.c_int),
    "npumoe_f32_swiglu_rows": ([ctypes.POINTER(F32Stack)] * 3 + [_P, _P, _I, _I, _P, _P, _I], ctypes.c_int),
    "npumoe_route_softmax": ([_P, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P, _P, _I], None),
    "npumoe_moe_decode": ([ctypes.POINTER(MoE), _P, _P, _P, _P, _P, ctypes.POINTER(ctypes.c_double), _I], ctypes.c_int),
    "npumoe_decode_step": ([ctypes.POINTER(Model), ctypes.c_int64, _I, _P, _P, _P, ctypes.POINTER(ctypes.c_double),
                            _I], ctypes.c_int),
    "npumoe_attention_decode": ([ctypes.POINTER(Attention), _P, _P, _P, _I, _P, _P, _I, _P, _P, _I], ctypes.c_int),
    "npumoe_rms_norm_rows": ([_P, _P, _I, _I, ctypes.c_float, _P], None),
    "npumoe_rope_rows": ([_P, _P, _P, _I, _I, _I, _I], None),
}


@functools.cache
def _load(isa: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build.library(isa)))
    for name, (args, result) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


@functools.cache
def available() -> tuple[str, ...]:
    """Kernels this CPU runs, best first (always ending with ``portable``)."""
    features = _load("portable").npumoe_cpu_features()
    return tuple(isa for isa in PREFERENCE if isa == "portable" or features & FEATURE_BITS[isa])


@functools.cache
def default_threads() -> int:
    """The CPUs this process may run on, read once (a system call a decode step should not pay per GEMV)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def kernels(isa: str | None = None) -> LutKernels:
    """The kernels for ``isa`` (default: ``$NPUMOE_LUT_KERNEL`` or ``auto``, the best this CPU runs).

    ``auto`` moves on to the next kernel when a compiler cannot build one (an old gcc
    without AVX-512 VBMI, say); a forced kernel reports why it cannot be built.
    """
    isa = isa or os.environ.get("NPUMOE_LUT_KERNEL") or "auto"
    if isa == "auto":
        for candidate in available()[:-1]:
            try:
                return LutKernels(candidate, *_tuned(candidate))
            except BackendUnavailableError:
                continue
        isa = "portable"
    if isa not in PREFERENCE:
        raise InputError(f"unknown LUT kernel {isa!r}; choose auto or one of {', '.join(PREFERENCE)}.")
    if isa not in available():
        raise BackendUnavailableError(f"the {isa} LUT kernel needs {NEEDS[isa]}, which this CPU lacks; use auto "
                                      f"or one of {', '.join(available())}.")
    return LutKernels(isa, *_tuned(isa))


@functools.cache
def _tuned(isa: str) -> tuple[NativeCalls, tuning.Crossovers]:
    """The library's calls with its prefetch distance set for this machine, and its prompt paths' crossovers
    (:mod:`npumoe.luts.tuning`; the portable kernel, a fallback that prefetches nothing, keeps the defaults)."""
    calls = NativeCalls(_load(isa))
    if isa == "portable":
        return calls, tuning.DEFAULT_CROSSOVERS[isa]
    return calls, tuning.tune(isa, build.library(isa), calls, default_threads()).crossovers


_FLOAT32 = np.dtype(np.float32)


def _ptr(a: np.ndarray | None) -> int | None:
    """The array's data address; through ctypes' buffer view when it allows (cheaper than ``a.ctypes.data``:
    docs/performance.md, "Call overhead").

    The view needs a writable, non-empty, contiguous buffer; anything else takes numpy's slower road.
    """
    if a is None:
        return None
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


class NativeCalls:
    """The library's entry points, called in-process; each fills the output arrays it is given.

    A weight goes over as its :attr:`TiledWeight.native` struct (checked when first built).
    """

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._python_calls = build.python_calls()
        self._gemv_kernel = ctypes.cast(lib.npumoe_lut_gemv, ctypes.c_void_p).value

    def gemv_if_fits(self, w, x, y, table_bits, threads) -> bool:
        """The GEMV through the compiled call module, which checks x and y itself; False (nothing run)
        when the module is not built or they do not fit."""
        calls = self._python_calls
        return calls is not None and calls.gemv(self._gemv_kernel, w.native, x, y, table_bits, threads)

    def lut_gemv_many_at(self, tasks: list[tuple], table_bits: int, threads: int) -> None:
        """Several one-row LUT-GEMVs, each (weight.native, x address, y address), in one parallel job: a decode
        step's matrices streamed as one run, each result equal to its own :meth:`gemv`'s."""
        batch = (LutTask * len(tasks))(*((ctypes.pointer(w), x, y) for w, x, y in tasks))
        if self.lib.npumoe_lut_gemv_many(batch, len(tasks), table_bits, threads):
            raise MemoryError("the LUT-GEMV could not allocate its tables")

    def swiglu_rows_at(self, stacks: tuple[LutStack | F32Stack, ...], ids: int, weights: int, rows: int, k: int,
                       x: int, y: int, threads: int) -> None:
        """y [rows, hidden] = Σ_j weights[r, j] · expert_{ids[r, j]}(x[r]) over stacked gate, up and down matrices
        (packed: :class:`LutStack`, or fp32: :class:`F32Stack`), all by address: the ExecuTorch ops' body, the same
        code the native runner links."""
        fn = self.lib.npumoe_lut_swiglu_rows if isinstance(stacks[0], LutStack) else self.lib.npumoe_f32_swiglu_rows
        status = fn(*map(ctypes.byref, stacks), ids, weights, rows, k, x, y, threads)
        if status == -2:
            raise IndexError("an expert id is out of range of the stacked experts")
        if status:
            raise MemoryError("the fused experts could not allocate their scratch")

    def swiglu_experts_at(self, experts: list[Swiglu], weights: int, x: int, y: int, threads: int) -> None:
        """y [hidden] = Σ_e weights[e] · down_e(silu(gate_e x) ⊙ up_e x) for one token, all by address (fp32):
        a decode token's routed experts in one call, each GEMV equal to its own call's result."""
        batch = (ctypes.POINTER(Swiglu) * len(experts))(*map(ctypes.pointer, experts))
        if self.lib.npumoe_swiglu_experts(batch, weights, len(experts), x, y, threads):
            raise MemoryError("the fused experts could not allocate their scratch")

    def rms_norm_rows_at(self, x: int, w: int, rows: int, n: int, eps: float, out: int) -> None:
        """out [rows, n] = each row of x · rsqrt(mean(x²) + eps) · w, all by address (fp32)."""
        self.lib.npumoe_rms_norm_rows(x, w, rows, n, eps, out)

    def rope_rows_at(self, x: int, cos: int, sin: int, rows: int, heads: int, d: int, interleaved: bool) -> None:
        """x [rows, heads, d] rotated in place by cos and sin [rows, d], all by address (fp32)."""
        self.lib.npumoe_rope_rows(x, cos, sin, rows, heads, d, interleaved)

    def attention_decode_at(self, block: Attention, x: int, cos: int, sin: int, position: int, k_cache: int,
                            v_cache: int, capacity: int, h: int, z: int, threads: int) -> None:
        """One decode token's attention block, all by address (fp32): its key and value written to slot
        ``position`` of the caches [kv_heads, capacity, head_dim], h = x + attention and z = ffn_norm(h) filled."""
        if self.lib.npumoe_attention_decode(ctypes.byref(block), x, cos, sin, position, k_cache, v_cache, capacity, h,
                                            z, threads):
            raise MemoryError("the fused attention could not allocate its scratch")

    def decode_step_at(self, model: Model, token: int, position: int, logits: int, top_i: int, top_w: int,
                       threads: int) -> float:
        """One decode token through the whole ``model``: its logits [vocab] (fp32, by address), each layer's routing
        into top_i / top_w [layer, k]; returns the routings' seconds."""
        routing = ctypes.c_double()
        if self.lib.npumoe_decode_step(ctypes.byref(model), token, position, logits, top_i, top_w,
                                       ctypes.byref(routing), threads):
            raise MemoryError("the decode step could not allocate its scratch")
        return routing.value

    def moe_decode_at(self, layer: MoE, z: int, y: int, logits: int, top_i: int, top_w: int, threads: int) -> float:
        """A decode token's MoE layer, all by address: softmax routing into logits / top_i (int64) / top_w, then the
        top-k experts' weighted sum into y; returns the routing's seconds (host work, apart from the experts')."""
        routing = ctypes.c_double()
        if self.lib.npumoe_moe_decode(ctypes.byref(layer), z, y, logits, top_i, top_w, ctypes.byref(routing), threads):
            raise MemoryError("the fused experts could not allocate their scratch")
        return routing.value

    def route_softmax_at(self, z: int, w: int, experts: int, hidden: int, k: int, normalize: bool, scaling: float,
                         logits: int, top_i: int, top_w: int, threads: int) -> None:
        """One token's softmax routing, all by address: logits [experts] = W z (fp32), the top k experts (int64)
        and their probabilities, renormalised if ``normalize``, times ``scaling``."""
        self.lib.npumoe_route_softmax(z, w, experts, hidden, k, normalize, scaling, logits, top_i, top_w, threads)

    def tables(self, x, group, table_bits, tq, t_scales, xq):
        self.lib.npumoe_lut_tables(_ptr(x), x.shape[0], group, table_bits, _ptr(tq), _ptr(t_scales), _ptr(xq))

    def gemv(self, w, x, rows, table_bits, y, acc, threads):
        if self.lib.npumoe_lut_gemv(w.native, _ptr(x), rows, table_bits, _ptr(y), _ptr(acc), threads):
            raise MemoryError("the LUT-GEMV could not allocate its tables")

    def dequantize(self, w, out, threads):
        self.lib.npumoe_lut_dequant(w.native, _ptr(out), threads)

    def gemm(self, w, x, y, threads):
        if self.lib.npumoe_lut_gemm(w.native, _ptr(x), x.shape[0], _ptr(y), threads):
            raise MemoryError("the LUT GEMM could not allocate its transposed activations")

    def gemm_i8(self, w, x, y, threads) -> bool:
        """The int8-activation GEMM into y; False (nothing run) where this build has none or W is not 3-4 bits."""
        status = self.lib.npumoe_lut_gemm_i8(w.native, _ptr(x), x.shape[0], _ptr(y), threads)
        if status == -1:
            raise MemoryError("the int8 GEMM could not allocate its quantised activations")
        return status == 0

    def lut_linear_at(self, w, x: int, rows: int, valid: int, y: int, int8_from: int, dequant_from: int,
                      threads: int) -> None:
        """y [rows, row_blocks·16] = x [rows, k] · Wᵀ by address for the first ``valid`` rows (the others zero), by
        the path chosen in C for all ``rows`` from the crossovers given (0: never): what ``npumoe::lut_linear_rows``
        runs, eagerly and in the native runner."""
        if self.lib.npumoe_lut_linear(w.native, x, rows, valid, y, int8_from, dequant_from, threads):
            raise MemoryError("the packed linear could not allocate its scratch")

    def f32_linear_at(self, w: int, n: int, k: int, x: int, rows: int, y: int, threads: int) -> None:
        """y [rows, n] = x [rows, k] · Wᵀ by address for W [n, k] fp32, each row the decode path's GEMV: what
        ``npumoe::f32_linear_rows`` runs, eagerly and in the native runner."""
        self.lib.npumoe_f32_linear_rows(w, n, k, x, rows, y, threads)

    def gemm_i8_many_at(self, tasks: list[tuple], threads: int) -> bool:
        """Several int8 GEMMs, each (weight.native, x address, y address, rows), in one parallel job: a prompt's
        experts sharing the threads, each result equal to its own :meth:`gemm_i8`'s. False (nothing run) where
        this build has no int8 GEMM or a weight is not 3-4 bits."""
        status = self.lib.npumoe_lut_gemm_i8_many(_rows_tasks(tasks), len(tasks), threads)
        if status == -1:
            raise MemoryError("the int8 GEMM could not allocate its quantised activations")
        return status == 0

    def gemv_rows_many_at(self, tasks: list[tuple], threads: int) -> None:
        """Several LUT-GEMVs of a few rows each (8-bit tables), tasks as in :meth:`gemm_i8_many_at`, in one parallel
        job, each result equal to its own :meth:`gemv`'s."""
        if self.lib.npumoe_lut_gemv_rows_many(_rows_tasks(tasks), len(tasks), threads):
            raise MemoryError("the LUT-GEMV could not allocate its tables")

    def set_prefetch(self, far_bytes: int) -> int:
        """Bytes ahead the GEMV prefetches into L2 from now on; returns the distance set (whole cache lines)."""
        return self.lib.npumoe_lut_set_prefetch(far_bytes)

    def stream_read(self, buf, threads, prefetch) -> int:
        return self.lib.npumoe_stream_read(_ptr(buf), buf.nbytes, threads, prefetch)

    def bf16_gemv(self, w, x, y, threads):
        self.bf16_gemv_at(_ptr(w), _ptr(x), x.shape[0], *w.shape, _ptr(y), threads)

    def bf16_gemv_at(self, w: int, x: int, m: int, n: int, k: int, y: int, threads: int) -> None:
        """The bf16 GEMV on raw addresses (W [n, k] bf16, x [m, k] and y [m, n] fp32, all C-contiguous),
        for a caller holding tensors: no array conversion on a decode step's hot path."""
        if self.lib.npumoe_bf16_gemv(w, x, m, n, k, y, threads):
            raise MemoryError("the bf16 GEMV could not allocate its split activations")

    def bf16_gemv_many_at(self, tasks: list[tuple[int, int, int, int, int, int]], threads: int) -> None:
        """Several bf16 GEMVs, each (w, x, y, m, n, k) as in :meth:`bf16_gemv_at`, in one parallel job: the
        threads stream all the matrices as one run (a decode step's experts are 4 MB each, and a call on
        its own pays its start-up and the stream's ramp for every one of them)."""
        batch = (Bf16Task * len(tasks))(*tasks)
        if self.lib.npumoe_bf16_gemv_many(batch, len(tasks), threads):
            raise MemoryError("the bf16 GEMV could not allocate its split activations")

    def bf16_gemm(self, w, x, y, threads):
        self.bf16_gemm_at(_ptr(w), _ptr(x), x.shape[0], *w.shape, _ptr(y), threads)

    def bf16_gemm_at(self, w: int, x: int, m: int, n: int, k: int, y: int, threads: int) -> None:
        """The bf16 GEMM (exact fp32 on the widened weights; SIMD builds, K a multiple of 16) on raw addresses, as
        :meth:`bf16_gemv_at`."""
        self._gemm_status(self.lib.npumoe_bf16_gemm(w, x, m, n, k, y, threads))

    def bf16_gemm_many_at(self, tasks: list[tuple[int, int, int, int, int, int]], threads: int) -> None:
        """Several bf16 GEMMs, tasks as in :meth:`bf16_gemv_many_at`, in one parallel job (a prompt's experts, and
        one transposed x for the tasks that share it)."""
        self._gemm_status(self.lib.npumoe_bf16_gemm_many((Bf16Task * len(tasks))(*tasks), len(tasks), threads))

    @staticmethod
    def _gemm_status(status: int) -> None:
        if status == -2:
            raise BackendUnavailableError("the bf16 GEMM needs a SIMD build of the kernels (this one is portable C).")
        if status:
            raise MemoryError("the bf16 GEMM could not allocate its transposed activations")

    @functools.cached_property
    def bf16_dot(self) -> bool:
        """Does this CPU run :meth:`bf16_dot_gemm_many_at` (x86-64 with AVX-512 BF16)?"""
        return bool(self.lib.npumoe_bf16_dot_available())

    def bf16_amx_set(self, use: bool) -> bool:
        """Whether :meth:`bf16_dot_gemm_many_at` runs on AMX tiles where the CPU has them (the default) or on AVX-512
        BF16 alone; returns whether it will use the tiles."""
        return bool(self.lib.npumoe_bf16_amx_set(int(use)))

    def bf16_dot_gemm_many_at(self, tasks: list[tuple[int, int, int, int, int, int]], threads: int) -> None:
        """Several bf16 GEMMs on bf16-rounded activations (spec.bf16_dot_gemm), tasks as in
        :meth:`bf16_gemv_many_at` with K a multiple of 32, in one parallel job; only where :attr:`bf16_dot`."""
        batch = (Bf16Task * len(tasks))(*tasks)
        status = self.lib.npumoe_bf16_dot_gemm_many(batch, len(tasks), threads)
        if status == -2:
            raise BackendUnavailableError("the bf16 dot-product GEMM needs an x86-64 CPU with AVX-512 BF16.")
        if status:
            raise MemoryError("the bf16 dot-product GEMM could not allocate its rounded activations")


def _rows_tasks(tasks: list[tuple]):
    return (LutRowsTask * len(tasks))(*((ctypes.pointer(w), x, y, m) for w, x, y, m in tasks))


def _check_bf16_weight(w: np.ndarray) -> None:
    if w.dtype.itemsize != 2 or w.dtype.kind not in "iu" or w.ndim != 2 or not w.flags.c_contiguous:
        raise InputError(f"a bf16 weight goes in as a C-contiguous 2-D 16-bit integer array, got {w.dtype} "
                         f"{list(w.shape)}.")


def _activations(x, k: int) -> np.ndarray:
    """x as a C-contiguous float32 [K] or [M, K], copied only if it is not one (checked by identity first:
    numpy's conversion machinery is the costliest part of a decode call's Python)."""
    if not (type(x) is np.ndarray and x.dtype is _FLOAT32 and x.flags.c_contiguous):
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim not in (1, 2) or x.shape[-1] != k:
        raise InputError(f"activations of shape {list(x.shape)} do not fit a weight with {k} inputs; pass [K] or "
                         "[M, K].")
    return x


def _output(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """``out`` when the kernels can write their float32 ``shape`` result into it, else a new array."""
    if out is None:
        return np.empty(shape, np.float32)
    flags = out.flags
    if out.shape != shape or out.dtype is not _FLOAT32 or not (flags.c_contiguous and flags.writeable):
        raise InputError(f"out must be a writable C-contiguous float32 {list(shape)} array, got {out.dtype}"
                         f"{list(out.shape)}{'' if flags.writeable else ' (read-only)'}.")
    return out


def _check_table_bits(table_bits: int) -> None:
    if table_bits not in spec.TABLE_BITS:
        raise InputError(f"table precision {table_bits} is not supported; use 8 or 16 bits.")


class LutKernels:
    """LUT-GEMV (decode), LUT-dequant GEMM (prefill) and their building blocks for one ISA."""

    def __init__(self, isa: str, calls, crossovers: tuning.Crossovers | None = None):
        self.isa = isa
        self.calls = calls
        self.crossovers = crossovers or tuning.DEFAULT_CROSSOVERS[isa]  # where a prompt leaves the LUT-GEMV

    def __repr__(self) -> str:
        return f"LutKernels({self.isa!r})"

    def tables(self, x: np.ndarray, group: int, table_bits: int = 8):
        """(Tq [K/4, 16], t_scales [G], Xq [G]) exactly as spec.quantize_tables / table_sums define them."""
        x = _activations(x, np.shape(x)[-1])
        spec.check_group(group, x.shape[0])
        _check_table_bits(table_bits)
        tq = np.empty((x.shape[0] // 4, 16), spec.TABLE_DTYPE[table_bits])
        t_scales = np.empty(x.shape[0] // group, np.float32)
        xq = np.empty(x.shape[0] // group, np.int32)
        self.calls.tables(x, group, table_bits, tq, t_scales, xq)
        return tq, t_scales, xq

    def gemv(self, w: TiledWeight, x: np.ndarray, table_bits: int = 8, threads: int | None = None,
             accumulators: bool = False, out: np.ndarray | None = None):
        """y = x Wᵀ row by row through LUTs; with ``accumulators`` also the int32 A [..., N, G].

        ``out`` (float32 [..., ceil(N/16)·16], C-contiguous) receives y instead of a new array, as a
        decode step's static buffers would. Kept to a few operations: a decode step makes this call
        per expert matrix, when the Python state it touches has been evicted by the weights
        streamed since, and every object it creates or looks up is then a trip to memory.
        """
        n, k = w.shape
        padded = w.row_blocks * ROWS
        if type(x) is np.ndarray and not accumulators:  # the decode call, checked in compiled code when it can be
            y = np.empty((*x.shape[:-1], padded), np.float32) if out is None else out
            if self.calls.gemv_if_fits(w, x, y, table_bits, threads or default_threads()):
                return y if padded == n else y[..., :n]
        x = _activations(x, k)
        _check_table_bits(table_bits)
        y = _output(out, (*x.shape[:-1], padded))
        acc = np.empty((*x.shape[:-1], padded, w.groups), np.int32) if accumulators else None
        self.calls.gemv(w, x, x.size // k, table_bits, y, acc, threads or default_threads())
        if padded != n:
            y, acc = y[..., :n], None if acc is None else acc[..., :n, :]
        return (y, acc) if accumulators else y

    def gemm(self, w: TiledWeight, x: np.ndarray, threads: int | None = None) -> np.ndarray:
        """y [M, N] = x [M, K] Wᵀ, dequantising W tile by tile (prefill)."""
        n, k = w.shape
        x = _activations(x, k).reshape(-1, k)
        y = np.empty((x.shape[0], w.row_blocks * ROWS), np.float32)
        self.calls.gemm(w, x, y, threads or default_threads())
        return y[:, :n]

    def gemm_int8(self, w: TiledWeight, x: np.ndarray, threads: int | None = None) -> np.ndarray | None:
        """y [M, N] = x [M, K] Wᵀ with x quantised to int8 per group (:func:`spec.int8_gemv` per row): 3-4-bit
        weights on a build with byte dot products (AVX-512 VNNI, AVX2, NEON where the CPU has ARMv8.2's sdot); None
        elsewhere."""
        n, k = w.shape
        x = _activations(x, k).reshape(-1, k)
        y = np.empty((x.shape[0], w.row_blocks * ROWS), np.float32)
        if not hasattr(self.calls, "gemm_i8") or not self.calls.gemm_i8(w, x, y, threads or default_threads()):
            return None
        return y[:, :n]

    def dequantize(self, w: TiledWeight, threads: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """W [N, K] fp32 through the two-level LUT, bit-identical to spec.dequantize.

        ``out`` (float32 [ceil(N/16)·16, K], C-contiguous) is filled instead of a new array.
        """
        n, k = w.shape
        out = _output(out, (w.row_blocks * ROWS, k))
        self.calls.dequantize(w, out, threads or default_threads())
        return out[:n]

    def bf16_gemv(self, w: np.ndarray, x: np.ndarray, threads: int | None = None,
                  out: np.ndarray | None = None) -> np.ndarray:
        """y [M, N] = x [M, K] Wᵀ in fp32 for W [N, K] stored as bf16: ``w`` holds its bit patterns as a
        C-contiguous 16-bit integer array (numpy has no bf16; a torch tensor's ``.view(torch.int16)``).
        Each weight row is read once for all M rows of x."""
        _check_bf16_weight(w)
        n, k = w.shape
        x = _activations(x, k).reshape(-1, k)
        y = _output(out, (x.shape[0], n))
        self.calls.bf16_gemv(w, x, y, threads or default_threads())
        return y

    def bf16_gemm(self, w: np.ndarray, x: np.ndarray, threads: int | None = None) -> np.ndarray:
        """y [M, N] = x [M, K] Wᵀ in exact fp32 arithmetic on the widened weights (torch's F.linear on W.float(),
        to summation order), W as for :meth:`bf16_gemv`, K a multiple of 16: a bf16 prompt's GEMM where the CPU
        has no bf16 dot products."""
        return self._bf16_product(w, x, 16, "bf16 GEMM", self.calls.bf16_gemm, threads)

    def bf16_dot_gemm(self, w: np.ndarray, x: np.ndarray, threads: int | None = None) -> np.ndarray:
        """y [M, N] = bf16(x) [M, K] Wᵀ in fp32 through AVX-512 BF16 dot products (spec.bf16_dot_gemm), W as
        for :meth:`bf16_gemv` and K a multiple of 32."""
        def run(w, x, y, threads):
            self.calls.bf16_dot_gemm_many_at([(_ptr(w), _ptr(x), _ptr(y), x.shape[0], *w.shape)], threads)

        return self._bf16_product(w, x, 32, "bf16 dot-product GEMM", run, threads)

    @staticmethod
    def _bf16_product(w: np.ndarray, x: np.ndarray, k_step: int, what: str, run, threads: int | None) -> np.ndarray:
        """W and K (a multiple of ``k_step``) checked, then y [M, N] filled by ``run(w, x, y, threads)``."""
        _check_bf16_weight(w)
        n, k = w.shape
        if k % k_step:
            raise InputError(f"the {what} takes K in multiples of {k_step}, got {k}.")
        x = _activations(x, k).reshape(-1, k)
        y = np.empty((x.shape[0], n), np.float32)
        run(w, x, y, threads or default_threads())
        return y

    def stream_read(self, buf: np.ndarray, threads: int | None = None, prefetch: int = 0) -> int:
        """Read ``buf`` once (the bandwidth probe), each line prefetched into L2 ``prefetch`` bytes ahead
        (0: hardware prefetchers only); returns a checksum so the read is not optimised away."""
        return self.calls.stream_read(buf, threads or default_threads(), prefetch)
