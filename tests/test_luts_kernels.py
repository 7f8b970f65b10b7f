"""Every compiled kernel against the numpy spec: tables, int32 accumulators and dequantised
weights bit for bit; outputs against fp64 and fp32 math. Each ISA this CPU runs is tested,
and NEON under qemu-user (cross-compiled) when the tools are installed."""

import numpy as np
import pytest

from npumoe.core.base.errors import BackendUnavailableError, InputError, WeightError
from npumoe.luts import emulated, kernels, layout, spec

ISAS = ("portable", "avx2", "avx512", "neon")

# (bits, symmetric, group, N, K, M): the smallest shapes, N around the 16-row tile, odd group counts
EDGE_CASES = [
    (1, False, 32, 1, 32, 1), (2, False, 64, 17, 128, 2), (2, True, 128, 16, 256, 9), (3, False, 32, 33, 96, 8),
    (3, True, 64, 15, 192, 3), (4, False, 64, 64, 512, 13), (4, True, 32, 100, 64, 1), (8, False, 128, 40, 384, 17),
    (8, True, 32, 31, 160, 6), (4, False, 128, 48, 1024, 4), (5, True, 32, 47, 288, 13), (5, False, 64, 16, 128, 2),
    (6, False, 64, 33, 192, 5), (6, True, 128, 16, 256, 2),
]


def random_cases(count, seed=1):
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        bits = int(rng.choice(spec.BITS))
        group = int(rng.choice(spec.GROUPS))
        cases.append((bits, bits > 1 and bool(rng.integers(2)), group, int(rng.integers(1, 80)),
                      group * int(rng.integers(1, 6)), int(rng.integers(1, 20))))
    return cases


CASES = EDGE_CASES + random_cases(6)


@pytest.fixture(scope="module", params=ISAS)
def lut(request):
    isa = request.param
    if isa in kernels.available():
        return kernels.kernels(isa)
    if isa == "neon":
        reason = emulated.missing("neon")
        if reason:
            pytest.skip(f"NEON under emulation: {reason}")
        return emulated.emulated_kernels("neon")
    pytest.skip(f"this CPU lacks {kernels.NEEDS[isa]} for the {isa} kernel")


