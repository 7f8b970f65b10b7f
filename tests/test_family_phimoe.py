"""PhiMoE against transformers, over the config space PhiMoE checkpoints use."""

import numpy as np
import pytest
from hf_compare import assert_matches, build_checkpoint, edit_config, transformers

import npumoe
from npumoe.core.base.errors import InputError, UnsupportedModelError
from npumoe.models.phimoe import PhimoeAdapter

# head_dim 12: six rotary frequencies, each with its own short and long factor
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
            "long_factor": [2.0, 3.0, 5.0, 8.0, 12.0, 16.0], "short_mscale": 1.15, "long_mscale": 1.3,
            "original_max_position_embeddings": 64}  # fmt: skip
BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=96,
)  # fmt: skip

VARIANTS = {
    "longrope_attention_and_lm_head_bias": dict(rope_parameters=LONGROPE, attention_bias=True, lm_head_bias=True),
    # a wide jitter threshold lets several experts into each sparsemixer softmax, so gates are not all 1
    "sliding_window_wide_jitter_tied_default_rope": dict(
        sliding_window=5, router_jitter_noise=0.4, input_jitter_noise=0.1, tie_word_embeddings=True
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_transformers(tmp_path, variant):
    """Prompt plus new tokens stay below `original_max_position_embeddings`, where longrope
    uses its short factors and PhiMoE its `short_mscale`."""
    cfg = transformers.PhimoeConfig(**{**BASE, **VARIANTS[variant]})
    hf = build_checkpoint(cfg, tmp_path)
    assert_matches(tmp_path, hf)


def test_stacked_experts_and_legacy_spellings(tmp_path):
    """3-D stacked expert tensors with the router at `mlp.router`, `num_experts` for
    `num_local_experts`, and the legacy `rope_theta` + `rope_scaling` (carrying
    `original_max_position_embeddings` itself) for `rope_parameters` all load to the same model."""
    cfg = transformers.PhimoeConfig(**{**BASE, "rope_parameters": LONGROPE, "router_jitter_noise": 0.2})
    hf = build_checkpoint(cfg, tmp_path, layout="stacked")
    legacy = {"type": "longrope", **{k: v for k, v in LONGROPE.items() if k not in ("rope_type", "rope_theta")}}
    edit_config(tmp_path, num_local_experts=None, num_experts=6, rope_parameters=None, rope_theta=10000.0,
                rope_scaling=legacy, original_max_position_embeddings=None)  # fmt: skip
    model = assert_matches(tmp_path, hf, prompt_len=11, chunk=4)
    assert model.spec.layers[0].ffn.num_experts == 6


def test_sequences_past_the_short_context_are_refused(tmp_path):
    """Past `original_max_position_embeddings` every cached key's rotation changes: longrope
    swaps in its long factors (transformers 5.23's PhiMoE instead keeps the short factors and
    only switches to `long_mscale`), and transformers recomputes its whole cache at that
    point. npumoe's static KV cache cannot re-rotate, so it refuses such sequences rather
    than mix two rotations."""
    build_checkpoint(transformers.PhimoeConfig(**{**BASE, "rope_parameters": LONGROPE}), tmp_path)
    engine = npumoe.Engine(npumoe.load(tmp_path), chunk=8)
    ids = np.arange(60) % 90
    engine.generate(ids, max_new_tokens=4)  # 64 positions: still within
    with pytest.raises(InputError, match="longrope short context of 64"):
        engine.generate(ids, max_new_tokens=5)
    with pytest.raises(InputError, match="longrope short context of 64"):
        engine.forward(np.arange(65) % 90)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(num_experts_per_tok=3), "exactly 2 experts"),
        (dict(rope_parameters={**LONGROPE, "rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
        (dict(hidden_act="gelu_new"), "hidden_act 'gelu_new'"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        PhimoeAdapter().spec({**BASE, **change})
