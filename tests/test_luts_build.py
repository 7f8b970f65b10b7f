"""Compile-on-first-use: one cached library per source/flags/compiler, clear errors without a
compiler; and the `npumoe bench lut` command runs end to end (figures are not checked here)."""

import json

import pytest

from npumoe.cli import main
from npumoe.core.base.errors import BackendUnavailableError
from npumoe.luts import build


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NPUMOE_CACHE_DIR", str(tmp_path))
    return tmp_path / "luts"


def test_library_is_built_once_into_the_cache(fresh_cache):
    path = build.library("portable")
    assert path.parent == fresh_cache and path.name.startswith("lut-portable-")
    stamp = path.stat().st_mtime_ns
    assert build.library("portable") == path and path.stat().st_mtime_ns == stamp
    assert not list(fresh_cache.glob("*.tmp"))  # written under a temporary name, then renamed


def test_cache_key_follows_sources_and_flags(fresh_cache, monkeypatch):
    cc = build.compiler()
    sources = build._sources("portable")
    key = build._key(cc, sources, build.COMMON_FLAGS)
    assert build._key(cc, sources, (*build.COMMON_FLAGS, "-DX")) != key
    assert build._key(cc, build._sources("avx2"), build.COMMON_FLAGS) != key


def test_missing_compiler_is_a_clear_error(monkeypatch, fresh_cache):
    build.compiler.cache_clear()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    try:
        with pytest.raises(BackendUnavailableError, match="does not run .* install gcc or clang"):
            build.library("portable")
    finally:
        build.compiler.cache_clear()


def test_bench_command_reports_every_figure(capsys):
    main(["bench", "lut", "--size", "256", "--repeats", "3", "--rotate-mb", "1", "--kernel", "portable", "--json"])
    result = json.loads(capsys.readouterr().out)
    for name in ("int4", "int2"):
        assert {"bw_ratio", "speedup_vs_fp32", "speedup_vs_dequant", "single_thread"} <= set(result[name])
        assert result[name]["gbs"] > 0 and result[name]["speedup_vs_fp32"] > 0 and result[name]["stream_gbs"] > 0
        assert result[name]["bw_ratio"] == pytest.approx(result[name]["gbs"] / result[name]["stream_gbs"])
    assert result["prefill_vs_fp32"] > 0 and result["kernel"] == "portable" and "1" in result["threads"]


def test_bench_bad_kernel_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "lut", "--kernel", "sse9"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown LUT kernel 'sse9'") and len(err.splitlines()) == 1
