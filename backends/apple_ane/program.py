"""The ANE's part of ``npumoe export``: the expert products delegated to Core ML through ExecuTorch's Core ML
partitioner (fp16 compute, iOS 18 / macOS 15, CPU and Neural Engine), the rest on ExecuTorch's CPU kernels.

Only the nodes ``npumoe export`` marks as expert products go to Core ML, and the KV cache stays ExecuTorch's (not taken
over as Core ML state), so the two methods share it as on every other target. Lowering runs anywhere; the program runs
only where ExecuTorch's Core ML delegate does, on macOS and iOS. The expert products take and give fp16 (their
matrices stored so): Core ML is handed no fp32 tensor to cast, which the ANE lint would flag."""

from __future__ import annotations

from npumoe.backends.partition import tag_partitions
from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.ir.backend import is_expert_product


def compile_specs():
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    return CoreMLBackend.generate_compile_specs(compute_unit=ct.ComputeUnit.CPU_AND_NE,
                                                minimum_deployment_target=ct.target.iOS18,
                                                compute_precision=ct.precision.FLOAT16)


def _partitioner():
    try:
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner
        from executorch.backends.apple.coreml.partition.coreml_partitioner import _OperatorsSupportedForCoreMLBackend
    except ImportError as err:
        raise BackendUnavailableError(f"npumoe export --target ane needs ExecuTorch's Core ML partitioner, which did "
                                      f"not import ({err}); install pip install 'npumoe[ane]'.") from err

    class ExpertSupport(_OperatorsSupportedForCoreMLBackend):
        def is_node_supported(self, submodules, node) -> bool:
            return is_expert_product(node) and super().is_node_supported(submodules, node)

    class ExpertPartitioner(CoreMLPartitioner):
        """Core ML's partitioner offered only the expert products, kept undecomposed only there."""

        def partition(self, edge_program):
            return tag_partitions(edge_program, ExpertSupport(), self.delegation_spec)

        def ops_to_not_decompose(self, ep):
            ops, _ = super().ops_to_not_decompose(ep)
            return ops, is_expert_product

    return ExpertPartitioner(compile_specs=compile_specs(), take_over_mutable_buffer=False)


def lower(programs: dict, constant_methods: dict):
    from executorch.exir import to_edge_transform_and_lower

    return to_edge_transform_and_lower(programs, partitioner=[_partitioner()], constant_methods=constant_methods)
