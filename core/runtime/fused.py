"""A decode token's attention block as one kernel call, where the layer's form and weights allow it.

The graph interpreter runs the block as some twenty steps, each a Python-level call through host state that the
weights streamed since have evicted; the fused call (``npumoe_attention_decode``, luts/csrc/decode.c) runs the same
ops in C between its matrix reads. It covers grouped-query attention with RMS norms, optional q/k/v/o biases and
q/k norms, rope over whole heads, and no window, sinks or clipping, over fp32, bf16 or packed matrices; anything else
keeps the interpreter's path.
"""

from __future__ import annotations

from npumoe.core.ir.spec import ModelSpec
from npumoe.core.ir.weights import layer
from npumoe.luts.decode import AttentionBlock


def attention_block(spec: ModelSpec, i: int, weights) -> AttentionBlock | None:
    """Layer ``i``'s attention block for the fused decode call, or None where it does not apply (another form,
    matrices it cannot read)."""
    ls = spec.layers[i]
    att = ls.attention
    if (att.kind != "gqa" or ls.norm.kind != "rms" or att.clip_qkv is not None or att.sliding_window is not None
            or att.sinks or (att.rope.rotary_dim or att.head_dim) != att.head_dim or att.v_head_dim != att.head_dim):
        return None
    packed, prefix = getattr(weights, "packed", {}), f"{layer(i)}.attn"

    def matrix(name: str):  # a packed matrix as its LutLinear (weights[name] would dequantise it)
        return packed[name] if name in packed else weights[name]

    def optional(name: str, present: bool):
        return weights[name] if present else None

    q, k, v, o = (matrix(f"{prefix}.{p}.weight") for p in "qkvo")
    biases = [optional(f"{prefix}.{p}.bias", att.qkv_bias) for p in "qkv"] + [optional(f"{prefix}.o.bias", att.o_bias)]
    return AttentionBlock.of(
        q, k, v, o, attn_norm=weights[f"{layer(i)}.attn_norm.weight"], ffn_norm=weights[f"{layer(i)}.ffn_norm.weight"],
        norm_eps=ls.norm.eps, heads=att.num_heads, kv_heads=att.num_kv_heads, head_dim=att.head_dim, scale=att.scale,
        interleaved=att.rope.interleaved, biases=biases, q_norm=optional(f"{prefix}.q_norm.weight", bool(att.qk_norm)),
        k_norm=optional(f"{prefix}.k_norm.weight", bool(att.qk_norm)), qk_norm_full=att.qk_norm == "full",
        qk_norm_eps=att.qk_norm_eps)
