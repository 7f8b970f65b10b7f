"""Canonical weight names and the shapes a spec implies for them.

Adapters translate each Hugging Face tensor name to one of these; graphs reference them.
Linear weights are ``[out, in]`` (torch's convention); every routed expert has its own
``layers.{i}.moe.experts.{e}.{gate,up,down}`` names whether the checkpoint stores experts
as separate modules or as stacked 3-D tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from npumoe.core.spec import AttentionSpec, MLPSpec, ModelSpec, MoESpec, NormSpec
from npumoe.errors import WeightError


def layer(i: int) -> str:
    return f"layers.{i}"


def expert(i: int, e: int) -> str:
    return f"layers.{i}.moe.experts.{e}"


def _norm_shapes(prefix: str, norm: NormSpec, dim: int) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.weight": (dim,)}
    if norm.bias:
        shapes[f"{prefix}.bias"] = (dim,)
    return shapes


def _linear_shapes(prefix: str, out: int, inp: int, bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.weight": (out, inp)}
    if bias:
        shapes[f"{prefix}.bias"] = (out,)
    return shapes


def mlp_shapes(prefix: str, mlp: MLPSpec, hidden: int) -> dict[str, tuple[int, ...]]:
    shapes = _linear_shapes(f"{prefix}.gate", mlp.intermediate, hidden, mlp.bias)
    shapes |= _linear_shapes(f"{prefix}.up", mlp.intermediate, hidden, mlp.bias)
    shapes |= _linear_shapes(f"{prefix}.down", hidden, mlp.intermediate, mlp.bias)
    return shapes


def attention_shapes(prefix: str, att: AttentionSpec, hidden: int) -> dict[str, tuple[int, ...]]:
    hq, hkv = att.num_heads, att.num_kv_heads
    shapes: dict[str, tuple[int, ...]] = {}
    if att.kind == "mla":
        if att.q_lora_rank:
            shapes |= _linear_shapes(f"{prefix}.q_a", att.q_lora_rank, hidden, att.qkv_bias)
            shapes[f"{prefix}.q_a_norm.weight"] = (att.q_lora_rank,)
            shapes |= _linear_shapes(f"{prefix}.q_b", hq * att.head_dim, att.q_lora_rank, False)
        else:
            shapes |= _linear_shapes(f"{prefix}.q", hq * att.head_dim, hidden, False)
        shapes |= _linear_shapes(
            f"{prefix}.kv_a", att.kv_lora_rank + att.qk_rope_head_dim, hidden, att.qkv_bias
        )
        shapes[f"{prefix}.kv_a_norm.weight"] = (att.kv_lora_rank,)
        shapes |= _linear_shapes(
            f"{prefix}.kv_b", hq * (att.qk_nope_head_dim + att.v_head_dim), att.kv_lora_rank, False
        )
    else:
        shapes |= _linear_shapes(f"{prefix}.q", hq * att.head_dim, hidden, att.qkv_bias)
        shapes |= _linear_shapes(f"{prefix}.k", hkv * att.head_dim, hidden, att.qkv_bias)
        shapes |= _linear_shapes(f"{prefix}.v", hkv * att.v_head_dim, hidden, att.qkv_bias)
        if att.qk_norm == "head":
            shapes[f"{prefix}.q_norm.weight"] = (att.head_dim,)
            shapes[f"{prefix}.k_norm.weight"] = (att.head_dim,)
        elif att.qk_norm == "full":
            shapes[f"{prefix}.q_norm.weight"] = (hq * att.head_dim,)
            shapes[f"{prefix}.k_norm.weight"] = (hkv * att.head_dim,)
    shapes |= _linear_shapes(f"{prefix}.o", hidden, hq * att.v_head_dim, att.o_bias)
    if att.sinks:
        shapes[f"{prefix}.sinks"] = (hq,)
    return shapes


def moe_shapes(i: int, moe: MoESpec, hidden: int) -> dict[str, tuple[int, ...]]:
    prefix = f"{layer(i)}.moe"
    shapes = _linear_shapes(f"{prefix}.router", moe.num_experts, hidden, moe.router.bias)
    if moe.router.correction_bias:
        shapes[f"{prefix}.router.correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes |= mlp_shapes(expert(i, e), moe.expert, hidden)
    if moe.shared is not None:
        shapes |= mlp_shapes(f"{prefix}.shared", moe.shared, hidden)
        if moe.shared_gate:
            shapes[f"{prefix}.shared_gate.weight"] = (1, hidden)
    return shapes


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the spec needs, with its shape."""
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (spec.vocab_size, h)}
    for i, ls in enumerate(spec.layers):
        shapes |= _norm_shapes(f"{layer(i)}.attn_norm", ls.norm, h)
        shapes |= attention_shapes(f"{layer(i)}.attn", ls.attention, h)
        shapes |= _norm_shapes(f"{layer(i)}.ffn_norm", ls.norm, h)
        if isinstance(ls.ffn, MoESpec):
            shapes |= moe_shapes(i, ls.ffn, h)
        else:
            shapes |= mlp_shapes(f"{layer(i)}.mlp", ls.ffn, h)
    shapes |= _norm_shapes("norm", spec.norm, h)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    if spec.lm_head_bias:
        shapes["lm_head.bias"] = (spec.vocab_size,)
    return shapes


class Weights(Mapping):
    """Canonical name → fp32 tensor, checked against the spec at construction."""

    def __init__(self, tensors: dict[str, torch.Tensor], spec: ModelSpec, source: str = ""):
        want = expected_shapes(spec)
        missing = [n for n in want if n not in tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightError(
                f"{source or 'checkpoint'} is missing tensor {missing[0]!r}{more}; "
                "is this checkpoint complete and of the model type its config.json names?"
            )
        for name, shape in want.items():
            got = tuple(tensors[name].shape)
            if got != shape:
                raise WeightError(
                    f"tensor {name!r} in {source or 'checkpoint'} has shape {list(got)}, but its "
                    f"config.json implies {list(shape)}; the weights and the config do not match."
                )
        self._tensors = {n: tensors[n].float() for n in want}
        self.spec = spec

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._stored(name)

    def _stored(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and self.spec.tie_embeddings:
            return self._tensors["embed.weight"]
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def nbytes(self, names) -> int:
        return sum(self._stored(n).numel() * self._stored(n).element_size() for n in names)


def weight_shape(weights: Mapping[str, torch.Tensor], name: str) -> torch.Size:
    """A weight's shape. Backends take any mapping; a :class:`Weights` answers without
    materialising the tensor, which for a packed matrix would mean dequantising it."""
    return weights._stored(name).shape if isinstance(weights, Weights) else weights[name].shape
