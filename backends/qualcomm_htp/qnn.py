"""ONNX Runtime sessions on QNN's HTP backend (the ``onnxruntime-qnn`` plugin), CPU fallback disabled.

The plugin carries QNN's real HTP libraries; on x86_64 their HTP backend compiles graphs
exactly as for a phone and executes them in a software model of the NPU. Every session
gets the same provider options, from :func:`provider_options`, so a graph compiled here
and the EPContext model that reloads it agree on SoC and precision.
"""

from __future__ import annotations

from pathlib import Path

from npumoe.core.base.errors import BackendUnavailableError, InputError
from npumoe.core.base.native import native_output_silenced

# Snapdragon SoC model numbers QNN knows → (name, HTP architecture). From QNN's SoC table.
SOCS = {
    "69": ("Snapdragon 8 Elite (SM8750)", "v79"),
    "57": ("Snapdragon 8 Gen 3 (SM8650)", "v75"),
    "43": ("Snapdragon 8 Gen 2 (SM8550)", "v73"),
    "60": ("Snapdragon X Elite (SC8380XP)", "v73"),
}
DEFAULT_SOC = "69"
INSTALL = "pip install 'onnxruntime-qnn==2.7.0' (or pip install 'npumoe[htp]')"
# ORT folds MatMul + a following residual Add into a Gemm whose 2-D bias the HTP rejects; QNN fuses
# MatMul + bias itself.
DISABLED_OPTIMIZERS = ["MatMulAddFusion"]
_registered = False


def soc_info(soc: str | int) -> tuple[str, str]:
    """(name, htp_arch) of a SoC model number, or an InputError listing the known ones."""
    key = str(soc)
    if key not in SOCS:
        known = ", ".join(f"{k} = {v[0]}" for k, v in SOCS.items())
        raise InputError(f"--soc {soc!r} is not a Snapdragon SoC model npumoe knows; use one of {known}.")
    return SOCS[key]


def chipset(soc: str | int) -> str:
    """The part number ExecuTorch's QcomChipset uses, e.g. ``SM8750`` for SoC 69."""
    return soc_info(soc)[0].rsplit("(", 1)[1].rstrip(")")


def ort_qnn():
    """onnxruntime with the QNN execution provider registered (once per process)."""
    global _registered
    try:
        import onnxruntime as ort
        import onnxruntime_qnn
    except ImportError as err:
        raise BackendUnavailableError(f"the HTP backend needs onnxruntime-qnn ({err}); "
                                      f"install it with {INSTALL}.") from err
    if not _registered:
        ort.set_default_logger_severity(3)  # errors only: its warnings (and the quantiser's sessions') are not ours
        ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
        _registered = True
    return ort


def versions() -> dict[str, str]:
    """The plugin's and the QNN SDK's versions (the SDK is what a phone's runtime must match)."""
    import onnxruntime_qnn
    from onnxruntime_qnn import build_and_package_info as info

    return {"onnxruntime_qnn": onnxruntime_qnn.__version__, "qnn": info.qnn_version}


def provider_options(soc: str, fp16: bool, profile_csv: Path | None = None) -> dict[str, str]:
    import onnxruntime_qnn

    options = {"backend_path": onnxruntime_qnn.get_qnn_htp_path(), "soc_model": str(soc),
               "htp_performance_mode": "burst"}
    if fp16:
        options["enable_htp_fp16_precision"] = "1"
    if profile_csv is not None:
        options |= {"profiling_level": "detailed", "profiling_file_path": str(profile_csv)}
    return options


def session(model: bytes | Path, soc: str, fp16: bool, *, context_path: Path | None = None,
            profile_csv: Path | None = None, fallback: bool = False, config: dict[str, str] | None = None):
    """An InferenceSession on the HTP. ``context_path`` compiles and writes an EPContext model
    there; ``fallback`` (diagnosis only) lets rejected nodes run on the CPU instead of failing."""
    ort = ort_qnn()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not fallback:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if context_path is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(context_path))
        so.add_session_config_entry("ep.context_embed_mode", "0")
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    so.add_provider_for_devices(devices, provider_options(soc, fp16, profile_csv))
    source = str(model) if isinstance(model, Path) else model
    with native_output_silenced(1):  # its "# LIBNATIVE" load notice: noise, and a corrupt --json
        return ort.InferenceSession(source, sess_options=so, disabled_optimizers=DISABLED_OPTIMIZERS)
