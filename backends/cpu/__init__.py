"""The CPU backend: the reference executor, and the home of cold experts and spilled tokens."""

from __future__ import annotations

from npumoe.backends.base import BackendBase, Capabilities
from npumoe.backends.cpu.executor import OP_IMPLS, TorchGraphExecutor
from npumoe.core.ir import OPS

CPU_CAPS = Capabilities(
    name="cpu",
    ops=frozenset(OPS),
    dtypes=("float32",),
    static_shapes=False,
    alignment=1,
    dispatch_seconds=5e-6,  # a Python call into torch: measured order of magnitude on x86
    flops_per_second=5e10,
    notes=("reference executor: fp32 torch, any shape",),
)


class CpuBackend(BackendBase):
    """Lowering is the identity: the CPU executor runs IR graphs directly."""

    name = "cpu"
    caps = CPU_CAPS

    def lower(self, graph, weights, out_dir):
        return {"graph": graph.name, "format": "ir"}

    def load(self, artifact, out_dir, graph, weights):
        return TorchGraphExecutor(graph, weights)


__all__ = ["CpuBackend", "CPU_CAPS", "TorchGraphExecutor", "OP_IMPLS"]
