"""The pieces under the ANE backend, each against an independent truth: coremltools' own blob
writer and decompression ops, and the reference CPU executor for attention at long chunks."""

import importlib.util

import numpy as np
import pytest
import torch
from hf_compare import build_checkpoint, transformers

import npumoe
from npumoe.backends.apple_ane import rules
from npumoe.backends.apple_ane.backend import AneBackend
from npumoe.backends.apple_ane.caps import ANE_CAPS
from npumoe.backends.apple_ane.layout import LOWER
from npumoe.backends.apple_ane.mil_exec import blockwise_shift_scale, lut_to_dense
from npumoe.backends.apple_ane.mlpackage import SPEC_PATH, BlobFile, Package
from npumoe.backends.apple_ane.passes import SLICED_Q_MIN_SEQ, SLICED_Q_SLICE
from npumoe.core.compiler.graphs import attention_graph
from npumoe.core.compiler.interpreter import TorchGraphExecutor
from npumoe.core.runtime.kvcache import attention_mask

pytestmark = pytest.mark.skipif(importlib.util.find_spec("coremltools") is None,
                                reason="coremltools is not installed (pip install 'npumoe[ane]')")

BLOB_CASES = {  # MIL dtype → (coremltools writer method, values)
    "FLOAT16": ("write_fp16_data", np.array([1.5, -2.25, 65504.0, 6e-5], np.float16)),
    "FLOAT32": ("write_float_data", np.array([1e-30, -3.5, 7.0], np.float32)),
    "INT8": ("write_int8_data", np.array([-128, 0, 127], np.int8)),
    "UINT8": ("write_uint8_data", np.array([0, 200, 255], np.uint8)),
    "INT16": ("write_int16_data", np.array([-32768, 5, 32767], np.int16)),
    "UINT16": ("write_uint16_data", np.array([0, 40000, 65535], np.uint16)),
    "INT32": ("write_int32_data", np.array([-(2**31), 9, 2**31 - 1], np.int32)),
    "UINT32": ("write_uint32_data", np.array([0, 7, 2**32 - 1], np.uint32)),
    "INT4": ("write_int4_data", np.array([-8, 7, 3, -1, 0, 5, -6], np.int8)),
    "UINT4": ("write_uint4_data", np.array([0, 15, 9, 3, 12], np.uint8)),
    "UINT6": ("write_uint6_data", np.array([0, 63, 17, 42, 5], np.uint8)),
    "UINT3": ("write_uint3_data", np.array([0, 7, 5, 2, 6, 1, 3], np.uint8)),
    "UINT2": ("write_uint2_data", np.array([0, 3, 2, 1, 1, 2, 3, 0, 2], np.uint8)),
    "UINT1": ("write_uint1_data", np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1], np.uint8)),
}


def test_weight_blob_reader_matches_coremltools_writer(tmp_path):
    from coremltools.libmilstoragepython import _BlobStorageWriter

    writer = _BlobStorageWriter(str(tmp_path / "weight.bin"))
    offsets = {dtype: getattr(writer, method)(values.view(np.uint16) if dtype == "FLOAT16" else values)  # fp16 as bits
               for dtype, (method, values) in BLOB_CASES.items()}
    del writer  # flushes
    blob = BlobFile(tmp_path / "weight.bin")
    for dtype, (_, values) in BLOB_CASES.items():
        np.testing.assert_array_equal(blob.read(offsets[dtype], dtype, values.shape), values, err_msg=dtype)


def test_constexpr_decompression_matches_coremltools():
    from coremltools.converters.mil.mil.ops.defs.iOS18.compression import (
        constexpr_blockwise_shift_scale,
        constexpr_lut_to_dense,
    )

    rng = np.random.default_rng(0)
    data = rng.integers(-8, 8, (8, 64, 1, 1)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, (8, 2, 1, 1)).astype(np.float16)
    offset = rng.integers(-2, 3, (8, 2, 1, 1)).astype(np.int8)
    for off in (None, offset):
        np.testing.assert_allclose(blockwise_shift_scale(data, scale, off),
                                   constexpr_blockwise_shift_scale.decompress(data, scale, off), rtol=1e-3)
    indices = rng.integers(0, 16, (32, 16, 1, 1)).astype(np.uint8)
    lut = rng.normal(size=(2, 1, 1, 1, 16, 1)).astype(np.float16)  # one palette per 16 output channels
    np.testing.assert_array_equal(lut_to_dense(indices, lut), constexpr_lut_to_dense.decompress(indices, lut, None))


