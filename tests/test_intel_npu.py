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
