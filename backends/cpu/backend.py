"""The CPU backend: the reference executor, and the home of cold experts and spilled tokens."""

from __future__ import annotations

from npumoe.backends.base import BackendBase
from npumoe.backends.cpu.caps import CPU_CAPS
from npumoe.core.compiler.interpreter import TorchGraphExecutor
from npumoe.core.ir.backend import Lowered


class CpuBackend(BackendBase):
    """Lowering is the identity: the CPU executor runs IR graphs directly."""

    name = "cpu"
    caps = CPU_CAPS

    def lower(self, graph, weights, out_dir):
        return Lowered("ir", info={"graph": graph.name})

    def load(self, artifact, out_dir, graph, weights):
        return TorchGraphExecutor(graph, weights)


__all__ = ["CpuBackend", "CPU_CAPS"]
