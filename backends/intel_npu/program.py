"""Intel's NPU in ``npumoe export``: the expert products through ExecuTorch's OpenVINO backend, compiled by OpenVINO
when the program loads, for its CPU device (the only one here; ``DEVICE``), the rest on ExecuTorch's CPU kernels.

OpenVINO is offered only the nodes ``npumoe export`` marks as expert products: offered everything its partitioner
takes (the masks, gathers and cache index arithmetic too), the program crashed inside OpenVINO's CPU plugin on its
first call here (SIGSEGV in a memcpy under ``ov_infer_request_infer``)."""

from __future__ import annotations

from pathlib import Path

from npumoe.backends.partition import tag_partitions
from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.ir.backend import RunnerSetup, is_expert_product

DEVICE = "CPU"


def _partitioner():
    try:
        from executorch.backends.openvino.partitioner import OpenvinoBackend, OpenvinoOperatorsSupport
    except ImportError as err:  # its package imports nncf (its quantizer's) and openvino
        raise BackendUnavailableError(f"npumoe export --target intel_npu needs ExecuTorch's OpenVINO partitioner, which "
                                      f"did not import ({err}); install pip install nncf openvino.") from err
    from executorch.exir.backend.compile_spec_schema import CompileSpec
    from executorch.exir.backend.partitioner import DelegationSpec, Partitioner

    class ExpertSupport(OpenvinoOperatorsSupport):
        def is_node_supported(self, submodules, node) -> bool:
            return is_expert_product(node) and super().is_node_supported(submodules, node)

    class ExpertPartitioner(Partitioner):
        """OpenVINO's partitioner offered only the expert products (its own is final, and its op_names_to_skip is read
        only for ops it does not support)."""

        def __init__(self):
            self.delegation_spec = DelegationSpec(OpenvinoBackend.__name__, [CompileSpec("device", DEVICE.encode())])

        def partition(self, edge_program):
            return tag_partitions(edge_program, ExpertSupport(set(), set(), set()), self.delegation_spec)

    return ExpertPartitioner()


def lower(programs: dict, constant_methods: dict):
    from executorch.exir import to_edge_transform_and_lower

    return to_edge_transform_and_lower(programs, partitioner=[_partitioner()], constant_methods=constant_methods)


def runner_setup() -> RunnerSetup:
    """ExecuTorch's OpenVINO backend opens OpenVINO's C library when a program loads: the openvino wheel's, here."""
    import openvino

    library = next(iter(sorted((Path(openvino.__file__).parent / "libs").glob("libopenvino_c.so*"))))
    return RunnerSetup(env={"OPENVINO_LIB_PATH": str(library)})
