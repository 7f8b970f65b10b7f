"""What the planner may assume about the Hexagon NPU (HTP). No toolchain import needed."""

from npumoe.core.ir.backend import (
    FP16_CONFORMANCE,
    UNPUBLISHED_LAUNCH,
    BackendPlugin,
    BuildOption,
    Capabilities,
    Device,
    ProgramTarget,
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

SHARED_SOURCES = (  # what Android lets one app hold and what a QNN context may, on every Snapdragon below
    ("launch_us", UNPUBLISHED_LAUNCH),
    ("app_share", "estimate: Android publishes no per-app limit on native memory; 60 % of RAM is what the Off Grid "
                  "on-device LLM app budgets for a model (its docs, 'memory management', "
                  "mintlify.com/alichherawalla/off-grid-mobile-ai)"),
    ("max_package_gb", "ONNX Runtime PR #20930 (2024): 'because of QNN PD memory limitation, large model (>3.5GB) has "
                       "to be split' into several context binaries; Qualcomm publishes no figure"),
    ("graph_overhead_mb", "estimate: unpublished; the demo's context binaries hold 94 KB each beyond their weights "
                          "(measured: 15.2 MB for 13.5 MB of fp16 weights in 18), npumoe allows 1 MB for what QNN "
                          "holds for a loaded context"),
)


def snapdragon(name: str, npu_tops: float, dram_gb_s: float, ram_gb: float, sources: tuple) -> Device:
    """A phone's Snapdragon: its own figures, with what Android and QNN allow on every one of them."""
    return Device(name, npu_tops, dram_gb_s, 300.0, (*sources, *SHARED_SOURCES), ram_gb=ram_gb, app_share=0.6,
                  max_package_gb=3.5, graph_overhead_mb=1.0)


DEVICES = (
    snapdragon("Snapdragon 8 Gen 3", 45.0, 59.0, 8.0, (
        ("npu_tops", "third-party listing, runlocalai.co/hardware/snapdragon-8-gen-3 (Qualcomm publishes only "
                     "'98% faster than 8 Gen 2')"),
        ("dram_gb_s", "T-MAN (arXiv 2025), Table 2: NPU DMA bandwidth measured on a OnePlus 12; LPDDR5X-4800 "
                      "peaks at 76.8 GB/s"),
        ("ram_gb", "Samsung Galaxy S24 (Snapdragon 8 Gen 3 for Galaxy): 8 GB, samsung.com specifications; the "
                   "OnePlus 12 above has 12 or 16 GB"))),
    snapdragon("Snapdragon 8 Elite", 65.0, 84.8, 12.0, (
        ("npu_tops", "estimate: 8 Gen 3's figure x 1.45 (Qualcomm: Hexagon NPU '45% faster', Snapdragon 8 "
                     "Elite product brief, qualcomm.com)"),
        ("dram_gb_s", "LPDDR5X-5300 x 64 bit, Snapdragon 8 Elite product brief (qualcomm.com); peak, not measured"),
        ("ram_gb", "Samsung Galaxy S25 (Snapdragon 8 Elite for Galaxy): 12 GB, samsung.com specifications"))),
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
    conformance=FP16_CONFORMANCE,
    devices=DEVICES, published=PUBLISHED, weight_bits="npumoe.backends.qualcomm_htp.quantize:weight_bits",
    one_graph_per_weights=True,  # docs/deploy.md, "Weights once on the HTP"
    commands={"hub": "npumoe.backends.qualcomm_htp.hub:hub_command"},
    command_help={"hub": "Compile or profile HTP graphs on Qualcomm AI Hub devices."},
    trace="npumoe.backends.qualcomm_htp.trace:HtpTrace",
    program=ProgramTarget(lower="npumoe.backends.qualcomm_htp.program:lower", libraries=("executorch_backend_qnn",),
                          device="htp (QNN fp16: the expert products; the rest on ExecuTorch's CPU kernels)",
                          runner_setup="npumoe.backends.qualcomm_htp.program:runner_setup",
                          op_impls="npumoe.backends.qualcomm_htp.pte:IMPLS"),
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
