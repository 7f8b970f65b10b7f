"""The HTP's part of ``npumoe export``: the expert products delegated to QNN through ExecuTorch's QNN backend (fp16,
the default SoC), everything else on ExecuTorch's CPU kernels.

Only the nodes ``npumoe export`` marks as expert products (:data:`~npumoe.core.ir.backend.EXPERT_REGION`) go to QNN:
with every float op QNN's partitioner takes (attention, norms, routing, the cache writes' gathers as well), the demo's
prefill logits were wrong here (max |Δ| 1.06 × the largest logit), with the expert products alone right (7.5e-5).
Each method is lowered on its own: QNN's multi-method lowering wants every method cut into as many partitions.
RMSNorm divides by the root mean square (:data:`.pte.IMPLS`): QNN's passes recompose the rsqrt form into
``aten.rms_norm``, which has no ExecuTorch CPU kernel when it is not delegated.
"""

from __future__ import annotations

import os
from pathlib import Path

from npumoe.core.ir.backend import RunnerSetup, is_expert_product


def _partitioner(specs):
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner

    class ExpertPartitioner(QnnPartitioner):
        """QNN's partitioner, offered only the expert products (kept undecomposed only where it takes them)."""

        def generate_partitions(self, edge_program):
            self.skip_node_id_set = {n.name for n in edge_program.graph_module.graph.nodes
                                     if n.op == "call_function" and not is_expert_product(n)}
            return super().generate_partitions(edge_program)

        def ops_to_not_decompose(self, ep):
            ops, keep = super().ops_to_not_decompose(ep)
            return ops, lambda node: keep(node) and is_expert_product(node)

    return ExpertPartitioner(specs, skip_mutable_buffer=True)  # the KV cache stays ExecuTorch's, shared by methods


def lower(programs: dict, constant_methods: dict):
    from npumoe.backends.qualcomm_htp.pte import _executorch
    from npumoe.backends.qualcomm_htp.qnn import DEFAULT_SOC, chipset

    utils = _executorch()
    from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext
    from executorch.exir import EdgeProgramManager, to_edge_transform_and_lower

    specs = utils.generate_qnn_executorch_compiler_spec(
        soc_model=utils.get_soc_to_chipset_map()[chipset(DEFAULT_SOC)],
        backend_options=utils.generate_htp_compiler_spec(use_fp16=True))
    lowered = {}
    for name, program in programs.items():
        passes = get_qnn_pass_manager_cls()()
        with QnnManagerContext({name: specs}):
            edge = to_edge_transform_and_lower(
                {name: passes.transform_for_export_pipeline(program)},
                transform_passes={name: passes.get_to_edge_transform_passes(program, compiler_specs=specs)},
                partitioner={name: [_partitioner(specs)]}, compile_config=utils.qnn_edge_config())
        lowered[name] = edge.exported_program(name)
    return EdgeProgramManager(lowered, constant_methods=constant_methods, compile_config=utils.qnn_edge_config())


def runner_setup() -> RunnerSetup:
    """What npumoe-run loads before the program on this machine: QNN's HTP and system libraries by path (ExecuTorch's
    QNN backend opens them by name, and gets the loaded ones), with the QNN shim's real library and the C++ runtime
    onnxruntime-qnn vendors for them (:mod:`.shim`); a QNN SDK of one's own (``QNN_SDK_ROOT``) needs neither."""
    from npumoe.backends.qualcomm_htp.shim import LIB_SUBDIR, qnn_sdk_root

    lib = qnn_sdk_root() / LIB_SUBDIR
    real = os.environ.get("QNN_SHIM_REAL_HTP")
    vendored = sorted(Path(real).parent.parent.glob("onnxruntime_qnn.libs/*.so*")) if real else []
    return RunnerSetup(env={"QNN_SHIM_REAL_HTP": real} if real else {},
                       preload=tuple(str(p) for p in (*vendored, lib / "libQnnHtp.so", lib / "libQnnSystem.so")))
