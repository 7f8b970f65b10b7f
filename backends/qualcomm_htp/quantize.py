"""QDQ precisions for the HTP: 16-bit activations, 8- or 4-bit linear weights.

onnxruntime's QNN quantisation config inserts QuantizeLinear/DequantizeLinear pairs that
QNN folds into fixed-point HTP ops. Activation ranges come from calibration feeds (MinMax).
Linear weights ([in, out] MatMul initializers) are quantised per output channel (axis 1),
symmetrically: QNN's int4 is wrong with non-zero zero points and rejects unsigned int4 per
channel, so w4a16 uses signed int4; other initializers (norm weights, constants) get 8 bits
per tensor. :data:`SCHEMES` is also what the manifest records.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from npumoe.errors import InputError

SCHEMES = {
    "w8a16": {"activations": "uint16 per tensor (MinMax calibration)",
              "linear_weights": "uint8 per output channel, symmetric", "other_weights": "uint8 per tensor",
              "weight_type": "QUInt8"},
    "w4a16": {"activations": "uint16 per tensor (MinMax calibration)",
              "linear_weights": "int4 per output channel, symmetric (zero point 0)",
              "other_weights": "uint8 per tensor", "weight_type": "QInt4"},
}
PRECISIONS = ("fp16", *SCHEMES)


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise InputError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)} for the HTP.")


class _Feeds:
    """onnxruntime's CalibrationDataReader protocol over recorded feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]], names: set[str]):
        self._it = iter([{k: v for k, v in f.items() if k in names} for f in feeds])

    def get_next(self):
        return next(self._it, None)


def quantize(model, feeds: list[dict[str, np.ndarray]], precision: str):
    """The fp32 ``onnx.ModelProto`` with QDQ nodes for ``precision`` (w8a16 or w4a16)."""
    import onnx
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize as ort_quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    weight_type = getattr(QuantType, SCHEMES[precision]["weight_type"])
    linear = {n.input[1] for n in model.graph.node
              if n.op_type == "MatMul" and n.input[1] in {i.name for i in model.graph.initializer}}
    overrides = {name: [{"quant_type": weight_type, "axis": 1, "symmetric": True}] for name in sorted(linear)}
    reader = _Feeds(feeds, {i.name for i in model.graph.input})
    config = get_qnn_qdq_config(model, reader, activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8,
                                init_overrides=overrides, calibration_providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory(prefix="npumoe-qdq-") as tmp:
        out = Path(tmp) / "qdq.onnx"
        ort_quantize(model, out, config)
        return onnx.load(out)
