"""Qwen2-MoE (Qwen1.5-MoE) against transformers, over the config space its checkpoints use."""

import pytest
from hf_compare import assert_matches, build_checkpoint, edit_config, transformers

from npumoe.core.base.errors import UnsupportedModelError
from npumoe.models.qwen2_moe import Qwen2MoeAdapter

BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
    max_position_embeddings=256, eos_token_id=96,
)  # fmt: skip

VARIANTS = {
    "defaults_qkv_bias_unnormalised_weights": {},
    "renorm_no_bias_tied_dense_layer": dict(
        norm_topk_prob=True, qkv_bias=False, tie_word_embeddings=True, mlp_only_layers=[1]
    ),
    # max_window_layers stays at its default (28): layers 0 and 2 slide, layer 1 does not
    "sparse_step_sliding_window_top3_yarn": dict(
        decoder_sparse_step=2, use_sliding_window=True, sliding_window=5, num_experts_per_tok=3,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64},
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_transformers(tmp_path, variant):
    cfg = transformers.Qwen2MoeConfig(**{**BASE, **VARIANTS[variant]})
    hf = build_checkpoint(cfg, tmp_path)
    assert_matches(tmp_path, hf)


def test_stacked_experts_and_legacy_spellings(tmp_path):
    """3-D stacked experts, `rope_theta` + legacy `rope_scaling` for `rope_parameters`, and keys
    older config.json files lack: no `qkv_bias` (biased, as Qwen1.5-MoE is) and no `layer_types`
    (windows from `use_sliding_window` and `max_window_layers`)."""
    cfg = transformers.Qwen2MoeConfig(
        **BASE, norm_topk_prob=True, use_sliding_window=True, sliding_window=5, max_window_layers=2,
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
    )  # fmt: skip
    hf = build_checkpoint(cfg, tmp_path, layout="stacked")
    edit_config(tmp_path, qkv_bias=None, layer_types=None, rope_parameters=None, rope_theta=5000.0,
                rope_scaling={"type": "linear", "factor": 2.0})  # fmt: skip
    model = assert_matches(tmp_path, hf, prompt_len=11, chunk=4)
    assert [layer.attention.sliding_window for layer in model.spec.layers] == [5, None, None]


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(layer_types=["sliding_attention"] * 3), "use_sliding_window is false"),
        (dict(use_sliding_window=True, sliding_window=None), "sliding_window is None"),
        (dict(hidden_act="quick_gelu"), "'quick_gelu' is not supported"),
    ],
)
def test_unrunnable_configs_are_refused(changes, match):
    with pytest.raises(UnsupportedModelError, match=match):
        Qwen2MoeAdapter().spec({**BASE, **changes})
