"""DeepSeek-V3: multi-head latent attention, sigmoid group-limited routing, shared experts."""

from __future__ import annotations

from npumoe.core.ir.rope import yarn_mscale
from npumoe.core.ir.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec, RopeSpec, RouterSpec
from npumoe.models.base import Adapter, activation, model_spec, require, rms_norm, rope_spec

# transformers' DeepseekV3Config defaults, for keys a config.json may leave out
DEFAULTS = {
    "rope_interleave": True, "attention_bias": False, "max_position_embeddings": 4096, "hidden_act": "silu",
    "n_shared_experts": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "n_group": 8, "topk_group": 4,
}  # fmt: skip
LATENT_NORM_EPS = 1e-6  # the q_a/kv_a norms keep RMSNorm's default eps, whatever rms_norm_eps says


def softmax_scale(qk_head_dim: int, rope: RopeSpec) -> float:
    """1/√d, times mscale(factor, mscale_all_dim)² when a scaled rope sets mscale_all_dim."""
    mscale_all_dim = rope.p.get("mscale_all_dim")
    if rope.kind == "default" or not mscale_all_dim:
        return qk_head_dim**-0.5
    return qk_head_dim**-0.5 * yarn_mscale(rope.p["factor"], mscale_all_dim) ** 2


def attention(cfg: dict) -> AttentionSpec:
    heads = require(cfg, "num_attention_heads")
    nope, rot = require(cfg, "qk_nope_head_dim"), require(cfg, "qk_rope_head_dim")
    rope = rope_spec(cfg, rot, interleaved=bool(cfg["rope_interleave"]))
    bias = bool(cfg["attention_bias"])
    return AttentionSpec(
        kind="mla",
        num_heads=heads,
        num_kv_heads=heads,  # the latent expands to every head
        head_dim=nope + rot,
        v_head_dim=require(cfg, "v_head_dim"),
        scale=softmax_scale(nope + rot, rope),
        rope=rope,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm_eps=LATENT_NORM_EPS,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=require(cfg, "kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rot,
    )


def experts(cfg: dict) -> MoESpec:
    """Sigmoid scores; the correction bias and the group limit steer only which experts are picked."""
    act, size, shared = activation(cfg), require(cfg, "moe_intermediate_size"), cfg["n_shared_experts"]
    router = RouterSpec(
        top_k=require(cfg, "num_experts_per_tok"),
        scoring="sigmoid",
        normalize=bool(cfg["norm_topk_prob"]),
        routed_scaling=float(require(cfg, "routed_scaling_factor")),
        n_group=cfg["n_group"] or 1,
        topk_group=cfg["topk_group"] or 1,
        correction_bias=True,
    )
    return MoESpec(
        num_experts=require(cfg, "n_routed_experts", "num_local_experts", "num_experts"),
        router=router,
        expert=MLPSpec(size, act),
        shared=MLPSpec(size * shared, act) if shared else None,
    )


class DeepseekV3Adapter(Adapter):
    model_types = ("deepseek_v3",)

    def spec(self, cfg: dict) -> ModelSpec:
        cfg = {**DEFAULTS, **cfg}
        att, moe, norm = attention(cfg), experts(cfg), rms_norm(cfg)
        dense = MLPSpec(require(cfg, "intermediate_size"), activation(cfg))
        first_moe = cfg["first_k_dense_replace"] or 0
        layers = tuple(
            LayerSpec(att, moe if i >= first_moe else dense, norm) for i in range(require(cfg, "num_hidden_layers"))
        )
        return model_spec(cfg, "deepseek_v3", layers, norm)
