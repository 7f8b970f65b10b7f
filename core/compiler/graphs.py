"""Static graphs for one layer's pieces, built from the spec alone.

Each builder returns a :class:`~npumoe.core.ir.graph.Graph` with fixed shapes. The attention
graph takes the KV cache as explicit inputs and returns this chunk's keys and values; the
host appends them (``npumoe.core.runtime.kvcache``). That keeps dynamic-index writes out of
NPU graphs, which is what both HTP context binaries and ANE programs want.
"""

from __future__ import annotations

from npumoe.core.ir.graph import Graph, GraphBuilder, Role, TensorType, w
from npumoe.core.ir.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, NormSpec
from npumoe.core.ir.weights import expert, layer


def norm(b: GraphBuilder, x: str, spec: NormSpec, prefix: str) -> str:
    if spec.kind == "layer":
        bias = w(f"{prefix}.bias") if spec.bias else None
        return b("layernorm", x, w(f"{prefix}.weight"), *([bias] if bias else []), eps=spec.eps)
    return b("rmsnorm", x, w(f"{prefix}.weight"), eps=spec.eps)


def linear(b: GraphBuilder, x: str, prefix: str, bias: bool) -> str:
    return b("linear", x, w(f"{prefix}.weight"), *([w(f"{prefix}.bias")] if bias else []))


def mlp(b: GraphBuilder, x: str, spec: MLPSpec, prefix: str) -> str:
    """One gated feed-forward block (dense MLP, routed expert or shared expert)."""
    gate = linear(b, x, f"{prefix}.gate", spec.bias)
    up = linear(b, x, f"{prefix}.up", spec.bias)
    if spec.glu == "gpt_oss":
        gate = b("clamp", gate, min=None, max=spec.limit)
        up = b("clamp", up, min=-spec.limit, max=spec.limit)
        glu = b("mul", gate, b("sigmoid", b("affine", gate, scale=spec.alpha, shift=0.0)))
        hidden = b("mul", b("affine", up, scale=1.0, shift=1.0), glu)
    else:
        act = spec.act
        activated = b("gelu", gate, approximate="tanh" if act == "gelu_tanh" else "none") if act.startswith(
            "gelu"
        ) else b(act, gate)
        hidden = b("mul", activated, up)
    return linear(b, hidden, f"{prefix}.down", spec.bias)


def _heads(b: GraphBuilder, x: str, seq: int, heads: int, dim: int) -> str:
    return b("reshape", x, shape=(seq, heads, dim))


def _gqa_qkv(b: GraphBuilder, xn: str, att: AttentionSpec, prefix: str, seq: int):
    q = linear(b, xn, f"{prefix}.q", att.qkv_bias)
    k = linear(b, xn, f"{prefix}.k", att.qkv_bias)
    v = linear(b, xn, f"{prefix}.v", att.qkv_bias)
    if att.qk_norm == "full":
        q = b("rmsnorm", q, w(f"{prefix}.q_norm.weight"), eps=att.qk_norm_eps)
        k = b("rmsnorm", k, w(f"{prefix}.k_norm.weight"), eps=att.qk_norm_eps)
    if att.clip_qkv is not None:
        q, k, v = (b("clamp", t, min=-att.clip_qkv, max=att.clip_qkv) for t in (q, k, v))
    q = _heads(b, q, seq, att.num_heads, att.head_dim)
    k = _heads(b, k, seq, att.num_kv_heads, att.head_dim)
    v = _heads(b, v, seq, att.num_kv_heads, att.v_head_dim)
    if att.qk_norm == "head":
        q = b("rmsnorm", q, w(f"{prefix}.q_norm.weight"), eps=att.qk_norm_eps)
        k = b("rmsnorm", k, w(f"{prefix}.k_norm.weight"), eps=att.qk_norm_eps)
    return q, k, v


