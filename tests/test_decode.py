"""Engine.decode, the one-token step generate is made of, and the decode benchmark's accounting."""

import json

import numpy as np
import pytest

import npumoe
from npumoe.cli import main
from npumoe.core.base.errors import InputError

PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def demo():
    return npumoe.load()


def test_decode_continues_what_generate_produced(demo):
    ids = np.asarray(demo.tokenizer.encode(PROMPT))
    engine = npumoe.Engine(demo)
    tokens, logits = engine.generate(ids, max_new_tokens=6, return_logits=True)
    engine.generate(ids, max_new_tokens=1)
    steps = [engine.decode(int(t)) for t in tokens[:5]]
    np.testing.assert_allclose(np.stack(steps), logits[1:], atol=1e-5)
    assert engine.metrics_.graph_runs  # every executor call is counted ...
    assert engine.metrics["seconds"]["executor"] < engine.metrics["seconds"]["decode"] + engine.metrics["seconds"][
        "prefill"]  # ... and timed inside the steps


def test_decode_refuses_a_token_outside_the_vocabulary_and_a_full_cache(demo):
    engine = npumoe.Engine(demo, max_context=8)
    engine.generate(np.arange(1, 8), max_new_tokens=1)
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.decode(demo.spec.vocab_size)
    engine.decode(5)
    with pytest.raises(InputError, match="KV cache is full"):
        engine.decode(5)


def test_bench_decode_reports_host_time_and_weight_bytes(demo, capsys):
    main(["bench", "decode", "--tokens", "3", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["layers"] == demo.spec.num_layers and result["tokens"] == 3
    assert 0 < result["executor_ms_per_token"] < result["ms_per_token"]
    # weights one token reads: every attention graph, top-k experts per layer, the LM head (fp32 demo)
    spec, weights = demo.spec, demo.weights
    attention = sum(weights[n].nbytes for n in weights if ".attn." in n and weights[n].ndim == 2)
    moe = spec.layers[spec.moe_layers[0]].ffn
    expert = sum(weights[f"layers.0.moe.experts.0.{p}.weight"].nbytes for p in ("gate", "up", "down"))
    expected = attention + len(spec.moe_layers) * moe.top_k * expert + weights["lm_head.weight"].nbytes
    assert result["weight_mb_per_token"] == pytest.approx(expected / 1e6, rel=0.02)


def test_decode_steps_match_a_prefill_of_the_whole_sequence(demo):
    """Decode takes its own host path (one token: no dispatch tables, shared masks, rope rows sliced from
    tables); a prefill of the same tokens goes through the general one. Both compute the same logits."""
    ids = np.asarray(demo.tokenizer.encode(PROMPT))
    engine = npumoe.Engine(demo, chunk=16)
    tokens = engine.generate(ids, max_new_tokens=8)
    engine.generate(ids, max_new_tokens=1)
    stepped = [engine.decode(int(t)) for t in tokens[:7]]
    whole = npumoe.Engine(demo, chunk=16).forward(np.concatenate([ids, tokens[:7]]))
    np.testing.assert_allclose(np.stack(stepped), whole[len(ids):], atol=1e-4)


@pytest.mark.parametrize("window", [None, 3])
def test_decode_masks_moved_a_column_a_step_equal_masks_built_afresh(window):
    """DecodeMasks updates the previous step's mask in place; attention_mask builds each from scratch."""
    import dataclasses

    import torch

    from npumoe.core.runtime.kvcache import DecodeMasks, attention_mask

    att = dataclasses.replace(npumoe.load().spec.layers[0].attention, sliding_window=window)
    masks = DecodeMasks()
    for start in [0, 1, 2, 3, 4, 5, 9, 10, 10, 11, 2, 3]:  # steps, a jump, a repeat, a new sequence
        torch.testing.assert_close(masks.get(att, start, 16), attention_mask(att, start, 1, 1, 16), rtol=0, atol=0)


def test_bench_decode_refuses_more_steps_than_the_cache_holds(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "decode", "--tokens", "100000"])
    assert exit_.value.code == 2 and "time at most" in capsys.readouterr().err


def test_host_inside_layers_leaves_out_executors_and_the_steps_own_work():
    from npumoe.bench.decode import host_inside_layers

    spans = [("embed", 0, 1), ("rope_mask", 1, 2), ("executor", 3, 7), ("attention", 2, 8), ("residual", 9, 10),
             ("rope_mask", 10, 11), ("executor", 12, 13), ("rope_mask", 13, 14), ("residual", 14, 15),
             ("executor", 16, 20)]  # the LM head
    assert host_inside_layers(spans) == (10 - 1 - 4) + (15 - 10 - 1)  # (a layer may time rope and masks apart)
    fused = [("embed", 0, 1), ("layers", 1, 9), ("router", 1, 2), ("executor", 2, 9), ("executor", 9, 12)]
    assert host_inside_layers(fused) == 9 - 1 - 7  # one span over every layer of a fused decode step
