"""Intel's NPU (Core Ultra) through OpenVINO, as the registry knows it. No OpenVINO import needed."""

from npumoe.core.ir.backend import (
    FP16_CONFORMANCE,
    UNPUBLISHED_LAUNCH,
    BackendPlugin,
    BuildOption,
    Capabilities,
    Device,
    ProgramTarget,
)
from npumoe.core.ir.graph import OPS

NPU_DOCS = "docs.openvino.ai/2026/openvino-workflow/running-inference/inference-devices-and-modes/npu-device.html"

INTEL_NPU_CAPS = Capabilities(
    name="intel_npu",
    ops=frozenset(OPS) - {"lut_linear"},  # graphs go through standard ONNX (npumoe.backends.onnx_export)
    alignment=16,  # estimate: FP16 tiles of 16 channels; OpenVINO documents no capacity rule
    max_graph_bytes=2 << 30,  # estimate: one compiled blob per graph kept well under the driver's 4 GB mappings
    dispatch_seconds=5e-4,  # estimate: one synchronous infer request through the NPU driver, order of magnitude
    flops_per_second=5e12,  # estimate: fp16, sustained on FFN-sized matmuls (NPU 3720 is marketed at ~11 TOPS int8)
    weight_bytes_per_second=60e9,  # estimate: a share of Core Ultra's LPDDR5X (~90-120 GB/s peak)
    notes=(
        f"static shapes only, FP16 compute on the device ({NPU_DOCS}; Supported Devices: dynamic shapes No)",
        "compiled for device NPU where OpenVINO lists one; elsewhere run on OpenVINO's CPU device (said in the "
        "manifest and by the executor)",
    ),
)

LAPTOP_SOURCES = (  # what a Windows laptop lets one app hold and what each compiled model costs, on every part below
    ("launch_us", UNPUBLISHED_LAUNCH),
    ("app_share", "estimate: Windows sets no per-app limit; npumoe leaves a quarter of RAM to the OS and other apps"),
    ("graph_overhead_mb", "estimate, unpublished: npumoe's allowance for each compiled model's NPU blob and buffers "
                          "beyond its weights"),
    ("max_package_gb", "estimate, unpublished: the 2 GB npumoe lets one compiled model hold (INTEL_NPU_CAPS."
                       "max_graph_bytes), well under the driver's 4 GB mappings"),
    ("npu_tops", "notebookcheck.net, 'Intel Core Ultra 7 256V Processor - Benchmarks and Specs': a 47 TOPS NPU "
                 "(Intel markets NPU 4 at 48 TOPS int8)"),
    ("dram_gb_s", "on-package LPDDR5X-8533 x 128 bit (notebookcheck.net, as above): 136.5 GB/s peak, shared with the "
                  "CPU and GPU; not measured"),
)


def lunar_lake(name: str, ram_gb: float, ram_source: str) -> Device:
    """A Core Ultra 200V (Lunar Lake) laptop: its RAM is on the package, so the part fixes it."""
    return Device(name, 47.0, 136.5, 500.0, (*LAPTOP_SOURCES, ("ram_gb", ram_source)), ram_gb=ram_gb,
                  app_share=0.75, max_package_gb=INTEL_NPU_CAPS.max_graph_bytes / 1e9, graph_overhead_mb=1.0)


DEVICES = (
    lunar_lake("Intel Core Ultra 7 256V", 16.0, "notebookcheck.net, 'Intel Core Ultra 7 256V': 16 GB of on-package "
               "LPDDR5X-8533"),
    lunar_lake("Intel Core Ultra 7 258V", 32.0, "notebookcheck.net, as for the 256V: the 258V differs only in its "
               "32 GB of on-package RAM"),
)

PLUGIN = BackendPlugin(
    name="intel_npu", caps=INTEL_NPU_CAPS, factory="npumoe.backends.intel_npu.backend:IntelNpuBackend", extra="intel",
    summary="Intel NPU (Core Ultra) through OpenVINO IR; runs here on OpenVINO's CPU device when no NPU is present",
    options=(BuildOption("device", "OpenVINO device to compile for: NPU (default when present), CPU or AUTO"),),
    conformance=FP16_CONFORMANCE,  # fp16 on the device; on the CPU stand-in only the fp16 weights differ
    devices=DEVICES,
    one_graph_per_weights=True,  # each compiled model holds its weights: docs/deploy.md, "Weights once on the HTP"
    program=ProgramTarget(lower="npumoe.backends.intel_npu.program:lower", libraries=("executorch_backend_openvino",),
                          device="intel_npu (OpenVINO, its CPU device here; the rest on ExecuTorch's CPU kernels)",
                          runner_setup="npumoe.backends.intel_npu.program:runner_setup"),
)
