"""The prefetch distance measured at first use (npumoe.luts.tuning): it changes no result, the sweep's fastest
distance is the one set, cached per build and CPU, measured again when the CPU or the cache changes, and set by hand
through NPUMOE_LUT_PREFETCH."""

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
    cached = list(small_sweep.parent.glob("prefetch-avx2-*-1t-0123456789abcdef.json"))
    assert len(cached) == 1

    monkeypatch.setattr(tuning, "measure", lambda *a: pytest.fail("measured although cached"))
    again = tuning.tune("avx2", small_sweep, calls, threads=1)
    assert (again.source, again.prefetch) == ("cached", chosen.prefetch)

    monkeypatch.undo()
    monkeypatch.setattr(tuning, "MIN_SWEEP_BYTES", 8 << 20)
    monkeypatch.setattr(tuning, "MAX_SWEEP_BYTES", 8 << 20)
    monkeypatch.delenv("NPUMOE_LUT_PREFETCH", raising=False)
    monkeypatch.setattr(tuning, "cpu_key", lambda: "another-cpu")
    assert tuning.tune("avx2", small_sweep, calls, threads=1).source == "measured"
    assert len(list(small_sweep.parent.glob("prefetch-avx2-*.json"))) == 2


@pytest.mark.skipif(not PREFETCHING, reason="this CPU runs only the portable kernel, which prefetches nothing")
def test_a_damaged_cache_entry_is_measured_again(small_sweep):
    calls = kernels.kernels(PREFETCHING[0]).calls
    tuning.tune("avx2", small_sweep, calls, threads=1)
    (entry,) = small_sweep.parent.glob("prefetch-avx2-*.json")
    for damage in ("{", '{"prefetch": 999, "ms_by_distance": {}, "seconds": 0}', ""):
        entry.write_text(damage)
        assert tuning.tune("avx2", small_sweep, calls, threads=1).source == "measured"


@pytest.mark.skipif(not PREFETCHING, reason="this CPU runs only the portable kernel, which prefetches nothing")
def test_the_environment_sets_the_distance_without_measuring(small_sweep, monkeypatch):
    calls = kernels.kernels(PREFETCHING[0]).calls
    monkeypatch.setattr(tuning, "measure", lambda *a: pytest.fail("measured although set by hand"))
    monkeypatch.setenv("NPUMOE_LUT_PREFETCH", "20000")
    chosen = tuning.tune("avx2", small_sweep, calls, threads=1)
    assert (chosen.source, chosen.prefetch) == ("NPUMOE_LUT_PREFETCH", 20000)
    assert not list(small_sweep.parent.glob("prefetch-*.json"))
    for bad in ("far", "64", "-1"):
        monkeypatch.setenv("NPUMOE_LUT_PREFETCH", bad)
        with pytest.raises(InputError, match="NPUMOE_LUT_PREFETCH"):
            tuning.tune("avx2", small_sweep, calls, threads=1)
    calls.set_prefetch(12288)
