"""DeepSeek-V3 against transformers, over the config space DeepSeek-V3 checkpoints use."""

import pytest
import torch
from hf_compare import assert_matches, build_checkpoint, edit_config, transformers

BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, n_shared_experts=1, rms_norm_eps=1e-5, max_position_embeddings=256, eos_token_id=96,
)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}  # fmt: skip

VARIANTS = {
    "q_lora_interleaved_yarn_mscales": dict(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.7}),
    "no_q_lora_halves_one_group_raw_weights": dict(
        q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.7, n_shared_experts=2, first_k_dense_replace=0, attention_bias=True,
        tie_word_embeddings=True,
    ),
    "mscale_all_dim_only_top3_two_dense": dict(
        rope_parameters={**YARN, "mscale_all_dim": 1.3}, num_experts_per_tok=3, n_group=2, topk_group=1,
        first_k_dense_replace=2,
    ),
}


def correction_bias(model):
    """The jitter skips buffers; this bias reorders experts and makes every choice score negative."""
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf) * 0.3 - 1.0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_transformers(tmp_path, variant):
    cfg = transformers.DeepseekV3Config(**{**BASE, **VARIANTS[variant]})
    hf = build_checkpoint(cfg, tmp_path, prepare=correction_bias)
    assert_matches(tmp_path, hf)


def test_stacked_experts_and_legacy_spellings(tmp_path):
    """3-D stacked experts, `num_local_experts` for `n_routed_experts`, and the legacy
    `rope_theta` + `rope_scaling` for `rope_parameters` all load to the same model."""
    cfg = transformers.DeepseekV3Config(**{**BASE, "rope_parameters": {**YARN, "mscale": 0.9, "mscale_all_dim": 1.1}})
    hf = build_checkpoint(cfg, tmp_path, layout="stacked", prepare=correction_bias)
    legacy = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.9,
              "mscale_all_dim": 1.1}
    edit_config(tmp_path, n_routed_experts=None, num_local_experts=8, rope_parameters=None, rope_theta=5000.0,
                rope_scaling=legacy)  # fmt: skip
    model = assert_matches(tmp_path, hf, prompt_len=11, chunk=4)
    assert model.spec.layers[1].ffn.num_experts == 8
