"""GPTQ import against tensors packed here, value by value, the way GPTQ writes them."""

import numpy as np
import pytest
from gptq_pack import pack_words

from npumoe.core.base.errors import WeightError
from npumoe.luts import gptq, spec


def gptq_tensors(bits, n=64, k=256, group=64, version="v2", seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (n, k))
    z = rng.integers(1, 2**bits, (n, k // group))  # ≥ 1: v1 stores z − 1
    s = rng.uniform(0.001, 0.1, (n, k // group)).astype(np.float16)
    stored = z - gptq.ZERO_OFFSET[version]
    return q, z, s, pack_words(q, bits).T, pack_words(stored.T, bits), s.T


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_import_reproduces_codes_zeros_and_weights(bits, version):
    q, z, s, qweight, qzeros, scales = gptq_tensors(bits, version=version)
    packed = gptq.from_gptq(qweight, qzeros, scales, bits, 64, g_idx=np.arange(256) // 64, version=version)
    assert np.array_equal(spec.unpack(packed), q) and np.array_equal(packed.zeros, z)
    assert np.array_equal(packed.scales, s) and not packed.meta.symmetric
    gptq_weights = s.astype(np.float32).repeat(64, axis=1) * (q - z.repeat(64, axis=1))
    assert np.array_equal(spec.dequantize(packed), gptq_weights)


def test_symmetric_checkpoints_are_recognised():
    q, z, s, qweight, _, scales = gptq_tensors(4)
    qzeros = pack_words(np.full((4, 64), 8), 4)
    assert gptq.from_gptq(qweight, qzeros, scales, 4, 64, version="v2").meta.symmetric


def test_act_order_wrapped_zeros_and_bad_shapes_are_refused():
    _, _, _, qweight, qzeros, scales = gptq_tensors(4)
    with pytest.raises(WeightError, match="act-order"):
        gptq.from_gptq(qweight, qzeros, scales, 4, 64, g_idx=np.random.default_rng(0).permutation(256) // 64)
    with pytest.raises(WeightError, match="GPTQ scales has shape"):
        gptq.from_gptq(qweight, qzeros, scales[:2], 4, 64)
    with pytest.raises(WeightError, match="GPTQ qzeros has shape"):
        gptq.from_gptq(qweight, qzeros, scales, 4, 32)
    with pytest.raises(WeightError, match="qweight must be a 2-D int32"):
        gptq.from_gptq(qweight.astype(np.int64), qzeros, scales, 4, 64)
    wrapped = pack_words(np.full((4, 64), 15), 4)  # v1 storing −1: zero point 16
    with pytest.raises(WeightError, match="reaches 2\\^4"):
        gptq.from_gptq(qweight, wrapped, scales, 4, 64, version="v1")
    with pytest.raises(WeightError, match="float16 cannot hold exactly"):
        gptq.from_gptq(qweight, qzeros, scales.astype(np.float32) + np.float32(1e-6), 4, 64)
