"""The prefetch distance and prompt-path crossovers measured at first use (npumoe.luts.tuning): the distance changes
no result, the sweep's fastest distance is the one set, the crossovers follow the timings and steer the op's path,
all cached per build and CPU, measured again when the CPU or the cache changes, and set by hand through
NPUMOE_LUT_PREFETCH and NPUMOE_LUT_CROSSOVERS."""

import json

import numpy as np
import pytest

from npumoe.core.base.errors import InputError
from npumoe.luts import kernels, layout, spec, tuning

PREFETCHING = [isa for isa in kernels.available() if isa != "portable"]


@pytest.fixture
def small_sweep(monkeypatch, tmp_path):
    """A sweep of 8 MB (the code path, not a measurement worth keeping), cached in tmp_path."""
    monkeypatch.setattr(tuning, "MIN_SWEEP_BYTES", 8 << 20)
    monkeypatch.setattr(tuning, "MAX_SWEEP_BYTES", 8 << 20)
    monkeypatch.delenv("NPUMOE_LUT_PREFETCH", raising=False)
    monkeypatch.delenv("NPUMOE_LUT_CROSSOVERS", raising=False)
    monkeypatch.setattr(tuning, "others_cpu_share_now", lambda: None)  # as if busy: a cached choice is kept
    return tmp_path / "lut-avx2-0123456789abcdef.so"


