"""The Apple GPU through MLX, as the registry knows it. No MLX import here: ``npumoe plan`` and every
``--help`` read this module on machines without MLX (where using the target names ``pip install 'npumoe[mlx]'``)."""

from npumoe.core.ir.backend import BackendPlugin, BuildOption, Capabilities, Conformance, Device
from npumoe.core.ir.graph import OPS

LAUNCH_ESTIMATE = ("estimate, not measured on a Mac: one mx.eval of a graph with its Metal command buffer and the "
                   "host's copies in and out, order of magnitude")


def _tflops(cores: int, ghz: float, clock_source: str) -> tuple[float, str]:
    """Peak FP32 TFLOPS of an Apple GPU (128 FP32 lanes a core, an FMA counted as 2), and how it was derived:
    Apple publishes core counts, not FLOPS or clocks."""
    return cores * 128 * 2 * ghz / 1e3, (f"derived: {cores} GPU cores x 128 FP32 lanes x 2 (FMA) x {ghz} GHz "
                                         f"({clock_source}); Apple publishes no GPU FLOPS")


M2_TFLOPS, M2_TFLOPS_SOURCE = _tflops(10, 1.398, "third-party clock reports, e.g. hmc-tech.com's M2 GPU page")
M4_TFLOPS, M4_TFLOPS_SOURCE = _tflops(10, 1.470, "third-party clock reports, e.g. hmc-tech.com's 10-core M4 page")
M4_MAX_TFLOPS, M4_MAX_TFLOPS_SOURCE = _tflops(40, 1.678, "third-party clock reports, e.g. hmc-tech.com's M4 Max page")

MAC_SHARE = "estimate: macOS sets no per-app limit; npumoe leaves a quarter of RAM to the OS and the user's other apps"
MEMORY_SOURCES = (
    ("app_share", MAC_SHARE),
    ("max_package_gb", "none: MLX maps safetensors files, which have no per-file limit"),
    ("graph_overhead_mb", "estimate: an MLX function holds no compiled binary beyond its weights"),
)


def mac_gpu(name: str, tflops: float, dram_gb_s: float, ram_gb: float, sources: tuple) -> Device:
    """A Mac's GPU: its own figures, with the RAM of the base Mac that carries the chip."""
    return Device(name, tflops, dram_gb_s, 100.0, (*sources, ("launch_us", LAUNCH_ESTIMATE), *MEMORY_SOURCES),
                  ram_gb=ram_gb, app_share=0.75, chip=name.removesuffix(" GPU"))


DEVICES = (
    mac_gpu("Apple M2 GPU", M2_TFLOPS, 100.0, 8.0, (
        ("npu_tops", M2_TFLOPS_SOURCE),
        ("dram_gb_s", "Apple newsroom, 'Apple unveils M2' (2022-06-06): 100 GB/s unified memory bandwidth"),
        ("ram_gb", "MacBook Air (M2, 2022) tech specs, apple.com: 8 GB unified memory in the base model"))),
    mac_gpu("Apple M4 GPU", M4_TFLOPS, 120.0, 16.0, (
        ("npu_tops", M4_TFLOPS_SOURCE),
        ("dram_gb_s", "Apple newsroom, 'Apple introduces M4 chip' (2024-05-07): 120 GB/s"),
        ("ram_gb", "Mac mini (M4, 2024) tech specs, apple.com: 16 GB unified memory in the base model"))),
    mac_gpu("Apple M4 Max GPU", M4_MAX_TFLOPS, 546.0, 36.0, (
        ("npu_tops", M4_MAX_TFLOPS_SOURCE),
        ("dram_gb_s", "Apple newsroom, MacBook Pro with M4 family (2024-10-30): M4 Max 546 GB/s"),
        ("ram_gb", "MacBook Pro (M4 Max, 2024) tech specs, apple.com: 36 GB unified memory in the base model"))),
)

MLX_CAPS = Capabilities(
    name="mlx",
    ops=frozenset(OPS),  # lut_linear: luts codes become MLX's affine quantised matrices (backends/mlx/weights.py)
    alignment=1,  # MLX takes any shape; a graph is still run at the shapes the plan gave it
    dispatch_seconds=1e-4,  # the devices' launch estimate above
    flops_per_second=3e12,  # estimate: a share of an M2-class GPU's ~3.6 T FP32 peak on FFN-sized matmuls
    weight_bytes_per_second=100e9,  # M2's unified memory bandwidth (Apple newsroom, 2022-06-06); a peak
    notes=("the GPU on a Mac (Metal); elsewhere MLX's CPU backend, which the manifest and --device say",
           "fp32 activations (--activations: bf16 or fp16, as mlx-lm runs such models); weights as the model holds "
           "them, luts-packed matrices as MLX quantised matrices"),
)

PLUGIN = BackendPlugin(
    name="mlx", caps=MLX_CAPS, factory="npumoe.backends.mlx.backend:MlxBackend", extra="mlx",
    summary="the Apple GPU through MLX (mlx-lm's engine); runs here on MLX's CPU backend",
    options=(
        BuildOption("device", "gpu | cpu (default: MLX's default device, the GPU on a Mac)"),
        BuildOption("precision", "stored (default: weights as the model holds them) | int4 | int8 (routed experts "
                                 "as MLX quantised matrices holding the luts codes the ANE, HTP and CPU run)"),
        BuildOption("activations", "float32 (default: the reference's) | bfloat16 | float16 (what mlx-lm computes "
                                   "a bf16 or fp16 model in)"),
    ),
    # fp32 activations, the same weights: conformance measured at most 6.2e-7 relative error on the demo's graphs
    conformance=Conformance(min_cosine=0.99999, max_relative_error=1e-5),
    devices=DEVICES,
)