def test_caps_and_lowering_come_from_the_rule_table():
    assert set(LOWER) == set(rules.IR_LOWERING)  # layout.py lowers exactly the IR ops the table lists
    assert ANE_CAPS.ops == rules.ir_ops_on_ane() and "lut_linear" not in ANE_CAPS.ops
    assert ANE_CAPS.max_graph_bytes <= min(rules.MAX_GRAPH_WEIGHT_BYTES, *rules.MAX_PACKAGE_BYTES.values())
    assert not set(rules.REJECTED_OPS) & rules.ANE_OPS


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """head_dim 16: the states pad it to 32; one KV head for two query heads (GQA)."""
    path = tmp_path_factory.mktemp("small")
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2)
    build_checkpoint(cfg, path)
    return npumoe.load(path)


def test_long_chunks_use_sliced_q_attention_and_match_the_reference(small, tmp_path):
    seq, context = 2 * SLICED_Q_MIN_SEQ, 512
    start = seq  # prefill chunks start at multiples of the chunk
    graph = attention_graph(small.spec, 0, seq, context)
    backend = AneBackend()
    artifact = backend.lower(graph, small.weights, tmp_path)
    ops = [op.type for op in Package(tmp_path / artifact.info["package"]).operations(artifact.info["function"])]
    assert "scaled_dot_product_attention" not in ops and ops.count("softmax") == seq // SLICED_Q_SLICE
    assert artifact.info["states"]["shapes"]["k_cache"] == [1, 1, context, 32]  # head_dim 16 padded to 32

    # The engine's protocol: a first chunk at position 0 (its first `start` rows valid), then one at `start`.
    torch.manual_seed(0)
    att, reference = small.spec.layers[0].attention, TorchGraphExecutor(graph, small.weights)
    run = backend.load(artifact, tmp_path, graph, small.weights)
    first = {n: torch.randn(t.shape) if n in ("x", "cos", "sin") else torch.zeros(t.shape)
             for n, t in graph.inputs.items()}
    first["mask"] = attention_mask(att, 0, seq, start, context)
    run({**first, "position": torch.tensor([0])})
    cache = reference(first)
    second = {n: torch.randn(t.shape) for n, t in graph.inputs.items()}
    second["mask"] = attention_mask(att, start, seq, seq - 7, context)
    for name, new in (("k_cache", "k_new"), ("v_cache", "v_new")):
        second[name] = torch.zeros(graph.inputs[name].shape)
        second[name][:, :start] = cache[new][:, :start]
    got, want = run({**second, "position": torch.tensor([start])}), reference(second)
    for name in want:
        rows = slice(0, seq - 7) if name in ("h", "z") else slice(None)  # padding rows only see themselves
        assert float((got[name][rows] - want[name][rows]).norm() / want[name][rows].norm()) < 3e-3, name
    written = run.runtime.states["k_cache"][0, 0, start:start + seq, :16]  # this chunk's keys, at `position`
    np.testing.assert_allclose(written, want["k_new"][0].numpy(), rtol=0, atol=2e-2)