def activations(rng, shape, group):
    """Gaussian activations with an all-zero group, an outlier, and exact rounding ties in one group."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., :group] = 0
    if shape[-1] > 2 * group:
        x[..., group + 1] *= 50
        tie_runs = np.array([63.5] * 4 + [0.25] * 4 + [0.75] * 4 + [1.25] * 4, np.float32)  # T·inv = 0.5, 1.5, 2.5
        x[..., 2 * group: 2 * group + 16] = tie_runs
    return x


def make(case):
    bits, symmetric, group, n, k, m = case
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    packed = spec.quantize_pack(rng.standard_normal((n, k)).astype(np.float32), bits, group, symmetric)
    return packed, layout.to_tiles(packed), activations(rng, (m, k), group)


@pytest.mark.parametrize("table_bits", spec.TABLE_BITS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_tables_and_accumulators_are_bit_exact(lut, case, table_bits):
    packed, tiled, x = make(case)
    group = packed.meta.group
    tq, t_scales, xq = lut.tables(x[0], group, table_bits)
    ref_tq, ref_scales = spec.quantize_tables(spec.build_tables(x[0]), group, table_bits)
    assert np.array_equal(tq, ref_tq) and np.array_equal(t_scales, ref_scales)
    assert np.array_equal(xq, spec.table_sums(ref_tq, group))
    y, acc = lut.gemv(tiled, x, table_bits, accumulators=True)
    for row in range(x.shape[0]):
        row_tq, _ = spec.quantize_tables(spec.build_tables(x[row]), group, table_bits)
        assert np.array_equal(acc[row], spec.lut_accumulate(packed.planes, row_tq, group))
        ref = spec.lut_gemv(packed, x[row], table_bits)
        assert np.allclose(y[row], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_accumulators_at_their_int16_bound_are_exact(lut, bits):
    """Every code at its maximum and every lookup at the table's extreme (+127): each tile's sums reach the bound
    the kernels' int16 partial sums are sized for (AVX2: a tile's planes up to 5 bits, and a whole group's tiles
    where they fit, avx2.c's INT16_GROUP), in groups of 1, 2 and 4 tiles, and still equal the spec's."""
    x = np.ones((1, 256), np.float32)  # a run's entry 15 is +4, the group's largest: +127 once quantised
    weights = np.ones((16, 256), np.float32)
    weights[:, ::64] = -1  # one code 0 a group of 64, every other code 2^bits - 1
    for group in (32, 64, 128):
        packed = spec.quantize_pack(weights, bits, group, False)
        tq, _ = spec.quantize_tables(spec.build_tables(x[0]), group, 8)
        assert tq.max() == 127
        _, acc = lut.gemv(layout.to_tiles(packed), x, 8, accumulators=True)
        assert np.array_equal(acc[0], spec.lut_accumulate(packed.planes, tq, group))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_totals_at_their_int16_bound_match_the_spec(lut, bits):
    """Every code 0 but one a group, the zero point 2^bits − 1 and every lookup +127 (x = −1): the row sums and the
    zero term z·(−2·Xq) both reach their largest magnitude with one sign, the bound AVX2 sizes its int16 group totals
    by (avx2.c's ZEROS_IN_INT16), in groups of 1, 2 and 4 tiles; the outputs still equal the spec's."""
    x = -np.ones(256, np.float32)
    weights = -np.ones((16, 256), np.float32)
    weights[:, ::64] = 0  # code 2^bits - 1 once a group of 64 (the zero point), every other code 0
    for group in (32, 64, 128):
        packed = spec.quantize_pack(weights, bits, group, False)
        assert (packed.zeros == 2**bits - 1).all()
        ref = spec.lut_gemv(packed, x, 8)
        assert np.allclose(lut.gemv(layout.to_tiles(packed), x, 8), ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("count", [2, 7])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_several_rows_in_one_call_equal_each_row_alone(lut, case, count):
    """Prefill's few rows go through the multi-row GEMV (each tile read once for a pass of the ISA's 2 or 4 rows,
    AVX2's depending on the bits and rows, a short last pass repeating its last row): every row gets what a one-row
    call gives it, bit for bit."""
    packed, tiled, _ = make(case)
    rows = activations(np.random.default_rng(len(str(case))), (count, packed.meta.shape[1]), packed.meta.group)
    together = lut.gemv(tiled, rows)
    assert np.array_equal(together, np.stack([lut.gemv(tiled, row) for row in rows]))


@pytest.mark.parametrize("case", [c for c in CASES if 3 <= c[0] <= 4], ids=str)
def test_int8_gemm_is_its_spec(lut, case):
    """3-4-bit weights × int8 activations (prefill on the AVX-512, AVX2 and NEON builds, NEON with ARMv8.2's dot
    products, which qemu's CPU has): spec.int8_gemv row by row, to the float rounding of the epilogue (including
    every-other-group zero inputs and exact .5 ties, which round to even); 11 rows take full and partial passes of
    each build's row count. Builds without byte dot products decline (None)."""
    packed, tiled, _ = make(case)
    x = activations(np.random.default_rng(3), (11, packed.meta.shape[1]), packed.meta.group)
    y = lut.gemm_int8(tiled, x)
    if lut.isa not in ("avx512", "avx2", "neon"):
        assert y is None
        return
    ref = np.stack([spec.int8_gemv(packed, row) for row in x])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_int8_gemm_declines_other_widths(lut):
    """2-bit weights stay on the LUT-GEMV: every build declines them (the emulated driver by its exit status)."""
    packed = spec.quantize_pack(np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32), 2, 32, False)
    assert lut.gemm_int8(layout.to_tiles(packed), np.ones((9, 64), np.float32)) is None