def _mla_qkv(b: GraphBuilder, xn: str, att: AttentionSpec, prefix: str, seq: int):
    """DeepSeek's multi-head latent attention, with the latent expanded to per-head K and V."""
    h, nope, rope_d = att.num_heads, att.qk_nope_head_dim, att.qk_rope_head_dim
    if att.q_lora_rank:
        q = linear(b, xn, f"{prefix}.q_a", att.qkv_bias)
        q = b("rmsnorm", q, w(f"{prefix}.q_a_norm.weight"), eps=att.qk_norm_eps)
        q = linear(b, q, f"{prefix}.q_b", False)
    else:
        q = linear(b, xn, f"{prefix}.q", False)
    q = _heads(b, q, seq, h, att.head_dim)
    kv = linear(b, xn, f"{prefix}.kv_a", att.qkv_bias)
    latent = b("slice", kv, axis=1, start=0, stop=att.kv_lora_rank, step=1)
    k_rot = b("slice", kv, axis=1, start=att.kv_lora_rank, stop=att.kv_lora_rank + rope_d, step=1)
    latent = b("rmsnorm", latent, w(f"{prefix}.kv_a_norm.weight"), eps=att.qk_norm_eps)
    kv = _heads(b, linear(b, latent, f"{prefix}.kv_b", False), seq, h, nope + att.v_head_dim)
    k_nope = b("slice", kv, axis=2, start=0, stop=nope, step=1)
    v = b("slice", kv, axis=2, start=nope, stop=nope + att.v_head_dim, step=1)
    k_rot = _heads(b, k_rot, seq, 1, rope_d)
    return q, (k_nope, k_rot), v


def _rope_tail(b: GraphBuilder, x: str, att: AttentionSpec, nope: int) -> str:
    """Rotate the last ``qk_rope_head_dim`` dims of an MLA tensor, leaving the first ``nope``."""
    rot = att.qk_rope_head_dim
    head = b("slice", x, axis=2, start=0, stop=nope, step=1)
    tail = b("slice", x, axis=2, start=nope, stop=nope + rot, step=1)
    tail = b("rope", tail, "cos", "sin", rotary_dim=rot, interleaved=att.rope.interleaved)
    return b("concat", head, tail, axis=2)


def attention_graph(spec: ModelSpec, i: int, seq: int, max_context: int) -> Graph:
    """x[S, H] → h = x + attn(norm(x)), z = ffn_norm(h), and this chunk's K/V."""
    ls: LayerSpec = spec.layers[i]
    att = ls.attention
    prefix = f"{layer(i)}.attn"
    b = GraphBuilder()
    xn = norm(b, "x", ls.norm, f"{layer(i)}.attn_norm")
    kv_heads = att.num_heads if att.kind == "mla" else att.num_kv_heads
    if att.kind == "mla":
        q, (k_nope, k_rot), v = _mla_qkv(b, xn, att, prefix, seq)
        q = _rope_tail(b, q, att, att.qk_nope_head_dim)
        k_rot = b("rope", k_rot, "cos", "sin", rotary_dim=att.qk_rope_head_dim, interleaved=att.rope.interleaved)
        k_rot = b("concat", *([k_rot] * att.num_heads), axis=1)
        k = b("concat", k_nope, k_rot, axis=2)
    else:
        q, k, v = _gqa_qkv(b, xn, att, prefix, seq)
        rot = att.rope.rotary_dim or att.head_dim
        q = b("rope", q, "cos", "sin", rotary_dim=rot, interleaved=att.rope.interleaved)
        k = b("rope", k, "cos", "sin", rotary_dim=rot, interleaved=att.rope.interleaved)
    q = b("transpose", q, perm=(1, 0, 2))
    k_new = b.rename_output(b("transpose", k, perm=(1, 0, 2)), "k_new")
    v_new = b.rename_output(b("transpose", v, perm=(1, 0, 2)), "v_new")
    k_all = b("concat", "k_cache", k_new, axis=1)
    v_all = b("concat", "v_cache", v_new, axis=1)
    sinks = [w(f"{prefix}.sinks")] if att.sinks else []
    o = b("sdpa", q, k_all, v_all, "mask", *sinks, scale=att.scale)
    o = b("reshape", b("transpose", o, perm=(1, 0, 2)), shape=(seq, att.num_heads * att.v_head_dim))
    o = linear(b, o, f"{prefix}.o", att.o_bias)
    b.rename_output(b("add", "x", o), "h")
    b.rename_output(norm(b, "h", ls.norm, f"{layer(i)}.ffn_norm"), "z")
    rot_dim = att.qk_rope_head_dim if att.kind == "mla" else (att.rope.rotary_dim or att.head_dim)
    hidden = spec.hidden_size
    return Graph(
        name=f"L{i}.attn.s{seq}",
        kind="attention",
        layer=i,
        inputs={
            "x": TensorType((seq, hidden)),
            "cos": TensorType((seq, rot_dim), role=Role.HOST_TABLE),
            "sin": TensorType((seq, rot_dim), role=Role.HOST_TABLE),
            "mask": TensorType((seq, max_context + seq), role=Role.MASK),
            "k_cache": TensorType((kv_heads, max_context, att.head_dim), role=Role.KV_CACHE),
            "v_cache": TensorType((kv_heads, max_context, att.v_head_dim), role=Role.KV_CACHE),
            "position": TensorType((1,), "int32", role=Role.POSITION),
        },
        outputs={
            "h": TensorType((seq, hidden)),
            "z": TensorType((seq, hidden)),
            "k_new": TensorType((kv_heads, seq, att.head_dim), role=Role.KV_NEW, updates="k_cache"),
            "v_new": TensorType((kv_heads, seq, att.v_head_dim), role=Role.KV_NEW, updates="v_cache"),
        },
        ops=b.ops,
        meta={"seq": seq, "max_context": max_context},
    )


