"""What every family adapter shares: config reading and Hugging Face → canonical tensor names.

Most MoE families use the same Llama-style tensor names, so the table below covers them
all (per-expert modules and stacked 3-D expert tensors alike); a family file mostly just
turns its config into a :class:`~npumoe.core.ir.spec.ModelSpec`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from npumoe.core.base.errors import UnsupportedModelError
from npumoe.core.ir.spec import AttentionSpec, ModelSpec, NormSpec, RopeSpec

Tensors = Iterator[tuple[str, torch.Tensor]]
Rule = tuple[re.Pattern, Callable[[re.Match, torch.Tensor], Tensors]]

L = r"model\.layers\.(\d+)\."


def rename(template: str) -> Callable[[re.Match, torch.Tensor], Tensors]:
    """A rule that maps one tensor to one canonical name (regex groups fill the template)."""

    fmt = re.sub(r"\\(\d)", lambda g: f"{{{int(g.group(1)) - 1}}}", template)  # \1 → {0}: Match.expand re-parses

    def handler(m: re.Match, t: torch.Tensor) -> Tensors:
        yield fmt.format(*m.groups()), t

    return handler


def stacked_experts(
    kind: str, transposed: bool = False, interleaved: bool = False
) -> Callable[[re.Match, torch.Tensor], Tensors]:
    """Split stacked expert tensors: gate_up [E, 2I, H] (gate rows first, or alternating
    gate/up rows when ``interleaved``) or down [E, H, I]; ``transposed`` checkpoints store
    [E, in, out] (gpt-oss). A 2-D tensor is the matching stacked bias, [E, 2I] or [E, H]."""

    def handler(m: re.Match, t: torch.Tensor) -> Tensors:
        i, param = m.group(1), "weight" if t.dim() == 3 else "bias"
        for e in range(t.shape[0]):
            base = f"layers.{i}.moe.experts.{e}"
            w = t[e].T if transposed and param == "weight" else t[e]
            if kind == "gate_up":
                gate, up = (w[0::2], w[1::2]) if interleaved else w.chunk(2, dim=0)
                yield f"{base}.gate.{param}", gate
                yield f"{base}.up.{param}", up
            else:
                yield f"{base}.down.{param}", w

    return handler


def rules(*pairs: tuple[str, Callable]) -> list[Rule]:
    return [(re.compile(p + r"$"), h) for p, h in pairs]


COMMON_RULES: list[Rule] = rules(
    (r"model\.embed_tokens\.weight", rename("embed.weight")),
    (r"model\.norm\.(weight|bias)", rename(r"norm.\1")),
    (r"lm_head\.(weight|bias)", rename(r"lm_head.\1")),
    (L + r"input_layernorm\.(weight|bias)", rename(r"layers.\1.attn_norm.\2")),
    (L + r"post_attention_layernorm\.(weight|bias)", rename(r"layers.\1.ffn_norm.\2")),
    (L + r"self_attn\.(q|k|v|o)_proj\.(weight|bias)", rename(r"layers.\1.attn.\2.\3")),
    (L + r"self_attn\.(q|k)_norm\.weight", rename(r"layers.\1.attn.\2_norm.weight")),
    (L + r"self_attn\.(q_a|q_b|kv_a|kv_b)_proj(?:_with_mqa)?\.(weight|bias)", rename(r"layers.\1.attn.\2.\3")),
    (L + r"self_attn\.(q_a|kv_a)_layernorm\.weight", rename(r"layers.\1.attn.\2_norm.weight")),
    (L + r"mlp\.(gate|up|down)_proj\.(weight|bias)", rename(r"layers.\1.mlp.\2.\3")),
    (L + r"mlp\.gate\.weight", rename(r"layers.\1.moe.router.weight")),
    (L + r"mlp\.gate\.e_score_correction_bias", rename(r"layers.\1.moe.router.correction_bias")),
    (L + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|bias)", rename(r"layers.\1.moe.experts.\2.\3.\4")),
    (L + r"mlp\.experts\.gate_up_proj", stacked_experts("gate_up")),
    (L + r"mlp\.experts\.down_proj", stacked_experts("down")),
    (L + r"mlp\.shared_experts?\.(gate|up|down)_proj\.weight", rename(r"layers.\1.moe.shared.\2.weight")),
    (L + r"mlp\.shared_expert_gate\.weight", rename(r"layers.\1.moe.shared_gate.weight")),
    (L + r"mlp\.router\.weight", rename(r"layers.\1.moe.router.weight")),
    # Mixtral's on-disk names (Mixtral, PhiMoE): w1 = gate, w3 = up, w2 = down
    (L + r"block_sparse_moe\.gate\.weight", rename(r"layers.\1.moe.router.weight")),
    (L + r"block_sparse_moe\.experts\.(\d+)\.w1\.weight", rename(r"layers.\1.moe.experts.\2.gate.weight")),
    (L + r"block_sparse_moe\.experts\.(\d+)\.w3\.weight", rename(r"layers.\1.moe.experts.\2.up.weight")),
    (L + r"block_sparse_moe\.experts\.(\d+)\.w2\.weight", rename(r"layers.\1.moe.experts.\2.down.weight")),
)


class Adapter:
    """One Hugging Face family. Subclasses set ``model_types`` and implement :meth:`spec`;
    they add ``extra_rules`` (tried first) only where their tensor names differ."""

    model_types: tuple[str, ...] = ()
    extra_rules: list[Rule] = []

    def spec(self, cfg: dict):
        raise NotImplementedError

    def canonical(self, key: str, tensor: torch.Tensor) -> Tensors:
        """Canonical (name, tensor) pairs for one checkpoint tensor; nothing if it is not ours."""
        for pattern, handler in (*self.extra_rules, *COMMON_RULES):
            m = pattern.match(key)
            if m:
                yield from handler(m, tensor)
                return


# -- config helpers ---------------------------------------------------------------------------
def first(cfg: dict, *keys: str, default=None):
    """The first of ``keys`` present (and not None) in cfg: configs spell the same thing many ways."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def require(cfg: dict, *keys: str):
    """The first of ``keys`` with a value. A null is no value: transformers keeps it, and its model then fails on it
    (a null top-k or eps is a TypeError there), so it is refused here as a missing key is."""
    value = first(cfg, *keys)
    if value is None:
        raise UnsupportedModelError(
            f"config.json has no value for {' or '.join(map(repr, keys))} (missing or null); it is incomplete for its "
            "model_type."
        )
    return value


