"""gpt-oss against transformers, over the config space gpt-oss checkpoints use."""

import pytest
from hf_compare import assert_matches, build_checkpoint, edit_config, transformers

from npumoe.core.base.errors import UnsupportedModelError
from npumoe.models.gpt_oss import GptOssAdapter

YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}  # fmt: skip
BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=5,
    max_position_embeddings=256, rope_parameters=YARN, eos_token_id=96,
)  # fmt: skip

VARIANTS = {
    "defaults_alternating_yarn": {},
    # a limit inside the pre-activations' range, so both clamps bite
    "tight_clamp_top3_tied_no_attn_bias_default_rope": dict(
        swiglu_limit=0.3, swiglu_alpha=1.2, num_experts_per_tok=3, attention_bias=False, tie_word_embeddings=True,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_transformers(tmp_path, variant):
    cfg = transformers.GptOssConfig(**{**BASE, **VARIANTS[variant]})
    hf = build_checkpoint(cfg, tmp_path)
    assert_matches(tmp_path, hf)


def test_stacked_experts_and_legacy_spellings(tmp_path):
    """The in-memory state dict (which save_pretrained also writes: stacked [E, H, 2I] with
    gate/up interleaved), `num_experts` for `num_local_experts`, and the legacy `rope_theta`
    + `rope_scaling` for `rope_parameters` all load to the same model."""
    hf = build_checkpoint(transformers.GptOssConfig(**{**BASE, "swiglu_limit": 0.5}), tmp_path, layout="stacked")
    legacy = {k: v for k, v in YARN.items() if k != "rope_theta"}
    edit_config(tmp_path, num_local_experts=None, num_experts=6, rope_parameters=None, rope_theta=5000.0,
                rope_scaling=legacy)  # fmt: skip
    model = assert_matches(tmp_path, hf, prompt_len=11, chunk=4)
    assert [layer.attention.sliding_window for layer in model.spec.layers] == [5, None, 5]


def test_unknown_layer_type_is_refused():
    cfg = {**BASE, "layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}
    with pytest.raises(UnsupportedModelError, match="'chunked_attention' is not supported"):
        GptOssAdapter().spec(cfg)


def test_cpu_attention_reads_the_cache_in_buckets_and_still_matches(tmp_path, monkeypatch):
    """The CPU path attends over the filled cache slots rounded up to a bucket (not the whole window):
    with 8-slot buckets a 13-token prompt and 16 new tokens cross four of them, sliding windows included."""
    from npumoe.core.runtime import engine

    monkeypatch.setattr(engine, "CACHE_BUCKET", 8)
    hf = build_checkpoint(transformers.GptOssConfig(**BASE), tmp_path)
    assert_matches(tmp_path, hf)