def test_a_wide_lm_head_is_split_into_convs_and_matches_the_reference(small, tmp_path, monkeypatch):
    from npumoe.backends.apple_ane import layout
    from npumoe.core.compiler.graphs import lm_head_graph

    monkeypatch.setattr(layout, "CONV_ROWS", 48)  # the demo vocab in 48-row kernels plus a remainder
    graph = lm_head_graph(small.spec, 8)
    artifact = AneBackend().lower(graph, small.weights, tmp_path)
    ops = [op.type for op in Package(tmp_path / artifact.info["package"]).operations(artifact.info["function"])]
    assert ops.count("conv") == -(-small.spec.vocab_size // 48) and "concat" in ops
    x = {"x": torch.randn(graph.inputs["x"].shape)}
    got = AneBackend().load(artifact, tmp_path, graph, small.weights)(x)["logits"]
    want = TorchGraphExecutor(graph, small.weights)(x)["logits"]
    assert float((got - want).norm() / want.norm()) < 3e-3


def test_an_lm_head_wider_than_the_channel_axis_leaves_in_parts(small, tmp_path, monkeypatch):
    """Qwen3's 151,936 logits exceed the ANE's 65,536-channel axis: the function returns them in parts of at
    most that many channels (never the whole width on the device) and the executor joins them. Here the
    limit is lowered to 32 so the demo-sized vocabulary (64) needs two parts of two 16-row convs each."""
    from npumoe.backends.apple_ane import layout
    from npumoe.core.compiler.graphs import lm_head_graph

    monkeypatch.setattr(layout, "CONV_ROWS", 16)
    monkeypatch.setattr(layout, "MAX_CHANNELS", 32)
    graph = lm_head_graph(small.spec, 4)  # not the 8-row graph the test above leaves in the build cache
    artifact = AneBackend().lower(graph, small.weights, tmp_path)
    package = Package(tmp_path / artifact.info["package"])
    assert artifact.info["function_outputs"]["logits"]["parts"] == ["logits_0", "logits_1"]
    assert [o.name for o in package.description(artifact.info["function"]).output] == ["logits_0", "logits_1"]
    x = {"x": torch.randn(graph.inputs["x"].shape)}
    got = AneBackend().load(artifact, tmp_path, graph, small.weights)(x)["logits"]
    want = TorchGraphExecutor(graph, small.weights)(x)["logits"]
    assert got.shape == want.shape and float((got - want).norm() / want.norm()) < 3e-3


def test_merged_multifunction_package_is_what_coremltools_writes(tmp_path):
    """Our streaming merge against coremltools' save_multifunction: the same spec (blob offsets aside),
    the same value behind every blob reference, and a shared weight stored once."""
    import coremltools as ct
    from coremltools.models.utils import MultiFunctionDescriptor, save_multifunction

    from npumoe.backends.apple_ane.mlpackage import blob_values
    from npumoe.backends.apple_ane.multifunction import merge

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).half().eval()
    singles = {}
    for name, rows in (("prefill", 4), ("decode", 1)):
        traced = torch.jit.trace(layer, torch.zeros(rows, 64, dtype=torch.float16))
        mlmodel = ct.convert(traced, inputs=[ct.TensorType(name="x", shape=(rows, 64), dtype=np.float16)],
                             outputs=[ct.TensorType(name="y", dtype=np.float16)], convert_to="mlprogram",
                             minimum_deployment_target=ct.target.iOS18, skip_model_load=True)
        singles[name] = tmp_path / f"{name}.mlpackage"
        mlmodel.save(str(singles[name]))
    desc = MultiFunctionDescriptor()
    for name, path in singles.items():
        desc.add_function(str(path), src_function_name="main", target_function_name=name)
    desc.default_function_name = "prefill"
    save_multifunction(desc, str(tmp_path / "theirs.mlpackage"))
    merge(singles, tmp_path / "ours.mlpackage")

    def contents(path):
        package = Package(path)
        values = {(f, op.outputs[0].name): package.value(v).copy()
                  for f in package.functions for op in package.operations(f) for v in blob_values(op)}
        spec = type(package.spec)()
        spec.CopyFrom(package.spec)
        for function in spec.mlProgram.functions.values():
            for op in function.block_specializations[function.opset].operations:
                for v in blob_values(op):
                    v.blobFileValue.offset = 0
        blob_bytes = (path / SPEC_PATH.parent / "weights" / "weight.bin").stat().st_size
        return spec, values, blob_bytes

    (ours, our_values, our_bytes), (theirs, their_values, their_bytes) = map(
        contents, (tmp_path / "ours.mlpackage", tmp_path / "theirs.mlpackage"))
    assert ours == theirs
    assert our_values.keys() == their_values.keys()
    assert all(np.array_equal(our_values[k], their_values[k]) for k in our_values)
    assert our_bytes == their_bytes < 2 * sum(p.numel() * 2 for p in layer.parameters())  # stored once
    ct.models.MLModel(str(tmp_path / "ours.mlpackage"), skip_model_load=True, function_name="decode")
