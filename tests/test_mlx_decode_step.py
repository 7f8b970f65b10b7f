"""The mlx target's whole-step decode (backends/mlx/step.py): one MLX graph a token over a KV cache kept on the
device. Against the CPU reference engine (the interpreter on the host cache): the same greedy tokens and logits
over a decode longer than the cache's growth step, the same cache handed back to the host, and the cache loaded
onto the device once a sequence, not once a token."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the mlx target needs MLX (pip install 'npumoe[mlx]')",
                         exc_type=ImportError)

from hf_compare import build_checkpoint, transformers  # noqa: E402

import npumoe  # noqa: E402
from npumoe.backends.mlx import step as mlx_step  # noqa: E402
from npumoe.core.compiler.artifacts import build  # noqa: E402

ARCH = dict(vocab_size=97, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=512, eos_token_id=96)
PROMPT, MAX_CONTEXT = 13, 320
NEW_TOKENS = mlx_step.GROWTH + 20  # past the device cache's first growth


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    source, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("mlx")
    build_checkpoint(transformers.Qwen3MoeConfig(**ARCH), source)
    model = npumoe.load(source)
    ids = np.random.default_rng(1).integers(0, ARCH["vocab_size"], 64).tolist()
    plan = npumoe.plan(model, npumoe.calibrate(model, [ids], chunk=8), target="mlx", residency="npu")
    build(model, plan, "mlx", out, max_context=MAX_CONTEXT, progress=False)
    return npumoe.Engine(model, backend="mlx", artifacts=out), npumoe.Engine(model, chunk=8, max_context=MAX_CONTEXT)


def greedy(engine, prompt, n):
    """n greedy tokens by decode after the prompt, whatever they are (no stop at EOS), and their logits."""
    logits = [engine.forward(prompt)[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        logits.append(engine.decode(tokens[-1]))
        tokens.append(int(logits[-1].argmax()))
    return tokens, np.stack(logits)


def test_a_long_decode_gives_the_reference_engines_tokens_and_cache(engines, monkeypatch):
    mlx_engine, reference = engines
    loads = []
    monkeypatch.setattr(mlx_step.Slots, "load", lambda self, host, length, load=mlx_step.Slots.load: (
        loads.append(length), load(self, host, length))[1])
    prompt = np.random.default_rng(2).integers(0, ARCH["vocab_size"], PROMPT)
    tokens, logits = greedy(mlx_engine, prompt, NEW_TOKENS)
    want_tokens, want_logits = greedy(reference, prompt, NEW_TOKENS)
    assert isinstance(mlx_engine._device_step(), mlx_step.MlxDecodeStep)  # the whole-step path ran
    assert tokens == want_tokens
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
    # the host cache once, after the prompt, for every layer's keys and values: never again a token
    assert loads == [PROMPT] * 2 * ARCH["num_hidden_layers"]
    length = PROMPT + NEW_TOKENS - 1
    got, want = mlx_engine.export_kv(), reference.export_kv()  # the device's slots, written back to the host
    assert got.length == want.length == length
    for a, b in zip(got.k + got.v, want.k + want.v):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    # the prompt's expert groups now run on the step's stacked experts: a prompt still gives the reference's logits
    np.testing.assert_allclose(mlx_engine.forward(prompt), reference.forward(prompt), rtol=1e-4, atol=1e-4)


def test_the_device_cache_is_written_in_place_not_rebuilt_each_token(engines):
    """Once a sequence's cache is on the device, decode reads nothing of the host's (poisoned here with NaN, it
    still gives the reference's tokens) and a layer's device buffer stays one array between growths, its filled
    slots advancing a token at a time."""
    mlx_engine, reference = engines
    prompt = np.arange(3, 3 + PROMPT)
    want, _ = greedy(reference, prompt, 8)
    mlx_engine.forward(prompt)
    tokens = [want[0], int(mlx_engine.decode(want[0]).argmax())]
    for t in (*mlx_engine.cache.k, *mlx_engine.cache.v):
        t.fill_(float("nan"))
    slots = mlx_engine._device_step().layers[0][0].k
    buffer = slots.buffer
    while len(tokens) < len(want):
        tokens.append(int(mlx_engine.decode(tokens[-1]).argmax()))
        assert slots.buffer is buffer and slots.length == PROMPT + len(tokens) - 1
    assert tokens == want and buffer.shape[1] == mlx_step.GROWTH
