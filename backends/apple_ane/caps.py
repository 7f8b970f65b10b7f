"""The Apple Neural Engine as the registry knows it: what the planner may assume (derived from the lint's rule
table) and what its build takes.

No coremltools import needed: the planner reads this without the toolchain installed.
"""

from npumoe.backends.apple_ane import rules
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

PACKAGE_SOURCES = (
    ("launch_us", UNPUBLISHED_LAUNCH),
    ("max_package_gb", "ANEMLL docs/convert.md: 'ANE models on iOS are limited to 1GB file size; macOS supports up "
                       "to ~2GB' (npumoe.backends.apple_ane.rules, package-bytes)"),
    ("graph_overhead_mb", "estimate, unpublished: npumoe's allowance for each function's compiled ANE program and "
                          "buffers beyond its weights"),
)
MAC_SHARE = "estimate: macOS sets no per-app limit; npumoe leaves a quarter of RAM to the OS and the user's other apps"
IPHONE_SHARE = ("estimate: Apple publishes no per-app limit; on an 8 GB iPad a developer measured 75 % of RAM "
                "available to one app through iPadOS 26.3 and 37.5 % from 26.4 (developer.apple.com/forums/thread/"
                "826325); npumoe takes half")


def apple(name: str, platform: str, npu_tops: float, dram_gb_s: float, ram_gb: float, sources: tuple) -> Device:
    """An Apple chip: its own figures, with what one app and one Core ML package may hold on its platform."""
    share = (0.5, IPHONE_SHARE) if platform == "ios" else (0.75, MAC_SHARE)
    return Device(name, npu_tops, dram_gb_s, 200.0, (*sources, *PACKAGE_SOURCES, ("app_share", share[1])),
                  ram_gb=ram_gb, app_share=share[0], max_package_gb=rules.MAX_PACKAGE_BYTES[platform] / 1e9,
                  graph_overhead_mb=1.0, chip=name)


DEVICES = (
    apple("Apple M2", "macos", 15.8, 100.0, 8.0, (
        ("npu_tops", "Apple newsroom, 'Apple unveils M2' (2022-06-06): Neural Engine 15.8 trillion ops/s"),
        ("dram_gb_s", "Apple newsroom, 'Apple unveils M2' (2022-06-06): 100 GB/s unified memory bandwidth"),
        ("ram_gb", "MacBook Air (M2, 2022) tech specs, apple.com: 8 GB unified memory in the base model"))),
    apple("Apple M4", "macos", 38.0, 120.0, 16.0, (
        ("npu_tops", "Apple newsroom, 'Apple introduces M4 chip' (2024-05-07): 38 trillion ops/s"),
        ("dram_gb_s", "Apple newsroom, 'Apple introduces M4 chip' (2024-05-07): 120 GB/s"),
        ("ram_gb", "Mac mini (M4, 2024) tech specs, apple.com: 16 GB unified memory in the base model"))),
    apple("Apple M4 Max", "macos", 38.0, 546.0, 36.0, (
        ("npu_tops", "Apple newsroom, MacBook Pro with M4 family (2024-10-30): the M4 family's 38 TOPS Neural Engine"),
        ("dram_gb_s", "Apple newsroom, MacBook Pro with M4 family (2024-10-30): M4 Max 546 GB/s"),
        ("ram_gb", "MacBook Pro (M4 Max, 2024) tech specs, apple.com: 36 GB unified memory in the base model"))),
    apple("Apple A17 Pro", "ios", 35.0, 51.2, 8.0, (
        ("npu_tops", "Apple newsroom, iPhone 15 Pro (2023-09-12): Neural Engine up to 35 trillion ops/s"),
        ("dram_gb_s", "third-party: LPDDR5-6400 x 64 bit (teardown reports); Apple does not publish it"),
        ("ram_gb", "third-party: 8 GB in the iPhone 15 Pro (teardown reports); Apple does not publish it"))),
    apple("Apple A18", "ios", 35.0, 60.0, 8.0, (
        ("npu_tops", "Apple newsroom, iPhone 16 (2024-09-09): 16-core Neural Engine, 35 trillion ops/s class"),
        ("dram_gb_s", "third-party: LPDDR5X-7500 x 64 bit (teardown reports); Apple does not publish it"),
        ("ram_gb", "third-party: 8 GB in the iPhone 16 (teardown reports); Apple does not publish it"))),
)

PUBLISHED = (
    Published("Apple M4 Max", "ZAYA1-8B MoE on the ANE", "all 8 experts computed every step; fp16 weights (our "
              "assumption: ~16 GB a token; at 4 bits the ratio would be 4x larger), 4 shards", 9.0, 16e9, 4,
              "ANE MoE chapter (npumoe seeds, ane-moe-chapter.txt): 9 tok/s on M4 Max"),
)

PLUGIN = BackendPlugin(
    name="ane", caps=ANE_CAPS, factory="npumoe.backends.apple_ane.backend:AneBackend", extra="ane",
    summary="Apple Neural Engine through Core ML (or ExecuTorch); runs here in npumoe's MIL interpreter",
    conformance=FP16_CONFORMANCE,
    devices=DEVICES, published=PUBLISHED, weight_bits="npumoe.backends.apple_ane.compress:weight_bits",
    shares_weights=True,  # a package's functions (a layer's prefill and decode graphs) store their weights once
    commands={"lint": "npumoe.backends.apple_ane.lint:lint_command"},
    command_help={"lint": "Check Core ML packages against the ANE rule table."},
    program=ProgramTarget(lower="npumoe.backends.apple_ane.program:lower", expert_dtype="float16",
                          check="npumoe.backends.apple_ane.lint:check_program",
                          device="ane (Core ML, macOS/iOS only; the rest on ExecuTorch's CPU kernels)",
                          elsewhere="macOS or iOS, whose ExecuTorch runtime has the Core ML delegate"),
    options=(
        BuildOption("via", "toolchain: coreml (default; .mlpackage) | executorch (.pte)"),
        BuildOption("precision", "fp16 (default) | int4 (blockwise; the HTP's and CPU's luts codes) | palettize4 | "
                                 "palettize2"),
    ),
)
