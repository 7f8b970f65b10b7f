"""OLMoE against transformers, over the config space OLMoE checkpoints use."""

import pytest
from hf_compare import assert_matches, build_checkpoint, edit_config, transformers

BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=96,
)  # fmt: skip

VARIANTS = {
    "defaults_raw_weights": {},
    # a clip inside the normed q/k's range, so the clamp bites after the full-width qk-norm
    "clip_renorm_top3_bias_tied": dict(
        clip_qkv=0.5, norm_topk_prob=True, num_experts_per_tok=3, attention_bias=True, tie_word_embeddings=True
    ),
    "top1_mha_linear_rope": dict(
        num_experts_per_tok=1, num_key_value_heads=4,
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_transformers(tmp_path, variant):
    cfg = transformers.OlmoeConfig(**{**BASE, **VARIANTS[variant]})
    hf = build_checkpoint(cfg, tmp_path)
    assert_matches(tmp_path, hf)


def test_stacked_experts_and_legacy_spellings(tmp_path):
    """3-D stacked expert tensors, `num_local_experts` for `num_experts`, and `rope_theta`
    instead of `rope_parameters` all load to the same model."""
    hf = build_checkpoint(transformers.OlmoeConfig(**{**BASE, "clip_qkv": 0.8}), tmp_path, layout="stacked")
    edit_config(tmp_path, num_experts=None, num_local_experts=8, rope_parameters=None, rope_theta=10000.0)
    model = assert_matches(tmp_path, hf, prompt_len=11, chunk=4)
    assert model.spec.layers[0].ffn.num_experts == 8
