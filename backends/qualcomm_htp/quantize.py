"""QDQ precisions for the HTP: 16-bit activations, 8- or 4-bit linear weights.

onnxruntime's QNN quantisation config inserts QuantizeLinear/DequantizeLinear pairs that
QNN folds into fixed-point HTP ops. Activation ranges come from calibration feeds (MinMax).
Linear weights ([in, out] MatMul initializers) are symmetric (QNN's int4 is wrong with non-zero
zero points): w8a16 per output channel from onnxruntime's quantiser; w4a16's routed experts in
blocks of 32 inputs with the codes and scales of :func:`npumoe.models.checkpoints.lut.npu_codes` in
:data:`npumoe.luts.mappings.NPU_INT4` (onnxruntime places the QDQ nodes, luts fills them): the
values the ANE's int4 packages and the CPU LUT kernels hold. Other initializers (norm weights,
constants) get 8 bits per tensor. :data:`SCHEMES` is also what the manifest records.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from npumoe.core.base.errors import InputError

SCHEMES = {
    "w8a16": {"activations": "uint16 per tensor (MinMax calibration)",
              "linear_weights": "uint8 per output channel, symmetric", "other_weights": "uint8 per tensor",
              "weight_type": "QUInt8"},
    "w4a16": {"activations": "uint16 per tensor (MinMax calibration)",
              "linear_weights": "routed experts int4 symmetric, one scale per 32 inputs (npumoe.luts codes: the "
                                "ANE's and CPU's); other linears as w8a16",
              "other_weights": "uint8 per tensor", "weight_type": "QInt4"},
}
PRECISIONS = ("fp16", *SCHEMES)
INT4_KINDS = frozenset({"experts"})  # graph kinds w4a16 holds in int4; the others get w8a16's weights


def precision_for(kind: str, precision: str) -> str:
    """The precision a graph of ``kind`` is built at: w4a16 is int4 routed experts (nearly all of an MoE's
    bytes, as on the ANE), with attention, dense FFNs and the LM head at 8 bits, the most sensitive to
    4-bit error (demo, held-out text: all-int4 92.7 % top-1 agreement with fp32)."""
    return "w8a16" if precision == "w4a16" and kind not in INT4_KINDS else precision


# bits a stored weight takes (int4: one fp16 scale per 32 codes, as the luts codes hold it: npumoe's estimate of
# QNN's own packing, which is unpublished)
BITS = {"fp16": 16.0, "w8a16": 8.0, "w4a16": 4 + 16 / 32}


def weight_bits(kind: str, precision: str) -> float:
    """Bits one stored weight of a graph of ``kind`` takes at ``precision`` (the cost model's memory budget)."""
    return BITS[precision_for(kind, checked_precision(precision))]


SHARED_NAMES = {"int4": "w4a16"}  # the name every target gives its luts int4 experts (ANE: int4)


def checked_precision(precision: str) -> str:
    """``precision`` as the HTP names it (``int4`` is w4a16), or an InputError listing the choices."""
    precision = SHARED_NAMES.get(precision, precision)
    if precision not in PRECISIONS:
        raise InputError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)} (or int4 = w4a16) "
                         "for the HTP.")
    return precision


class _Feeds:
    """onnxruntime's CalibrationDataReader protocol over recorded feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]], names: set[str]):
        self._it = iter([{k: v for k, v in f.items() if k in names} for f in feeds])

    def get_next(self):
        return next(self._it, None)


def quantize(model, feeds: list[dict[str, np.ndarray]], precision: str, weights: Mapping[str, torch.Tensor]):
    """The fp32 ``onnx.ModelProto`` with QDQ nodes for ``precision`` (w8a16 or w4a16); ``weights`` are the
    graph's, whose int4 codes w4a16 takes."""
    import onnx
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize as ort_quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    weight_type = getattr(QuantType, SCHEMES[precision]["weight_type"])
    initializers = {i.name for i in model.graph.initializer}
    linear = {n.name: n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in initializers}
    overrides = {name: [{"quant_type": weight_type, "axis": 1, "symmetric": True}]
                 for name in sorted(set(linear.values()))}
    reader = _Feeds(feeds, {i.name for i in model.graph.input})
    with tempfile.TemporaryDirectory(prefix="npumoe-qdq-") as tmp, _quantiser_advice_dropped():
        config = get_qnn_qdq_config(model, reader, activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8,
                                    init_overrides=overrides, calibration_providers=["CPUExecutionProvider"])
        out = Path(tmp) / "qdq.onnx"
        ort_quantize(model, out, config)
        quantized = onnx.load(out)
    if precision == "w4a16":
        _put_luts_codes(quantized, linear, weights)
    return quantized


@contextmanager
def _quantiser_advice_dropped() -> Iterator[None]:
    """onnxruntime's quantiser logs the same advice twice per graph through the root logger ("consider
    pre-processing before quantization", its generic ONNX clean-up, which npumoe's exported graphs skip on purpose:
    the HTP takes them as they are): a user of npumoe build cannot act on it. Only records logged from
    onnxruntime's own files are dropped, and only while the quantiser runs."""
    import onnxruntime

    source = str(Path(onnxruntime.__file__).parent)

    def not_onnxruntimes(record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(source)

    root = logging.getLogger()
    root.addFilter(not_onnxruntimes)
    try:
        yield
    finally:
        root.removeFilter(not_onnxruntimes)


def _put_luts_codes(model, linear: dict[str, str], weights: Mapping[str, torch.Tensor]) -> None:
    """Replace the per-channel int4 of each linear weight's DequantizeLinear with luts' blocked codes.

    ``linear`` maps MatMul node names (kept by the quantiser) to their weight initializers, which the
    ONNX export names ``<canonical name>.T`` ([in, out]); the DequantizeLinear is made blocked along
    the inputs (axis 0), its data the codes' transpose and its scales [in / 32, out].
    """
    import ml_dtypes
    from onnx import helper, numpy_helper

    from npumoe.backends.onnx_export import TRANSPOSED
    from npumoe.luts import mappings
    from npumoe.models.checkpoints.lut import npu_codes

    producer = {out: node for node in model.graph.node for out in node.output}
    initializers = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.name not in linear:
            continue
        dq = producer[node.input[1]]
        qdq = mappings.qdq_blocked(npu_codes(weights, linear[node.name].removesuffix(TRANSPOSED), mappings.NPU_INT4))
        arrays = {dq.input[0]: qdq.data.T, dq.input[1]: qdq.scale.T, dq.input[2]: qdq.zero_point.T}
        for name, array in arrays.items():
            dtype = ml_dtypes.int4 if array.dtype == np.int8 else np.float32
            initializers[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array).astype(dtype), name))
        del dq.attribute[:]
        dq.attribute.extend([helper.make_attribute("axis", 0), helper.make_attribute("block_size", qdq.block_size)])