@pytest.mark.parametrize("case", CASES, ids=str)
def test_lut_dequantisation_is_bit_exact_and_gemm_matches_fp64(lut, case):
    packed, tiled, x = make(case)
    w = spec.dequantize(packed)
    assert np.array_equal(lut.dequantize(tiled), w)
    y = lut.gemm(tiled, x)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = x.shape[1] * 2.0**-23 * (np.abs(x).astype(np.float64) @ np.abs(w).T)  # any fp32 summation order
    assert y.shape == ref.shape and np.all(np.abs(y - ref) <= bound + 1e-30)


def test_mxfp4_codes_with_every_fp16_power_of_two_scale_are_exact(lut):
    """5-bit symmetric codes in [4, 28] (2·v + 16 for FP4 E2M1 values v) with scales 2^-24 (an fp16
    subnormal) to 2^15: the kernels' dequantisation and accumulators are the spec's, bit for bit."""
    rng = np.random.default_rng(5)
    n, k = 40, 64 * 32
    exponents = np.arange(-24, 16)
    codes = 16 + 2 * rng.choice([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6], (n, k))
    scales = np.ldexp(np.float32(1), rng.permutation(np.resize(exponents, n * k // 32)).reshape(n, -1))
    packed = spec.pack(codes.astype(np.uint8), scales.astype(np.float16), np.full((n, k // 32), 16, np.uint8),
                       5, 32, symmetric=True)
    assert np.array_equal(packed.scales.astype(np.float32), scales)  # every one exact in fp16
    tiled, x = layout.to_tiles(packed), activations(rng, (2, k), 32)
    assert np.array_equal(lut.dequantize(tiled), spec.dequantize(packed))
    _, acc = lut.gemv(tiled, x, accumulators=True)
    for row in range(x.shape[0]):
        tq, _ = spec.quantize_tables(spec.build_tables(x[row]), 32)
        assert np.array_equal(acc[row], spec.lut_accumulate(packed.planes, tq, 32))


def test_outputs_are_within_nmse_of_fp32_dequant_then_matmul(lut):
    rng = np.random.default_rng(7)
    for bits in (2, 4):
        packed = spec.quantize_pack(rng.standard_normal((256, 1024)).astype(np.float32), bits, 64)
        tiled, w = layout.to_tiles(packed), spec.dequantize(packed)
        x = rng.standard_normal((8, 1024)).astype(np.float32)
        ref = x @ w.T
        for y in (lut.gemv(tiled, x), lut.gemm(tiled, x), lut.gemm_int8(tiled, x)):
            if y is not None:  # (the int8 GEMM: AVX-512, AVX2 and NEON builds, 3-4 bits)
                assert np.mean((y - ref) ** 2) / np.mean(ref**2) <= 2e-4


def test_thread_counts_agree(lut):
    packed, tiled, x = make((4, False, 64, 200, 512, 1))
    _, one = lut.gemv(tiled, x, threads=1, accumulators=True)
    _, two = lut.gemv(tiled, x, threads=2, accumulators=True)
    assert np.array_equal(one, two)
    assert np.array_equal(lut.gemm(tiled, x, threads=1), lut.gemm(tiled, x, threads=2))


@pytest.mark.parametrize("table_bits", spec.TABLE_BITS)
def test_batched_gemv_equals_each_gemv_alone(lut, table_bits):
    """npumoe_lut_gemv_many (a decode step's matrices in one parallel job): every case's one-row result
    equals its own GEMV's bit for bit, with 1 and 2 threads."""
    if not hasattr(lut.calls, "lut_gemv_many_at"):
        pytest.skip(f"{lut.isa} runs emulated, through single calls only (lut_linear_many falls back to them)")
    made = [make(case) for case in CASES]
    for threads in (1, 2):
        outputs = [np.full(tiled.row_blocks * layout.ROWS, np.nan, np.float32) for _, tiled, _ in made]
        lut.calls.lut_gemv_many_at([(tiled.native, x[0].ctypes.data, y.ctypes.data)
                                    for (_, tiled, x), y in zip(made, outputs)], table_bits, threads)
        for (packed, tiled, x), y in zip(made, outputs):
            n = packed.meta.shape[0]
            assert np.array_equal(y[:n], lut.gemv(tiled, x[0], table_bits=table_bits, threads=threads)), packed.meta


def test_batched_row_products_equal_each_call_alone(lut):
    """npumoe_lut_gemv_rows_many and npumoe_lut_gemm_i8_many (a prompt's experts, a few rows each, in one parallel
    job): every case's rows equal its own multi-row GEMV's or int8 GEMM's bit for bit, with 1 and 2 threads, where
    two tasks read the same activations (an expert's gate and up) too; the int8 batch declines, running nothing,
    where the single call declines (other widths, no int8 GEMM in the build)."""
    if not hasattr(lut.calls, "gemv_rows_many_at"):
        pytest.skip(f"{lut.isa} runs emulated, through single calls only (lut_linear_rows_many falls back to them)")
    made = [make(case) for case in CASES]
    made.append((made[3][0], made[3][1], made[3][2]))  # the same weight on the same rows again
    int8 = [(packed, tiled, x) for packed, tiled, x in made if 3 <= packed.meta.bits <= 4]
    for threads in (1, 2):
        for batch, run, single in ((made, lut.calls.gemv_rows_many_at, lambda t, x: lut.gemv(t, x, threads=threads)),
                                   (int8, lut.calls.gemm_i8_many_at, lambda t, x: lut.gemm_int8(t, x, threads))):
            outputs = [np.full((x.shape[0], tiled.row_blocks * layout.ROWS), np.nan, np.float32)
                       for _, tiled, x in batch]
            ran = run([(tiled.native, x.ctypes.data, y.ctypes.data, x.shape[0])
                       for (_, tiled, x), y in zip(batch, outputs)], threads)
            for (packed, tiled, x), y in zip(batch, outputs):
                want = single(tiled, x)
                if ran is False:  # the int8 GEMM's batch where the build has none
                    assert want is None and np.isnan(y).all()
                else:
                    assert np.array_equal(y[:, :packed.meta.shape[0]], want), packed.meta
    two_bit = next((tiled, x) for packed, tiled, x in made if packed.meta.bits == 2)
    y = np.zeros((two_bit[1].shape[0], two_bit[0].row_blocks * layout.ROWS), np.float32)
    assert lut.calls.gemm_i8_many_at([(two_bit[0].native, two_bit[1].ctypes.data, y.ctypes.data,
                                       two_bit[1].shape[0])], 1) is False and not y.any()


def test_concurrent_callers_with_different_thread_counts_get_exact_results():
    from concurrent.futures import ThreadPoolExecutor

    lut = kernels.kernels()
    packed, tiled, x = make((4, False, 64, 300, 512, 1))
    tq, _ = spec.quantize_tables(spec.build_tables(x[0]), 64, 8)
    expected = spec.lut_accumulate(packed.planes, tq, 64)

    def call(threads):
        return lut.gemv(tiled, x, threads=threads, accumulators=True)[1][0]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, [1, 2, 3, 4] * 10))
    assert all(np.array_equal(acc, expected) for acc in results)


def _gemv_in_child(args):
    tiled, x = args
    return kernels.kernels().gemv(tiled, x, threads=2)


def test_a_forked_child_gets_its_own_thread_pool():
    import multiprocessing

    lut = kernels.kernels()
    _, tiled, x = make((2, False, 64, 100, 256, 1))
    expected = lut.gemv(tiled, x, threads=2)  # the parent's pool exists before the fork
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert np.array_equal(pool.apply_async(_gemv_in_child, ((tiled, x),)).get(timeout=60), expected)


def test_a_pickled_weight_points_the_kernels_at_its_own_arrays():
    import pickle

    lut = kernels.kernels()
    _, tiled, x = make((4, True, 32, 40, 128, 1))
    expected = lut.gemv(tiled, x)  # builds the original's native struct
    copy = pickle.loads(pickle.dumps(tiled))
    assert copy.native.tiles == copy.tiles.ctypes.data != tiled.native.tiles
    assert np.array_equal(lut.gemv(copy, x), expected)


def test_gemv_writes_into_a_given_output_and_refuses_one_that_does_not_fit():
    lut = kernels.kernels()
    _, tiled, x = make((2, False, 64, 40, 128, 3))  # 40 rows: 48 padded outputs per activation row
    out = np.full((3, 48), np.nan, np.float32)
    y = lut.gemv(tiled, x, out=out)
    assert np.shares_memory(y, out) and np.array_equal(y, lut.gemv(tiled, x)) and y.shape == (3, 40)
    with pytest.raises(InputError, match=r"writable C-contiguous float32 \[3, 48\] array, got float32\[3, 40\]"):
        lut.gemv(tiled, x, out=np.empty((3, 40), np.float32))
    out.flags.writeable = False
    with pytest.raises(InputError, match=r"got float32\[3, 48\] \(read-only\)"):
        lut.gemv(tiled, x, out=out)


def test_compiled_gemv_calls_match_the_ctypes_path_and_hand_back_what_does_not_fit(monkeypatch):
    import sysconfig
    from pathlib import Path

    from npumoe.luts import build

    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("this Python has no headers: the compiled call module is not built")
    fast = kernels.kernels()
    assert fast.calls._python_calls is not None
    monkeypatch.setattr(build, "python_calls", lambda: None)
    plain = kernels.LutKernels(fast.isa, kernels.NativeCalls(fast.calls.lib))
    for case in ((2, False, 64, 40, 128, 3), (4, True, 32, 48, 256, 1)):
        _, tiled, x = make(case)
        for rows in (x, x[0]):
            assert fast.calls.gemv_if_fits(tiled, rows, np.empty((*rows.shape[:-1], 48), np.float32), 8, 1)
            assert np.array_equal(fast.gemv(tiled, rows), plain.gemv(tiled, rows))
            assert np.array_equal(fast.gemv(tiled, rows, table_bits=16), plain.gemv(tiled, rows, table_bits=16))
    _, tiled, x = make((2, False, 64, 40, 128, 3))
    y = np.empty((3, 48), np.float32)
    for x_bad, y_bad, bits in ((x.astype(np.float64), y, 8), (x[:, :64], y, 8), (x, y[:2], 8), (x, y.T.copy().T, 8),
                               (x, y, 4), (x[0], y, 8), (x[:, ::2].repeat(2, 1), y[:, :40], 8)):
        assert not fast.calls.gemv_if_fits(tiled, x_bad, y_bad, bits, 1)
    assert np.array_equal(fast.gemv(tiled, x.astype(np.float64)), plain.gemv(tiled, x))  # converted by the checked path


def test_bad_activations_and_weights_are_refused():
    lut = kernels.kernels("portable")
    packed = spec.quantize_pack(np.ones((16, 128), np.float32), 4, 64)
    tiled = layout.to_tiles(packed)
    with pytest.raises(InputError, match=r"activations of shape \[64\] do not fit a weight with 128 inputs"):
        lut.gemv(tiled, np.ones(64, np.float32))
    with pytest.raises(InputError, match="table precision 4"):
        lut.gemv(tiled, np.ones(128, np.float32), table_bits=4)
    lying = layout.TiledWeight(4, 64, (16, 256), tiled.tiles, tiled.scales, tiled.zeros)
    with pytest.raises(WeightError, match="needs contiguous uint8"):
        lut.gemm(lying, np.ones((2, 256), np.float32))


def test_forcing_a_kernel_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: ("portable",))
    with pytest.raises(BackendUnavailableError, match="the avx512 LUT kernel needs AVX-512 .* use auto or one of "
                                                      "portable"):
        kernels.kernels("avx512")
    with pytest.raises(InputError, match="unknown LUT kernel 'sse9'"):
        kernels.kernels("sse9")
    monkeypatch.setenv("NPUMOE_LUT_KERNEL", "portable")
    assert kernels.kernels().isa == "portable"


def test_auto_moves_past_a_kernel_the_compiler_cannot_build(monkeypatch):
    real_load = kernels._load

    def load(isa):
        if isa != "portable":
            raise BackendUnavailableError(f"compiling the LUT kernels failed ({isa})")
        return real_load(isa)

    monkeypatch.setattr(kernels, "_load", load)
    monkeypatch.setattr(kernels, "_tuned", kernels._tuned.__wrapped__)  # not the calls built earlier
    monkeypatch.setattr(kernels, "available", lambda: ("avx2", "portable"))
    assert kernels.kernels().isa == "portable"
    with pytest.raises(BackendUnavailableError, match="compiling the LUT kernels failed"):
        kernels.kernels("avx2")


@pytest.mark.parametrize("product", ["bf16_gemv", "bf16_gemm"])
@pytest.mark.parametrize("n,k,m", [(1, 16, 1), (5, 16, 3), (37, 70, 2), (64, 512, 17), (130, 1040, 1),
                                   (13, 48, 70), (7, 32, 16), (11, 64, 27)])
def test_bf16_products_are_fp32_math_on_the_bf16_values(lut, product, n, k, m):
    """The GEMV (row counts around its 4-row block, K off the 16-input step) and the GEMM (weight rows around its
    6-row blocks and their pairs, activation rows around its 16-row blocks, 8-row last blocks and 64-row tiles; SIMD
    builds, K a multiple of 16): the widened bf16 weights times x, summed in fp32, against fp64 on the same values
    (bound: fp32 rounding over K terms)."""
    rng = np.random.default_rng(n * k + m)
    bits = (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w = (bits.astype(np.uint32) << 16).view(np.float32)  # the values those bf16 patterns hold
    x = rng.standard_normal((m, k)).astype(np.float32)
    if product == "bf16_gemm" and (lut.isa == "portable" or k % 16):
        with pytest.raises(InputError if k % 16 else BackendUnavailableError, match="multiples of 16|SIMD build"):
            lut.bf16_gemm(bits, x)
        return
    y = getattr(lut, product)(bits, x)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.all(np.abs(y - exact) <= k * 2**-23 * (np.abs(x) @ np.abs(w).T) + 1e-30)


@pytest.mark.parametrize("m", [2, 3, 5, 16])
def test_bf16_gemv_rows_together_equal_each_row_alone(lut, m):
    """Prefill's few rows share each widened weight (AVX2: 2-3 rows streamed together, AVX-512: pairs, 4-row blocks
    elsewhere); every output still sums the same products in the same order as a one-row call: bit for bit."""
    rng = np.random.default_rng(m)
    bits = (rng.standard_normal((37, 2000)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal((m, 2000)).astype(np.float32)
    assert np.array_equal(lut.bf16_gemv(bits, x), np.vstack([lut.bf16_gemv(bits, x[i:i + 1]) for i in range(m)]))


def test_bf16_gemv_refuses_what_is_not_a_bf16_matrix(lut):
    x = np.ones((1, 16), np.float32)
    for bad in (np.ones((4, 16), np.float32), np.ones((16, 4), np.uint16).T, np.ones(16, np.uint16)):
        with pytest.raises(InputError, match="bf16 weight"):
            lut.bf16_gemv(bad, x)
    with pytest.raises(InputError, match="do not fit"):
        lut.bf16_gemv(np.ones((4, 32), np.uint16), x)
