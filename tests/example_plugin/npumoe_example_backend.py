"""An out-of-tree npumoe backend, as a third party would ship one: a registry record and a backend,
registered only through the ``npumoe.backends`` entry point of this folder's dist-info (npumoe's own
pyproject does not name it). Its device claims every op but ``sdpa``, and its lowering enforces that
claim, so attention must reach the CPU through the planner, never through a failed build."""

from npumoe.backends.cpu import CpuBackend
from npumoe.core.backend import BackendPlugin, Capabilities, Lowered
from npumoe.core.interpreter import TorchGraphExecutor
from npumoe.core.ir import OPS
from npumoe.errors import InputError

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


PLUGIN = BackendPlugin(name="toy", caps=TOY_CAPS, factory="npumoe_example_backend:ToyBackend",
                       summary="an out-of-tree example backend (tests/example_plugin)")
