"""What the planner may assume about the Hexagon NPU (HTP). No toolchain import needed."""

from npumoe.core.ir.backend import (
    UNPUBLISHED_LAUNCH,
    BackendPlugin,
    BuildOption,
    Capabilities,
    Conformance,
    Device,
    Published,
)
from npumoe.core.ir.graph import OPS

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

DEVICES = (
    Device("Snapdragon 8 Gen 3", 45.0, 59.0, 300.0, (
        ("npu_tops", "third-party listing, runlocalai.co/hardware/snapdragon-8-gen-3 (Qualcomm publishes only "
                     "'98% faster than 8 Gen 2')"),
        ("dram_gb_s", "T-MAN (arXiv 2025), Table 2: NPU DMA bandwidth measured on a OnePlus 12; LPDDR5X-4800 "
                      "peaks at 76.8 GB/s"),
        ("launch_us", UNPUBLISHED_LAUNCH))),
    Device("Snapdragon 8 Elite", 65.0, 84.8, 300.0, (
        ("npu_tops", "estimate: 8 Gen 3's figure x 1.45 (Qualcomm: Hexagon NPU '45% faster', Snapdragon 8 "
                     "Elite product brief, qualcomm.com)"),
        ("dram_gb_s", "LPDDR5X-5300 x 64 bit, Snapdragon 8 Elite product brief (qualcomm.com); peak, not measured"),
        ("launch_us", UNPUBLISHED_LAUNCH))),
)

PUBLISHED = (
    Published("Snapdragon 8 Gen 3", "T-MAN, BitNet-2B decode", "2.08 B ternary weights at 2 bits plus an 8-bit tied "
              "128k x 2560 head (our assumption), one ExecuTorch program a token", 49.1, 0.85e9, 1,
              "T-MAN (arXiv 2025), section 6: 49.1 tokens/s on BitNet-2B, Snapdragon 8 Gen 3 (npumoe seeds)"),
    Published("Snapdragon 8 Gen 3", "Qualcomm: a 7B LLM decode", "Llama-2-7B at 4 bits (~3.4 GB a token, our "
              "assumption), 4 context binaries", 20.0, 3.4e9, 4,
              "Qualcomm at Snapdragon Summit 2023 ('up to 20 tokens/sec'), via fonearena.com"),
)

PLUGIN = BackendPlugin(
    name="htp", caps=HTP_CAPS, factory="npumoe.backends.qualcomm_htp.backend:HtpBackend", extra="htp",
    summary="Qualcomm Hexagon NPU through QNN (ONNX Runtime's QNN EP or ExecuTorch); runs here on QNN's x86_64 HTP",
    # fp16 between ops: npumoe conformance measured at most 2.1e-3 relative error on the demo's graphs
    conformance=Conformance(min_cosine=0.9999, max_relative_error=5e-3),
    devices=DEVICES, published=PUBLISHED,
    commands={"hub": "npumoe.backends.qualcomm_htp.hub:hub_command"},
    command_help={"hub": "Compile or profile HTP graphs on Qualcomm AI Hub devices."},
    trace="npumoe.backends.qualcomm_htp.trace:HtpTrace",
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
