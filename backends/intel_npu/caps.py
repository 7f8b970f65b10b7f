"""Intel's NPU (Core Ultra) through OpenVINO, as the registry knows it. No OpenVINO import needed."""

from npumoe.core.ir.backend import FP16_CONFORMANCE, BackendPlugin, BuildOption, Capabilities, ProgramTarget
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

PLUGIN = BackendPlugin(
    name="intel_npu", caps=INTEL_NPU_CAPS, factory="npumoe.backends.intel_npu.backend:IntelNpuBackend", extra="intel",
    summary="Intel NPU (Core Ultra) through OpenVINO IR; runs here on OpenVINO's CPU device when no NPU is present",
    options=(BuildOption("device", "OpenVINO device to compile for: NPU (default when present), CPU or AUTO"),),
    conformance=FP16_CONFORMANCE,  # fp16 on the device; on the CPU stand-in only the fp16 weights differ
    one_graph_per_weights=True,  # each compiled model holds its weights: docs/deploy.md, "Weights once on the HTP"
    program=ProgramTarget(lower="npumoe.backends.intel_npu.program:lower", libraries=("executorch_backend_openvino",),
                          device="intel_npu (OpenVINO, its CPU device here; the rest on ExecuTorch's CPU kernels)",
                          runner_setup="npumoe.backends.intel_npu.program:runner_setup"),
)
