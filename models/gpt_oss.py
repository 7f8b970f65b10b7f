"""gpt-oss: attention sinks, alternating sliding/full layers, clamped-GLU experts with biases."""

from __future__ import annotations

from npumoe.core.ir.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec, RouterSpec
from npumoe.models.base import (
    Adapter,
    L,
    gqa_attention,
    layer_windows,
    model_spec,
    rename,
    require,
    rms_norm,
    rules,
    stacked_experts,
)

# transformers' GptOssConfig defaults, for keys a config.json may leave out
DEFAULTS = {
    "head_dim": 64, "num_key_value_heads": 8, "attention_bias": True, "sliding_window": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "max_position_embeddings": 131072,
    "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
}  # fmt: skip
DEFAULT_ROPE_SCALING = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}  # fmt: skip


def alternating(n: int) -> list[str]:
    """gpt-oss's default: even layers slide, odd ones see everything."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def attention(cfg: dict, window: int | None) -> AttentionSpec:
    if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        cfg = {**cfg, "rope_parameters": DEFAULT_ROPE_SCALING}
    return gqa_attention(cfg, sliding_window=window, sinks=True)


def experts(cfg: dict) -> MoESpec:
    """Top-k on the biased router logits, softmax over the k; experts are (clamp(up) + 1) · GLU(gate)."""
    glu = MLPSpec(
        require(cfg, "intermediate_size"),
        glu="gpt_oss",
        bias=True,
        limit=float(require(cfg, "swiglu_limit")),
        alpha=float(require(cfg, "swiglu_alpha")),
    )
    return MoESpec(
        num_experts=require(cfg, "num_local_experts", "num_experts"),
        router=RouterSpec(top_k=require(cfg, "num_experts_per_tok"), scoring="softmax_topk", bias=True),
        expert=glu,
    )


class GptOssAdapter(Adapter):
    model_types = ("gpt_oss",)
    extra_rules = rules(
        (L + r"self_attn\.sinks", rename(r"layers.\1.attn.sinks")),
        (L + r"mlp\.router\.(weight|bias)", rename(r"layers.\1.moe.router.\2")),
        # stacked, transposed and gate/up-interleaved: [E, H, 2I], [E, 2I], [E, I, H], [E, H]
        (L + r"mlp\.experts\.gate_up_proj(?:_bias)?", stacked_experts("gate_up", transposed=True, interleaved=True)),
        (L + r"mlp\.experts\.down_proj(?:_bias)?", stacked_experts("down", transposed=True)),
    )

    def spec(self, cfg: dict) -> ModelSpec:
        cfg = {**DEFAULTS, **cfg}
        moe, norm = experts(cfg), rms_norm(cfg)
        layers = tuple(LayerSpec(attention(cfg, window), moe, norm) for window in layer_windows(cfg, alternating))
        return model_spec(cfg, "gpt_oss", layers, norm)