@pytest.mark.parametrize("isa", PREFETCHING)
def test_every_distance_gives_the_same_bits(isa):
    """Prefetches are hints: the GEMV's output is the same to the bit at every distance of the grid and the
    clamped extremes (and the spec's to float rounding)."""
    lut = kernels.kernels(isa)
    rng = np.random.default_rng(3)
    packed = spec.quantize_pack(rng.standard_normal((200, 1024)).astype(np.float32), 4, 64)
    tiled = layout.to_tiles(packed)
    x = rng.standard_normal(1024).astype(np.float32)
    first = lut.gemv(tiled, x[None])[0]
    np.testing.assert_allclose(first, spec.lut_gemv(packed, x, 8), rtol=1e-5, atol=1e-5 * np.abs(first).max())
    try:
        for distance in (*tuning.GRID, 64, 1 << 20):
            assert lut.calls.set_prefetch(distance) == max(128, distance // 64 * 64)
            np.testing.assert_array_equal(lut.gemv(tiled, x[None])[0], first)
    finally:
        lut.calls.set_prefetch(int(tuning.os.environ.get("NPUMOE_LUT_PREFETCH", "12288")))


@pytest.mark.skipif(not PREFETCHING, reason="this CPU runs only the portable kernel, which prefetches nothing")
def test_the_fastest_distance_is_set_cached_and_measured_again_for_another_cpu(small_sweep, monkeypatch):
    calls = kernels.kernels(PREFETCHING[0]).calls
    chosen = tuning.tune("avx2", small_sweep, calls, threads=1)
    assert chosen.source == "measured" and set(chosen.ms_by_distance) == {str(d) for d in tuning.GRID}
    assert chosen.ms_by_distance[str(chosen.prefetch)] == min(chosen.ms_by_distance.values())
    assert calls.set_prefetch(chosen.prefetch) == chosen.prefetch
    cached = list(small_sweep.parent.glob("tuning-avx2-*-1t-0123456789abcdef.json"))
    assert len(cached) == 1

    monkeypatch.setattr(tuning, "measure", lambda *a: pytest.fail("measured although cached"))
    again = tuning.tune("avx2", small_sweep, calls, threads=1)
    assert (again.source, again.prefetch) == ("cached", chosen.prefetch)

    monkeypatch.undo()
    monkeypatch.setattr(tuning, "MIN_SWEEP_BYTES", 8 << 20)
    monkeypatch.setattr(tuning, "MAX_SWEEP_BYTES", 8 << 20)
    monkeypatch.delenv("NPUMOE_LUT_PREFETCH", raising=False)
    monkeypatch.delenv("NPUMOE_LUT_CROSSOVERS", raising=False)
    monkeypatch.setattr(tuning, "cpu_key", lambda: "another-cpu")
    assert tuning.tune("avx2", small_sweep, calls, threads=1).source == "measured"
    assert len(list(small_sweep.parent.glob("tuning-avx2-*.json"))) == 2


@pytest.mark.skipif(not PREFETCHING, reason="this CPU runs only the portable kernel, which prefetches nothing")
def test_a_damaged_cache_entry_is_measured_again(small_sweep):
    calls = kernels.kernels(PREFETCHING[0]).calls
    tuning.tune("avx2", small_sweep, calls, threads=1)
    (entry,) = small_sweep.parent.glob("tuning-avx2-*.json")
    for damage in ("{", '{"prefetch": 999, "ms_by_distance": {}, "seconds": 0}', "",
                   '{"prefetch": 4096, "ms_by_distance": {}, "seconds": 0}',  # from before the crossovers
                   '{"prefetch": 4096, "crossovers": {"int8": -1, "dequant": null, "bf16_gemm": 16}, '
                   '"ms_by_distance": {}, "ms_by_rows": {}, "seconds": 0}',
                   '{"prefetch": 4096, "crossovers": {"int8": 8, "dequant": null}, "ms_by_distance": {}, '
                   '"ms_by_rows": {}, "seconds": 0}'):  # from before the bf16 GEMM's crossover
        entry.write_text(damage)
        assert tuning.tune("avx2", small_sweep, calls, threads=1).source == "measured"


@pytest.mark.skipif(not PREFETCHING, reason="this CPU runs only the portable kernel, which prefetches nothing")
def test_the_environment_sets_the_choices_without_measuring(small_sweep, monkeypatch):
    calls = kernels.kernels(PREFETCHING[0]).calls
    monkeypatch.setattr(tuning, "measure", lambda *a: pytest.fail("measured although set by hand"))
    monkeypatch.setenv("NPUMOE_LUT_PREFETCH", "20000")
    monkeypatch.setenv("NPUMOE_LUT_CROSSOVERS", "16,never")
    chosen = tuning.tune("avx2", small_sweep, calls, threads=1)
    assert (chosen.source, chosen.prefetch) == ("environment", 20000)
    assert chosen.crossovers == tuning.Crossovers(16, None, 16)  # (the bf16 GEMM's default: not given)
    monkeypatch.setenv("NPUMOE_LUT_CROSSOVERS", "16,never,24")  # the bf16 GEMM's too
    assert tuning.tune("avx2", small_sweep, calls, threads=1).crossovers == tuning.Crossovers(16, None, 24)
    monkeypatch.setenv("NPUMOE_LUT_CROSSOVERS", "defaults")
    assert tuning.tune("avx2", small_sweep, calls, threads=1).crossovers == tuning.DEFAULT_CROSSOVERS["avx2"]
    assert not list(small_sweep.parent.glob("tuning-*.json"))
    for name, bad in [("NPUMOE_LUT_PREFETCH", "far"), ("NPUMOE_LUT_PREFETCH", "64"), ("NPUMOE_LUT_PREFETCH", "-1"),
                      ("NPUMOE_LUT_CROSSOVERS", "8"), ("NPUMOE_LUT_CROSSOVERS", "0,64"),
                      ("NPUMOE_LUT_CROSSOVERS", "8,sometimes"), ("NPUMOE_LUT_CROSSOVERS", "8,64,16,4")]:
        with monkeypatch.context() as m:
            m.setenv(name, bad)
            with pytest.raises(InputError, match=name):
                tuning.tune("avx2", small_sweep, calls, threads=1)
    calls.set_prefetch(12288)


@pytest.mark.skipif(not PREFETCHING, reason="this CPU runs only the portable kernel, whose crossovers are the defaults")
def test_the_crossovers_are_where_the_measured_times_cross(small_sweep):
    """Each crossover is the least row count of the grid from which the challenger's time stays below the LUT-GEMV's
    in the measurement's own table (int2 × 2 for rows × bits), or None where it never does."""
    chosen = tuning.tune("avx2", small_sweep, kernels.kernels(PREFETCHING[0]).calls, threads=1)
    times = {name: {int(r): ms for r, ms in by_rows.items()} for name, by_rows in chosen.ms_by_rows.items()}
    assert set(times["lut-gemv int4"]) == set(tuning.ROW_GRID)
    dequant = tuning.first_win(times["lut-gemv int2"], times["dequant gemm int2"])
    assert chosen.crossovers.dequant == (None if dequant is None else 2 * dequant)
    if "int8 gemm int4" in times:  # builds with byte dot products
        assert chosen.crossovers.int8 == tuning.first_win(times["lut-gemv int4"], times["int8 gemm int4"])
    if "bf16 gemv" in times:  # CPUs without bf16 dot products
        past_gemv = tuning.BF16_GEMV_MAX_ROWS["avx2"] + 1  # the bf16 GEMM from where it wins, past the GEMV's anyway
        bf16 = tuning.first_win(times["bf16 gemv"], times["bf16 gemm"])
        assert chosen.crossovers.bf16_gemm == min(bf16 or past_gemv, past_gemv)
    else:  # the dot-product GEMM takes bf16 prompts: the widening GEMM's start is not timed
        assert kernels.kernels(PREFETCHING[0]).calls.bf16_dot
        assert chosen.crossovers.bf16_gemm == tuning.DEFAULT_CROSSOVERS["avx2"].bf16_gemm


@pytest.mark.skipif(not PREFETCHING, reason="this CPU runs only the portable kernel, which prefetches nothing")
def test_a_choice_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(small_sweep, monkeypatch):
    """Each measurement records the share of the CPU others used meanwhile (from the machine's own counters); a cached
    choice taken under load, or from before the share was recorded, is re-measured by the first process that finds
    the machine quiet, and kept while it stays busy."""
    calls = kernels.kernels(PREFETCHING[0]).calls
    chosen = tuning.tune("avx2", small_sweep, calls, threads=1)
    assert chosen.others_cpu is None or 0 <= chosen.others_cpu <= 1
    (entry,) = small_sweep.parent.glob("tuning-avx2-*.json")
    loaded = json.loads(entry.read_text()) | {"prefetch": 4096, "others_cpu": 0.6}
    entry.write_text(json.dumps(loaded))

    monkeypatch.setattr(tuning, "others_cpu_share_now", lambda: 0.9)
    monkeypatch.setattr(tuning, "measure", lambda *a: pytest.fail("measured on a busy machine"))
    kept = tuning.tune("avx2", small_sweep, calls, threads=1)
    assert (kept.source, kept.prefetch, kept.provisional) == ("cached", 4096, True)

    quiet = tuning.Tuning(24576, tuning.Crossovers(8, None, 16), "measured", {}, {}, 0.1, 0.02)
    monkeypatch.setattr(tuning, "others_cpu_share_now", lambda: 0.05)
    monkeypatch.setattr(tuning, "measure", lambda *a: quiet)
    assert tuning.tune("avx2", small_sweep, calls, threads=1) == quiet
    assert json.loads(entry.read_text())["others_cpu"] == 0.02

    monkeypatch.setattr(tuning, "measure", lambda *a: pytest.fail("measured again although quiet when cached"))
    again = tuning.tune("avx2", small_sweep, calls, threads=1)
    assert (again.source, again.prefetch, again.provisional) == ("cached", 24576, False)
    del loaded["others_cpu"]  # a cache written before the share was recorded
    entry.write_text(json.dumps(loaded))
    monkeypatch.setattr(tuning, "measure", lambda *a: quiet)
    assert tuning.tune("avx2", small_sweep, calls, threads=1).source == "measured"
    calls.set_prefetch(12288)


def test_the_share_of_the_cpu_others_used_counts_their_time_not_ours(monkeypatch):
    """Between two samples: the machine's busy seconds less this process's own, over wall time × CPUs."""
    from npumoe.core.base import machine

    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    before = machine.CpuSample(wall=10.0, busy=100.0, own=5.0)
    assert machine.others_cpu_share(before, machine.CpuSample(11.0, 101.0, 6.0)) == 0  # all ours
    assert machine.others_cpu_share(before, machine.CpuSample(11.0, 102.0, 6.0)) == 0.5  # one core theirs
    assert machine.others_cpu_share(before, machine.CpuSample(11.0, None, 6.0)) is None
    busy = machine.cpu_sample()
    assert busy.busy is None or busy.busy > 0


def test_first_win_is_where_the_challenger_stays_ahead():
    lut = {4: 1.0, 8: 2.0, 16: 4.0, 32: 8.0}
    assert tuning.first_win(lut, {4: 0.5, 8: 3.0, 16: 3.0, 32: 7.0}) == 16  # ahead at 4, behind at 8: not from 4
    assert tuning.first_win(lut, {4: 2.0, 8: 3.0, 16: 5.0, 32: 9.0}) is None
    assert tuning.first_win(lut, {4: 0.1, 8: 0.1, 16: 0.1, 32: 0.1}) == 4


@pytest.mark.parametrize("crossovers, rows, path", [
    (tuning.Crossovers(16, 64, 16), 15, "LUT-GEMV"),
    (tuning.Crossovers(16, 64, 16), 16, "int8 GEMM"),
    (tuning.Crossovers(None, 64, 16), 16, "dequant GEMM"),  # 16 rows × 4 bits
    (tuning.Crossovers(None, 128, 16), 16, "LUT-GEMV"),
    (tuning.Crossovers(None, None, 16), 512, "LUT-GEMV"),
])
def test_the_ops_path_follows_the_crossovers(crossovers, rows, path):
    from npumoe.luts import torch_op

    fast = kernels.kernels()
    if path == "int8 GEMM" and fast.isa not in ("avx512", "avx2"):
        pytest.skip(f"the {fast.isa} build has no int8 GEMM")
    run = kernels.LutKernels(fast.isa, fast.calls, crossovers)
    rng = np.random.default_rng(5)
    packed = spec.quantize_pack(rng.standard_normal((64, 256)).astype(np.float32), 4, 64)
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    y, taken = torch_op.lut_product(run, layout.to_tiles(packed), x, 1)
    assert taken == path
    np.testing.assert_allclose(y, x @ spec.dequantize(packed).T, rtol=0.05, atol=0.05 * np.abs(y).max())
