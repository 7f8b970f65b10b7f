"""The CPU reference backend's registry record: any shape, every op, fp32 torch."""

from npumoe.core.ir.backend import BackendPlugin, Capabilities, ProgramTarget
from npumoe.core.ir.graph import OPS

CPU_CAPS = Capabilities(
    name="cpu",
    ops=frozenset(OPS),
    alignment=1,
    dispatch_seconds=5e-6,  # a Python call into torch: measured order of magnitude on x86
    flops_per_second=5e10,
    weight_bytes_per_second=2e10,  # a laptop's DRAM read rate, order of magnitude (npumoe bench lut measures it)
    notes=("reference executor: fp32 torch, any shape",),
)

PLUGIN = BackendPlugin(name="cpu", caps=CPU_CAPS, factory="npumoe.backends.cpu.backend:CpuBackend",
                       summary="the reference interpreter on this CPU (any shape; runs unplanned graphs)",
                       program=ProgramTarget(lower="npumoe.backends.cpu.program:lower",
                                             libraries=("executorch_backend_xnnpack",),
                                             device="cpu (XNNPACK, ExecuTorch's optimized kernels)"))