ROPE_KINDS = ("default", "linear", "yarn", "llama3", "longrope")


def rope_spec(cfg: dict, head_dim: int, interleaved: bool = False) -> RopeSpec:
    """RoPE from either spelling: ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``.
    Where a config has both, legacy ``rope_scaling`` keys win, as transformers merges them."""
    params = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0
    if kind not in ROPE_KINDS:
        raise UnsupportedModelError(f"rope type {kind!r} is not supported; supported: {', '.join(ROPE_KINDS)}.")
    max_position = first(cfg, "max_position_embeddings", default=2048)  # (null: not set, as elsewhere)
    # transformers prefers the top-level value and falls back to max_position_embeddings
    params["original_max_position_embeddings"] = first(
        cfg, "original_max_position_embeddings", default=params.get("original_max_position_embeddings")
    ) or max_position
    clean = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items() if v is not None))
    return RopeSpec(
        theta=theta,
        rotary_dim=int(head_dim * partial),
        kind=kind,
        params=clean,
        interleaved=interleaved,
        max_position=int(max_position),
    )


def layer_windows(cfg: dict, default_kinds: Callable[[int], list[str]]) -> list[int | None]:
    """Each layer's attention window from ``layer_types`` (or the family's default pattern)."""
    n = require(cfg, "num_hidden_layers")
    kinds = cfg.get("layer_types") or default_kinds(n)
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(
            f"layer type {sorted(unknown)[0]!r} is not supported; use sliding_attention or full_attention."
        )
    window = cfg.get("sliding_window")
    if "sliding_attention" in kinds[:n] and not window:
        raise UnsupportedModelError(
            f"this config has sliding_attention layers but sliding_window is {window!r}; set it to a positive size."
        )
    return [window if kind == "sliding_attention" else None for kind in kinds[:n]]


def gqa_attention(cfg: dict, **extra) -> AttentionSpec:
    """Llama-style grouped-query attention; ``attention_bias`` covers q, k, v and o."""
    heads = require(cfg, "num_attention_heads")
    head_dim = first(cfg, "head_dim", default=require(cfg, "hidden_size") // heads)
    bias = bool(cfg.get("attention_bias", False))
    return AttentionSpec(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=first(cfg, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        v_head_dim=head_dim,
        scale=head_dim**-0.5,
        rope=rope_spec(cfg, head_dim),
        qkv_bias=bias,
        o_bias=bias,
        **extra,
    )


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def activation(cfg: dict) -> str:
    """``hidden_act`` as an MLPSpec activation; others are refused rather than approximated."""
    act = cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}.")
    return ACTIVATIONS[act]


def model_spec(cfg: dict, family: str, layers, norm: NormSpec, **extra) -> ModelSpec:
    """A ModelSpec with the fields every family reads from config.json the same way."""
    return ModelSpec(
        family=family,
        vocab_size=require(cfg, "vocab_size"),
        hidden_size=require(cfg, "hidden_size"),
        layers=tuple(layers),
        norm=norm,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids(cfg),
        max_position=int(first(cfg, "max_position_embeddings", default=2048)),
        **extra,
    )


def rms_norm(cfg: dict) -> NormSpec:
    return NormSpec("rms", float(first(cfg, "rms_norm_eps", "layer_norm_eps", default=1e-6)))


def eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def is_sparse(cfg: dict, i: int, num_experts: int) -> bool:
    """Qwen's rule (Qwen2-MoE, Qwen3-MoE): layer ``i`` is MoE unless listed in ``mlp_only_layers``
    or off the ``decoder_sparse_step`` beat."""
    step = cfg.get("decoder_sparse_step") or 1
    return i not in (cfg.get("mlp_only_layers") or []) and num_experts > 0 and (i + 1) % step == 0
