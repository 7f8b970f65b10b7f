"""Why the HTP refused a graph, in IR terms: which node, which ONNX op, which IR op it came from.

With CPU fallback disabled, ONNX Runtime's error names no node. The same model is
therefore opened once more with fallback allowed and ``session.record_ep_graph_assignment_info``,
and the nodes the CPU received are the ones the HTP rejected. ONNX node names start with
the IR op's output value (see :mod:`.onnx_graph`), which leads back to the IR op.
"""

from __future__ import annotations

from npumoe.backends.qualcomm_htp.qnn import session
from npumoe.core.ir import Graph
from npumoe.errors import InputError


def rejected_nodes(model: bytes, soc: str, fp16: bool) -> list[tuple[str, str]]:
    """(node name, ONNX op type) of every node the HTP did not take."""
    try:
        sess = session(model, soc, fp16, fallback=True, config={"session.record_ep_graph_assignment_info": "1"})
    except Exception:  # noqa: BLE001 - it failed beyond node assignment: the caller reports the original error
        return []
    return [(n.name, n.op_type) for sub in sess.get_provider_graph_assignment_info()
            if sub.ep_name != "QNNExecutionProvider" for n in sub.get_nodes()]


def rejection_error(graph: Graph, model: bytes, soc: str, fp16: bool, err: Exception) -> InputError:
    """An InputError naming the first rejected node and its IR op (or QNN's own message)."""
    nodes = rejected_nodes(model, soc, fp16)
    if not nodes:
        return InputError(f"the HTP (QNN) could not compile graph {graph.name} for SoC {soc}: {err}; "
                          "place this graph on the CPU in the plan (npumoe plan --residency cpu) or report it.")
    name, op_type = nodes[0]
    ir_value = name.split("/")[0]
    ir_op = next((op.op for op in graph.ops if ir_value in op.outputs), "?")
    more = f" (and {len(nodes) - 1} more node(s))" if len(nodes) > 1 else ""
    return InputError(
        f"the HTP rejects node {name!r} (ONNX {op_type}, lowered from IR op {ir_op!r} → {ir_value}) in graph "
        f"{graph.name}{more}; with CPU fallback disabled it cannot run there: place this graph on the CPU in the "
        "plan or change the op's lowering."
    )
