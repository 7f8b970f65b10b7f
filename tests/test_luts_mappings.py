"""Each backend mapping, run through a numpy model of its op, gives exactly the spec's weights;
where the real tools are installed (coremltools, onnx, onnxruntime) they agree too."""

import numpy as np
import pytest

from npumoe.core.base.errors import InputError
from npumoe.luts import mappings, spec

FORMATS = [(b, s) for b in spec.BITS for s in (False, True) if not (s and b == 1)]
RANGES = {"int4": (-8, 7), "int8": (-128, 127)}


def packed_weight(bits, symmetric, group=32, n=24, k=128, seed=0):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return spec.quantize_pack(w, bits, group, symmetric)


def blocks(per_block, shape):
    """Repeat a per-block array up to the full shape (the block size is shape / its shape)."""
    for axis, (full, part) in enumerate(zip(shape, per_block.shape)):
        per_block = np.repeat(per_block, full // part, axis=axis)
    return per_block


def shift_scale_model(m):  # constexpr_blockwise_shift_scale: scale · (data − offset), in the scale's type
    offset = 0 if m.offset is None else blocks(m.offset.astype(np.float32), m.data.shape)
    return ((m.data.astype(np.float32) - offset)
            * blocks(m.scale.astype(np.float32), m.data.shape)).astype(m.scale.dtype)


def lut_model(m):  # constexpr_lut_to_dense, scalar palettes: lut[block(n), block(k), index, 0]
    rows, cols = np.indices(m.indices.shape)
    n_blocks, k_blocks = m.lut.shape[:2]
    return m.lut[rows // (m.indices.shape[0] // n_blocks), cols // (m.indices.shape[1] // k_blocks), m.indices, 0]


def dequantize_linear_model(m):  # ONNX DequantizeLinear: (x − zero_point) · scale, blocked or per axis
    shape = m.data.shape
    if m.block_size is None:
        scale = np.expand_dims(m.scale, 1 - m.axis).astype(np.float32)
        zero = np.expand_dims(m.zero_point, 1 - m.axis).astype(np.float32)
    else:
        scale, zero = (np.repeat(a.astype(np.float32), m.block_size, axis=m.axis) for a in (m.scale, m.zero_point))
    return ((m.data.astype(np.float32) - zero) * np.broadcast_to(scale, shape)).astype(m.scale.dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bits, symmetric", FORMATS)
def test_core_ml_mappings_dequantise_exactly(bits, symmetric, dtype):
    packed = packed_weight(bits, symmetric)
    expected = spec.dequantize(packed).astype(dtype)  # exact in fp32; fp16 rounds the same values
    shifted = mappings.blockwise_shift_scale(packed, dtype)
    lo, hi = RANGES[shifted.dtype]
    assert shifted.dtype == ("int4" if bits <= 4 else "int8") and lo <= shifted.data.min() <= shifted.data.max() <= hi
    assert (shifted.offset is None) == symmetric
    assert np.array_equal(shift_scale_model(shifted), expected)
    palette = mappings.lut_to_dense(packed, dtype)
    index_bits = {5: 6}.get(bits, bits)  # Core ML has no uint5
    assert palette.dtype == f"uint{index_bits}" and palette.indices.max() < 2**bits
    assert palette.lut.shape == (24, 4, 2**index_bits, 1) and not np.any(palette.lut[:, :, 2**bits:])
    assert np.array_equal(lut_model(palette), expected)


@pytest.mark.parametrize("bits, symmetric", FORMATS)
def test_qdq_blocked_dequantises_exactly(bits, symmetric):
    packed = packed_weight(bits, symmetric)
    qdq = mappings.qdq_blocked(packed)
    lo, hi = RANGES[qdq.dtype]
    assert (qdq.axis, qdq.block_size) == (1, 32) and lo <= qdq.data.min() and qdq.data.max() <= hi
    assert np.array_equal(dequantize_linear_model(qdq), spec.dequantize(packed))
    assert mappings.qdq_symmetric_int4(packed) == (symmetric and bits <= 4)


def test_qdq_per_channel_only_when_groups_agree():
    rng = np.random.default_rng(3)
    scales = np.repeat(rng.uniform(0.01, 0.1, (8, 1)).astype(np.float16), 4, axis=1)
    zeros = np.repeat(rng.integers(0, 16, (8, 1)), 4, axis=1).astype(np.uint8)
    packed = spec.pack(rng.integers(0, 16, (8, 128)), scales, zeros, 4, 32, symmetric=False)
    qdq = mappings.qdq_per_channel(packed)
    assert (qdq.axis, qdq.block_size, qdq.scale.shape) == (0, None, (8,))
    assert np.array_equal(dequantize_linear_model(qdq), spec.dequantize(packed))
    with pytest.raises(InputError, match="no per-channel form"):
        mappings.qdq_per_channel(packed_weight(4, False))


def test_unsupported_dtypes_are_refused():
    with pytest.raises(InputError, match="scale dtype int32"):
        mappings.blockwise_shift_scale(packed_weight(4, False), np.int32)
    with pytest.raises(InputError, match="palette dtype float64"):
        mappings.lut_to_dense(packed_weight(4, False), np.float64)


@pytest.mark.parametrize("bits, symmetric", [(2, False), (3, True), (4, False), (5, True), (8, True)])
def test_models_agree_with_coremltools(bits, symmetric):
    compression = pytest.importorskip("coremltools.converters.mil.mil.ops.defs.iOS18.compression")
    packed = packed_weight(bits, symmetric)
    shifted, palette = mappings.blockwise_shift_scale(packed), mappings.lut_to_dense(packed)
    real = compression.constexpr_blockwise_shift_scale.decompress(shifted.data, shifted.scale, shifted.offset)
    assert np.array_equal(real, shift_scale_model(shifted))
    assert np.array_equal(compression.constexpr_lut_to_dense.decompress(palette.indices, palette.lut, None),
                          lut_model(palette))


@pytest.mark.parametrize("bits, symmetric", [(2, False), (4, False), (4, True), (5, True), (8, False)])
def test_model_agrees_with_onnx_and_onnxruntime(bits, symmetric):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    qdq = mappings.qdq_blocked(packed_weight(bits, symmetric))
    kind = TensorProto.INT4 if qdq.dtype == "int4" else TensorProto.INT8
    inits = [helper.make_tensor("x", kind, qdq.data.shape, qdq.data.ravel().tolist()),
             numpy_helper.from_array(qdq.scale, "scale"),
             helper.make_tensor("zero", kind, qdq.zero_point.shape, qdq.zero_point.ravel().tolist())]
    node = helper.make_node("DequantizeLinear", ["x", "scale", "zero"], ["y"], axis=qdq.axis, block_size=qdq.block_size)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, qdq.data.shape)
    model = helper.make_model(helper.make_graph([node], "dq", [], [out], initializer=inits),
                              opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    expected = dequantize_linear_model(qdq)
    assert np.array_equal(ReferenceEvaluator(model).run(None, {})[0], expected)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.array_equal(session.run(None, {})[0], expected)