def ffn_graph(spec: ModelSpec, i: int, seq: int, shared: bool = False) -> Graph:
    """A dense MLP (``shared=False``) or an MoE layer's shared expert with its optional gate."""
    hidden = spec.hidden_size
    b = GraphBuilder()
    if shared:
        moe = spec.layers[i].ffn
        y = mlp(b, "z", moe.shared, f"{layer(i)}.moe.shared")
        if moe.shared_gate:
            gate = b("sigmoid", b("linear", "z", w(f"{layer(i)}.moe.shared_gate.weight")))
            y = b("mul", gate, y)
        name, kind = f"L{i}.shared.s{seq}", "ffn"
    else:
        y = mlp(b, "z", spec.layers[i].ffn, f"{layer(i)}.mlp")
        name, kind = f"L{i}.ffn.s{seq}", "ffn"
    b.rename_output(y, "y")
    return Graph(
        name=name,
        kind=kind,
        layer=i,
        inputs={"z": TensorType((seq, hidden))},
        outputs={"y": TensorType((seq, hidden))},
        ops=b.ops,
        meta={"seq": seq},
    )


def experts_graph(spec: ModelSpec, i: int, experts: tuple[int, ...], capacities: tuple[int, ...], name: str) -> Graph:
    """An expert group: x[Σ C, H], expert g's tokens in the C_g rows after expert g−1's → y[Σ C, H]."""
    moe = spec.layers[i].ffn
    hidden, rows = spec.hidden_size, sum(capacities)
    b = GraphBuilder()
    outs, start = [], 0
    for e, capacity in zip(experts, capacities):
        x = "x" if len(experts) == 1 else b("slice", "x", axis=0, start=start, stop=start + capacity, step=1)
        outs.append(mlp(b, x, moe.expert, expert(i, e)))
        start += capacity
    b.rename_output(outs[0] if len(outs) == 1 else b("concat", *outs, axis=0), "y")
    return Graph(
        name=name,
        kind="experts",
        layer=i,
        inputs={"x": TensorType((rows, hidden))},
        outputs={"y": TensorType((rows, hidden))},
        ops=b.ops,
        meta={"experts": list(experts), "capacities": list(capacities)},
    )


def lm_head_graph(spec: ModelSpec, seq: int) -> Graph:
    b = GraphBuilder()
    xn = norm(b, "x", spec.norm, "norm")
    b.rename_output(linear(b, xn, "lm_head", spec.lm_head_bias), "logits")
    return Graph(
        name=f"lm_head.s{seq}",
        kind="lm_head",
        inputs={"x": TensorType((seq, spec.hidden_size))},
        outputs={"logits": TensorType((seq, spec.vocab_size))},
        ops=b.ops,
        meta={"seq": seq},
    )
