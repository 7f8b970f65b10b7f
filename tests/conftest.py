import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the shared harness modules beside the tests
# The LUT kernels' prefetch distance and prompt-path crossovers are set, not measured at first use (a sweep of up to
# 256 MB per kernel build and process; tests/test_luts_tuning.py measures them): the distance changes no result, and
# fixed crossovers keep each test on the same kernel path on every machine
os.environ.setdefault("NPUMOE_LUT_PREFETCH", "12288")
os.environ.setdefault("NPUMOE_LUT_CROSSOVERS", "defaults")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def private_build_cache(tmp_path_factory):
    """Builds in the tests lower through a cache of their own, not the user's ~/.cache/npumoe/builds: one for
    the run, shared by its xdist workers (the directory above each worker's), so a unit two test files build
    is compiled once (the cache's lock makes the second wait for the first). A test of the builder itself
    builds into an empty cache of its own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    cache = root / "build-cache"
    cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NPUMOE_BUILD_CACHE", str(cache))
        yield


def pytest_addoption(parser):
    parser.addoption("--backend", action="append", default=None,
                     help="Run the conformance suite only for this backend (repeatable); default: every installed one.")


def pytest_generate_tests(metafunc):
    if "conformance_target" in metafunc.fixturenames:
        from npumoe.core.ir.backend import plugins

        chosen = metafunc.config.getoption("backend") or list(plugins())
        metafunc.parametrize("conformance_target", chosen, scope="module")


# The files whose module fixtures build or export the demo for whole targets, longest first (CI's --durations, 2
# cores): xdist hands files out in collection order (ci/test.sh: --no-loadscope-reorder, not by test count, which
# left these few-test files for last), so the long ones start at once and the many short ones fill in around them.
LONGEST_FIRST = ("test_conformance.py", "test_export_npu.py", "test_ane_build.py", "test_same_weights.py",
                 "test_export.py", "test_export_ane.py", "test_readme.py", "test_build_targets.py",
                 "test_export_lut.py", "test_bench_full.py", "test_demo_train.py", "test_demo_plans.py")


@pytest.hookimpl(trylast=True)  # after any plugin that shuffles the order
def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
