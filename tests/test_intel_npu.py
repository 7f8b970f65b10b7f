"""The Intel NPU backend (OpenVINO), written by following docs/porting.md; conformance covers its numbers
(tests/test_conformance.py). Here: what it says about where it runs, and its bad input."""

import pytest

pytest.importorskip("openvino", reason="the intel_npu target needs OpenVINO (pip install 'npumoe[intel]')")

from cli_check import cli_error  # noqa: E402

from npumoe.core.base.errors import BackendUnavailableError  # noqa: E402
from npumoe.core.ir.backend import get_backend  # noqa: E402


def test_without_an_npu_it_runs_on_openvinos_cpu_device_and_says_so():
    import openvino as ov

    if "NPU" in ov.Core().available_devices:
        pytest.skip("this machine has an Intel NPU: the stand-in is not used")
    backend = get_backend("intel_npu")
    assert backend.device == "CPU" and backend.describe()["device"] == "CPU"
    with pytest.raises(BackendUnavailableError, match="OpenVINO lists no NPU here"):
        get_backend("intel_npu", device="NPU")


def test_the_cli_offers_it_with_no_edit_to_npumoe(tmp_path, capsys):
    from npumoe.cli import main

    main(["build", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # help wraps its lines
    assert "intel_npu: Intel NPU (Core Ultra) through OpenVINO" in help_text and "--device" in help_text
    assert "--device 'GPU' is not one of NPU, CPU, AUTO" in cli_error(
        capsys, "build", "--targets", "intel_npu", "--device", "GPU", "--out", str(tmp_path / "out"))


def test_a_host_with_room_for_few_graphs_runs_them_within_it_and_computes_the_same(tmp_path, monkeypatch):
    """OpenVINO's CPU device keeps its graphs in host memory, which nothing else guards: where the host has room
    for only about three graphs beside its spare (MemAvailable, faked from the graphs alive), the engine loads
    them on demand within what the device held and computes what an engine holding every graph computes."""
    import weakref

    import numpy as np

    import npumoe
    from npumoe.backends.intel_npu import backend as ov_backend
    from npumoe.core.compiler.artifacts import build
    from npumoe.models.demo import corpus

    model = npumoe.load(dtype="float32")
    text = corpus.calibration_texts(1)[0][:512]
    plan = npumoe.plan(model, npumoe.calibrate(model, [text], chunk=16), target="intel_npu", residency="npu")
    out = tmp_path / "build"
    build(model, plan, "intel_npu", out, progress=False)
    ids = np.frombuffer(corpus.heldout_texts(1)[0][:40].encode(), dtype=np.uint8).astype(np.int64)
    reference = npumoe.Engine(model, plan=plan, backend="intel_npu", artifacts=out)
    expected = reference.forward(ids)
    assert reference.metrics_.counts.get("device_full", 0) == 0
    del reference

    alive, init = weakref.WeakSet(), ov_backend.OpenVinoExecutor.__init__
    monkeypatch.setattr(ov_backend.OpenVinoExecutor, "__init__",
                        lambda self, *a: init(self, *a) or alive.add(self))
    largest = max(p.stat().st_size for p in out.rglob("*.bin"))
    monkeypatch.setattr(ov_backend, "available_memory", lambda: ov_backend.HOST_SPARE + 2 * largest * (3 - len(
        [e for e in alive if e.request is not None])))
    bounded = npumoe.Engine(model, plan=plan, backend="intel_npu", artifacts=out)
    got = bounded.forward(ids)
    counts = bounded.metrics_.counts
    assert counts["device_full"] >= 1 and counts["evictions"] > 0 and len(bounded.executors.resident()) <= 3
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
