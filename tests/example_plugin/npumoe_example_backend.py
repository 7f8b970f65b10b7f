"""An out-of-tree npumoe backend, as a third party would ship one: a registry record and a backend,
registered only through the ``npumoe.backends`` entry point of this folder's dist-info (npumoe's own
pyproject does not name it). Its device claims every op but ``sdpa``, and its lowering enforces that
claim, so attention must reach the CPU through the planner, never through a failed build."""

from npumoe.backends.cpu.backend import CpuBackend
from npumoe.core.base.errors import InputError
from npumoe.core.compiler.interpreter import TorchGraphExecutor
from npumoe.core.ir.backend import BackendPlugin, Capabilities, Device, Lowered
from npumoe.core.ir.graph import OPS

TOY_CAPS = Capabilities(name="toy", ops=frozenset(OPS) - {"sdpa", "lut_linear"}, alignment=4,
                        dispatch_seconds=1e-4, flops_per_second=1e12, notes=("an example plugin",))


class ToyBackend(CpuBackend):
    name = "toy"
    caps = TOY_CAPS

    def lower(self, graph, weights, out_dir):
        unclaimed = sorted({op.op for op in graph.ops} - self.caps.ops)
        if unclaimed:
            raise InputError(f"the toy device cannot run {', '.join(unclaimed)} (graph {graph.name})")
        return Lowered("toy", info={"graph": graph.name})

    def load(self, artifact, out_dir, graph, weights):
        return TorchGraphExecutor(graph, weights)


TOY_CHIP = Device("Toy Chip 1", npu_tops=10.0, dram_gb_s=50.0, launch_us=100.0, sources=(
    ("npu_tops", "made up for the example"), ("dram_gb_s", "made up for the example"),
    ("launch_us", "made up for the example")))

PLUGIN = BackendPlugin(name="toy", caps=TOY_CAPS, factory="npumoe_example_backend:ToyBackend",
                       summary="an out-of-tree example backend (tests/example_plugin)", devices=(TOY_CHIP,))
