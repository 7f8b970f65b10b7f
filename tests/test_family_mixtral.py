"""Mixtral against transformers, over the config space Mixtral checkpoints use."""

import pytest
from hf_compare import assert_matches, build_checkpoint, edit_config, transformers
from safetensors import safe_open

BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=96,
)  # fmt: skip

VARIANTS = {
    "top1_sliding_window_theta_1e4": dict(
        num_experts_per_tok=1, sliding_window=5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    ),
    "top3_tied_head_dim_yarn": dict(
        num_experts_per_tok=3, tie_word_embeddings=True, head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64},
    ),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_transformers(tmp_path, variant):
    cfg = transformers.MixtralConfig(**{**BASE, **VARIANTS[variant]})
    hf = build_checkpoint(cfg, tmp_path)
    assert_matches(tmp_path, hf)


def test_legacy_expert_names_and_default_theta(tmp_path):
    """save_pretrained writes the original `block_sparse_moe.experts.N.w1/w2/w3` and
    `block_sparse_moe.gate` names; a config.json without any rope keys means θ = 1e6."""
    hf = build_checkpoint(transformers.MixtralConfig(**BASE), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    legacy = {f"model.layers.2.block_sparse_moe.{name}.weight" for name in ("gate", "experts.5.w1", "experts.5.w3")}
    assert legacy <= keys
    edit_config(tmp_path, rope_parameters=None)
    model = assert_matches(tmp_path, hf)
    assert model.spec.layers[0].attention.rope.theta == 1e6


def test_stacked_experts_and_legacy_spellings(tmp_path):
    """transformers 5 names (`mlp.gate`, stacked `mlp.experts.gate_up_proj`), `num_experts` for
    `num_local_experts`, and `rope_theta` + legacy `rope_scaling` for `rope_parameters`."""
    cfg = transformers.MixtralConfig(
        **BASE, sliding_window=5, rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}
    )
    hf = build_checkpoint(cfg, tmp_path, layout="stacked")
    edit_config(tmp_path, num_local_experts=None, num_experts=6, rope_parameters=None, rope_theta=5000.0,
                rope_scaling={"type": "linear", "factor": 2.0})  # fmt: skip
    model = assert_matches(tmp_path, hf, prompt_len=11, chunk=4)
    assert model.spec.layers[1].ffn.num_experts == 6
