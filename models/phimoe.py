"""PhiMoE (Phi-3.5-MoE): LayerNorm with bias, biased attention and lm_head, the sparsemixer
router, an optional sliding window on every layer, and longrope scaled by Phi's mscale.

``input_jitter_noise`` only perturbs training, so inference ignores it.
"""

from __future__ import annotations

from dataclasses import replace

from npumoe.core.base.errors import UnsupportedModelError
from npumoe.core.ir.spec import LayerSpec, MLPSpec, ModelSpec, MoESpec, NormSpec, RopeSpec, RouterSpec
from npumoe.models.base import Adapter, activation, gqa_attention, model_spec, require

# transformers' PhimoeConfig defaults, for keys a config.json may leave out
DEFAULTS = {
    "rope_theta": 1e6, "rms_norm_eps": 1e-5, "router_jitter_noise": 0.01, "num_experts_per_tok": 2,
    "max_position_embeddings": 131072,
}  # fmt: skip


def phi_rope(rope: RopeSpec) -> RopeSpec:
    """PhiMoE scales cos/sin by ``short_mscale`` instead of longrope's attention factor (its
    ``long_mscale`` belongs past the short context, where the engine does not go)."""
    if rope.kind == "default":
        return rope
    if rope.kind != "longrope":
        raise UnsupportedModelError(f"PhiMoE with rope type {rope.kind!r} is not supported; use longrope or default.")
    params = {**rope.p, "attention_factor": float(require(rope.p, "short_mscale"))}
    return replace(rope, params=tuple(sorted(params.items())))


def sparsemixer(cfg: dict) -> RouterSpec:
    top_k = cfg["num_experts_per_tok"]
    if top_k != 2:
        raise UnsupportedModelError(
            f"PhiMoE's sparsemixer routes every token to exactly 2 experts; "
            f"num_experts_per_tok={top_k} is not supported."
        )
    return RouterSpec(top_k=2, scoring="sparsemixer", jitter_eps=float(require(cfg, "router_jitter_noise")))


class PhimoeAdapter(Adapter):
    model_types = ("phimoe",)

    def spec(self, cfg: dict) -> ModelSpec:
        cfg = {**DEFAULTS, **cfg}
        attention = gqa_attention(cfg, sliding_window=cfg.get("sliding_window"))
        attention = replace(attention, rope=phi_rope(attention.rope))
        moe = MoESpec(
            num_experts=require(cfg, "num_local_experts", "num_experts"),
            router=sparsemixer(cfg),
            expert=MLPSpec(require(cfg, "intermediate_size"), activation(cfg)),
        )
        norm = NormSpec("layer", float(require(cfg, "rms_norm_eps")), bias=True)
        layers = [LayerSpec(attention, moe, norm)] * require(cfg, "num_hidden_layers")
        return model_spec(cfg, "phimoe", layers, norm, lm_head_bias=bool(cfg.get("lm_head_bias", False)))
