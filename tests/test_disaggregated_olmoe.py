"""ANE prefill -> MLX decode on a one-layer cut of an OLMoE-shaped model: OLMoE-1B-7B's architecture (64 experts,
top-8 without renormalising, full multi-head attention with q/k norms) at widths a test can build for the ANE in
seconds; the real widths' one layer is ~1 GB of bf16 and minutes of Core ML conversion a graph."""

import numpy as np
import pytest

pytest.importorskip("coremltools", reason="the ane target needs coremltools (pip install 'npumoe[ane]')")
pytest.importorskip("mlx.core", reason="the mlx target needs MLX (pip install 'npumoe[mlx]')", exc_type=ImportError)

import npumoe  # noqa: E402
from npumoe.core.tools.targets import build_targets  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def olmoe_cut(tmp_path_factory):
    from hf_compare import build_checkpoint, transformers

    config = transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None, pad_token_id=1)
    path = tmp_path_factory.mktemp("olmoe-cut")
    build_checkpoint(config, path, jitter=0.2)
    return npumoe.load(path)


def test_ane_prefill_then_mlx_decode_gives_the_cpu_reference_tokens(olmoe_cut, tmp_path):
    model, rng = olmoe_cut, np.random.default_rng(0)
    moe = model.spec.layers[0].ffn
    assert (model.spec.family, moe.num_experts, moe.top_k, moe.router.normalize) == ("olmoe", 64, 8, False)
    profile = npumoe.calibrate(model, [rng.integers(0, VOCAB, 256).tolist()], chunk=16)
    build_targets(model, ["ane", "mlx"], {}, rng.integers(0, VOCAB, 64), tmp_path / "build", chunk=16,
                  max_context=64, residency="npu", profile=profile, graphs_per_layer=1)
    ids = rng.integers(0, VOCAB, 40)  # three chunks of 16
    want = npumoe.Engine(model).generate(ids, 16)
    engine = npumoe.DisaggregatedEngine(model, "ane", "mlx", artifacts=tmp_path / "build")
    np.testing.assert_array_equal(engine.generate(ids, 16), want)
    assert engine.last_handoff.source == "AneExecutor state" and engine.last_handoff.length == 40
    assert engine.decode.metrics["npu_launches"] > 0  # decode ran on the mlx graphs, not the CPU
