"""The Apple Neural Engine as the registry knows it: what the planner may assume (derived from the lint's rule
table) and what its build takes.

No coremltools import needed: the planner reads this without the toolchain installed.
"""

from npumoe.backends.apple_ane import rules
from npumoe.core.backend import BackendPlugin, BuildOption, Capabilities, Conformance

ANE_CAPS = Capabilities(
    name="ane",
    ops=rules.ir_ops_on_ane(),
    alignment=rules.CHANNEL_ALIGNMENT,
    max_graph_bytes=rules.max_graph_bytes(),  # graph budget, capped by the iOS package limit
    dispatch_seconds=2e-4,  # one Core ML prediction on an ANE-resident function, order of magnitude
    flops_per_second=3e12,  # fp16, sustained for FFN-sized 1×1 convs (M2-class estimate; peak 15.8 T)
    weight_bytes_per_second=100e9,  # M2's unified memory bandwidth (Apple newsroom, 2022-06-06); a peak
    notes=(
        f"packages ≤ {rules.MAX_PACKAGE_BYTES['ios'] / 1e9:g} GB on iOS, "
        f"≤ {rules.MAX_PACKAGE_BYTES['macos'] / 1e9:g} GB on macOS",
        "FP16 compute only",
        "rule table: npumoe.backends.apple_ane.rules (checked by npumoe lint)",
    ),
)

PLUGIN = BackendPlugin(
    name="ane", caps=ANE_CAPS, factory="npumoe.backends.apple_ane:AneBackend", extra="ane",
    summary="Apple Neural Engine through Core ML (or ExecuTorch); runs here in npumoe's MIL interpreter",
    # fp16 between ops: npumoe conformance measured at most 2.1e-3 relative error on the demo's graphs
    conformance=Conformance(min_cosine=0.9999, max_relative_error=5e-3),
    options=(
        BuildOption("via", "toolchain: coreml (default; .mlpackage) | executorch (.pte)"),
        BuildOption("precision", "fp16 (default) | int4 (blockwise; the HTP's and CPU's luts codes) | palettize4 | "
                                 "palettize2"),
    ),
)
