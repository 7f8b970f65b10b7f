"""Qwen3-MoE against transformers, over the config space Qwen3-MoE checkpoints use."""

import pytest
from hf_compare import assert_matches, build_checkpoint, edit_config, transformers

BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=6, num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=96,
)  # fmt: skip

VARIANTS = {
    "defaults": {},
    "renorm_bias_tied_dense_layer": dict(
        norm_topk_prob=True, attention_bias=True, tie_word_embeddings=True, mlp_only_layers=[1]
    ),
    "sparse_step_sliding_window_top3": dict(
        decoder_sparse_step=2, use_sliding_window=True, sliding_window=5, num_experts_per_tok=3,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64},
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_transformers(tmp_path, variant):
    cfg = transformers.Qwen3MoeConfig(**{**BASE, **VARIANTS[variant]})
    hf = build_checkpoint(cfg, tmp_path)
    assert_matches(tmp_path, hf)


def test_stacked_experts_and_legacy_spellings(tmp_path):
    """3-D stacked expert tensors, `num_experts` instead of `num_local_experts`, and
    `rope_theta` instead of `rope_parameters` all load to the same model."""
    cfg = transformers.Qwen3MoeConfig(**{**BASE, "norm_topk_prob": True})
    hf = build_checkpoint(cfg, tmp_path, layout="stacked")
    edit_config(tmp_path, num_local_experts=None, num_experts=6, rope_parameters=None, rope_theta=10000.0)
    model = assert_matches(tmp_path, hf, prompt_len=11, chunk=4)
    assert model.spec.layers[0].ffn.num_experts == 6


def test_legacy_rope_scaling_wins_over_rope_parameters_as_in_transformers(tmp_path):
    """A config carrying both spellings: transformers lets `rope_scaling` override `rope_parameters`."""
    build_checkpoint(transformers.Qwen3MoeConfig(**BASE), tmp_path)
    edit_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                rope_scaling={"rope_type": "linear", "factor": 2.0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert hf.config.rope_parameters["rope_type"] == "linear"
    model = assert_matches(tmp_path, hf)
    assert model.spec.layers[0].attention.rope.kind == "linear"
