"""The family-neutral description of an MoE language model.

A :class:`ModelSpec` is everything the planner, the graph builder and the backends need to
know about a checkpoint, with every Hugging Face spelling already resolved by an adapter in
``npumoe.models``. All classes are frozen: a spec is a value, safe to hash and to share.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Union


@dataclass(frozen=True)
class NormSpec:
    kind: str = "rms"  # "rms" | "layer"
    eps: float = 1e-6
    bias: bool = False  # LayerNorm's additive bias


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: which dims rotate, their frequencies, and the cos/sin scaling.

    ``kind`` is one of default, linear, yarn, llama3, longrope; ``params`` holds
    that kind's numbers (factor, beta_fast, short_factor, ...) as sorted (key, value) pairs
    so the spec stays hashable.
    """

    theta: float = 10000.0
    rotary_dim: int = 0  # 0: the whole head dim
    kind: str = "default"
    params: tuple[tuple[str, object], ...] = ()
    interleaved: bool = False  # rotate (x0, x1), (x2, x3)... pairs instead of the two halves
    max_position: int = 2048

    @property
    def p(self) -> dict:
        return dict(self.params)


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention: grouped-query ("gqa") or multi-head latent ("mla", DeepSeek-V3)."""

    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head dim (MLA: nope + rope parts)
    v_head_dim: int
    scale: float  # softmax scale applied to q·k
    rope: RopeSpec
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3); "full": over all heads (OLMoE)
    qk_norm_eps: float = 1e-6
    clip_qkv: float | None = None  # OLMoE clamps q, k, v to ±clip
    sliding_window: int | None = None  # attend to the last `sliding_window` positions only
    sinks: bool = False  # gpt-oss: a learned per-head logit that joins the softmax
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0


@dataclass(frozen=True)
class MLPSpec:
    """A feed-forward block: a dense MLP, one routed expert, or a shared expert.

    ``glu`` names the gating form: "standard" is act(gate) * up; "gpt_oss" is
    (clamp(up) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit).
    """

    intermediate: int
    act: str = "silu"  # silu | gelu | gelu_tanh | relu
    glu: str = "standard"
    bias: bool = False
    limit: float | None = None
    alpha: float = 1.702


@dataclass(frozen=True)
class RouterSpec:
    """How router logits become (expert, weight) pairs.

    scoring: "softmax" (probabilities, then top-k), "sigmoid" (DeepSeek-V3),
    "softmax_topk" (top-k on logits, softmax over the k picked: gpt-oss),
    "sparsemixer" (PhiMoE's inference-time sparsemixer).
    """

    top_k: int
    scoring: str = "softmax"
    normalize: bool = False  # renormalise the k weights to sum to 1
    routed_scaling: float = 1.0
    n_group: int = 1  # group-limited top-k when > 1
    topk_group: int = 1
    correction_bias: bool = False  # a per-expert bias added for selection only
    bias: bool = False  # the router linear's own bias
    jitter_eps: float = 0.0  # sparsemixer's threshold


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    router: RouterSpec
    expert: MLPSpec
    shared: MLPSpec | None = None
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(x·w) scales the shared expert

    @property
    def top_k(self) -> int:
        return self.router.top_k


FFNSpec = Union[MLPSpec, MoESpec]


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    ffn: FFNSpec
    norm: NormSpec = field(default_factory=NormSpec)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoESpec)


@dataclass(frozen=True)
class ModelSpec:
    family: str  # the Hugging Face model_type it came from
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    norm: NormSpec
    tie_embeddings: bool = False
    lm_head_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    max_position: int = 2048
    embedding_scale: float = 1.0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.is_moe]

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """A short stable id of the architecture; profiles and plans carry it."""
        text = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
