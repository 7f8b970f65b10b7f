"""Why the HTP refused a graph, in IR terms: which node, which ONNX op, which IR op it came from.

With CPU fallback disabled, ONNX Runtime's error names no node. The same model is
therefore opened once more with fallback allowed and ``session.record_ep_graph_assignment_info``,
and the nodes the CPU received are the ones the HTP rejected. ONNX node names start with
the IR op's output value (see :mod:`npumoe.backends.onnx_export`), which leads back to the IR op.

A node can also pass that check and fail later, when QNN finalizes the graph (e.g. GatherND
on a 16 MB input: QNN_COMMON_ERROR_MEM_ALLOC). QNN's log names no node then (its verbose log
only reports the capability check), so the smallest prefix of the graph that still fails to
compile is found by bisection; its last node is the culprit.
"""

from __future__ import annotations

from npumoe.backends.qualcomm_htp.qnn import session
from npumoe.core.base.errors import InputError
from npumoe.core.ir.graph import Graph


def rejected_nodes(model: bytes, soc: str, fp16: bool) -> list[tuple[str, str]] | None:
    """(node name, ONNX op type) of every node the HTP did not take; None if the graph fails even with
    CPU fallback allowed (i.e. at QNN's finalize, after every node passed the check)."""
    try:
        sess = session(model, soc, fp16, fallback=True, config={"session.record_ep_graph_assignment_info": "1"})
    except Exception:  # noqa: BLE001 - onnxruntime raises its own Fail/RuntimeException types
        return None
    return [(n.name, n.op_type) for sub in sess.get_provider_graph_assignment_info()
            if sub.ep_name != "QNNExecutionProvider" for n in sub.get_nodes()]


def _prefix(model, count: int) -> bytes:
    """The model cut after its first ``count`` nodes (topological order), every dangling value an output."""
    from onnx import helper

    nodes = model.graph.node[:count]
    consumed = {v for n in nodes for v in n.input}
    types = {v.name: v for v in [*model.graph.value_info, *model.graph.output]}
    outputs = [types.get(v) or helper.make_empty_tensor_value_info(v)
               for n in nodes for v in n.output if v not in consumed]
    graph = helper.make_graph(nodes, model.graph.name, model.graph.input, outputs, model.graph.initializer)
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version).SerializeToString()


def finalize_culprit(model: bytes, soc: str, fp16: bool) -> tuple[str, str]:
    """(node name, ONNX op type) of the first node whose graph prefix QNN fails to compile."""
    import onnx

    proto = onnx.shape_inference.infer_shapes(onnx.load_from_string(model))
    nodes = proto.graph.node
    lo, hi = 1, len(nodes)  # the whole graph fails
    while lo < hi:
        mid = (lo + hi) // 2
        if rejected_nodes(_prefix(proto, mid), soc, fp16) is None:
            hi = mid
        else:
            lo = mid + 1
    return nodes[lo - 1].name, nodes[lo - 1].op_type


def rejection_error(graph: Graph, model: bytes, soc: str, fp16: bool, err: Exception) -> InputError:
    """An InputError naming the first rejected node and its IR op (or QNN's own message)."""
    nodes = rejected_nodes(model, soc, fp16)
    if nodes is None:
        reason = str(err).split(" : ")[-1]
        name, op_type = finalize_culprit(model, soc, fp16)
        return InputError(f"node {name!r} ({_origin(graph, name, op_type)}) in graph {graph.name} is rejected by the "
                          f"HTP: QNN cannot compile it for SoC {soc} ({reason}); place this graph on the CPU in the "
                          "plan or change the op's lowering.")
    if not nodes:
        return InputError(f"the HTP (QNN) could not compile graph {graph.name} for SoC {soc}: {err}; "
                          "place this graph on the CPU in the plan (npumoe plan --residency cpu) or report it.")
    name, op_type = nodes[0]
    more = f" (and {len(nodes) - 1} more node(s))" if len(nodes) > 1 else ""
    return InputError(
        f"the HTP rejects node {name!r} ({_origin(graph, name, op_type)}) in graph {graph.name}{more}; with CPU "
        "fallback disabled it cannot run there: place this graph on the CPU in the plan or change the op's lowering."
    )


def _origin(graph: Graph, name: str, op_type: str) -> str:
    """'ONNX <op>, lowered from IR op '<op>' → <value>' for an ONNX node named after its IR value."""
    ir_value = name.split("/")[0]
    ir_op = next((op.op for op in graph.ops if ir_value in op.outputs), "?")
    return f"ONNX {op_type}, lowered from IR op {ir_op!r} → {ir_value}"
