"""What the planner may assume about the Hexagon NPU (HTP). No toolchain import needed."""

from npumoe.core.backend import BackendPlugin, BuildOption, Capabilities, Conformance
from npumoe.core.ir import OPS

HTP_CAPS = Capabilities(
    name="htp",
    ops=frozenset(OPS) - {"lut_linear"},  # low-bit weights reach the HTP as QDQ linears (--precision), not LUTs
    alignment=8,  # not required by QNN; keeps token rows on whole HTP tiles
    max_graph_bytes=4 << 30,  # a QNN context binary maps into the HTP's 32-bit (4 GB) address space
    dispatch_seconds=3e-4,  # one graphExecute incl. the FastRPC round trip, order of magnitude on phones
    flops_per_second=4e12,  # fp16 HTP on 8 Gen 3-class parts, sustained on FFN-sized matmuls (estimate)
    weight_bytes_per_second=59e9,  # T-MAN (arXiv 2025) Table 2: NPU DMA bandwidth measured on a OnePlus 12
    notes=(
        "static shapes only; no data-dependent ops inside graphs",
        "max context bytes 4 GB (HTP virtual address space per session)",
    ),
)

PLUGIN = BackendPlugin(
    name="htp", caps=HTP_CAPS, factory="npumoe.backends.qualcomm_htp:HtpBackend", extra="htp",
    summary="Qualcomm Hexagon NPU through QNN (ONNX Runtime's QNN EP or ExecuTorch); runs here on QNN's x86_64 HTP",
    # fp16 between ops: npumoe conformance measured at most 2.1e-3 relative error on the demo's graphs
    conformance=Conformance(min_cosine=0.9999, max_relative_error=5e-3),
    options=(
        BuildOption("via", "toolchain: onnx (default; QNN context binaries) | executorch (.pte)"),
        BuildOption("precision", "fp16 (default) | w8a16 | w4a16 = int4 (QDQ weights, 16-bit activations; "
                                 "int4 experts hold the ANE's and CPU's luts codes)"),
        BuildOption("soc", "Snapdragon SoC model number: 69 = 8 Elite (default), 57 = 8 Gen 3, 43 = 8 Gen 2, "
                           "60 = X Elite"),
        BuildOption("keep_onnx", "also keep each graph's ONNX model (fp32 weights), which npumoe hub compile "
                                 "needs; off, only the context binaries are kept", flag=True),
    ),
)
