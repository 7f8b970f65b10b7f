"""A decode token's blocks as one kernel call each (luts/csrc/decode.c): a layer's attention block, its softmax
routing, its routed SwiGLU experts, the MoE layer as a whole, and a whole decode step (embedding, every layer, the LM
head).

Through the graph interpreter a token's layer is some forty Python-level steps between its matrix reads; here the
host makes one call a block (or a step). Each record points into matrices the caller keeps alive: fp32 or bf16
tensors or :class:`~npumoe.luts.torch_op.LutLinear` packed ones (the bf16 and packed GEMVs equal their own calls'
results bit for bit); the rest is the graph ops' arithmetic in another summation order. Every ``of`` says None where the
call cannot take what it is given, and every call None where its inputs do not fit: the caller then runs the
interpreter's path.
"""

from __future__ import annotations

import ctypes

import torch

from npumoe.luts import kernels, torch_op  # (its kernel choice and checks, package-internal)


def _calls():
    """The chosen kernel build's entry points (an emulated one, for another ISA, has none of the fused calls)."""
    return torch_op._kernels().calls


def _matrix(w) -> kernels.Matrix | None:
    """A matrix as the fused calls take it: a packed LutLinear without bias or a C-contiguous 2-D bf16 or fp32
    tensor; None for anything else."""
    if isinstance(w, torch_op.LutLinear) and w.bias is None:
        return kernels.Matrix(ctypes.pointer(w.tiled().native), None, None, w.out_features, w.in_features)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_contiguous():
        if w.dtype == torch.bfloat16:
            return kernels.Matrix(None, w.data_ptr(), None, *w.shape)
        if w.dtype == torch.float32:
            return kernels.Matrix(None, None, w.data_ptr(), *w.shape)
    return None


def _fits(x: torch.Tensor, width: int) -> bool:
    """One fp32 row of ``width`` values, outside any tracer."""
    return torch_op._eager(x) and x.dtype == torch.float32 and x.numel() == width == x.shape[-1]


def swiglu_expert(gate, up, down) -> kernels.Swiglu | None:
    """One expert's record: down(silu(gate x) ⊙ up x) with three matrices the fused calls take, or None."""
    if not hasattr(_calls(), "swiglu_experts_at"):
        return None
    matrices = [_matrix(w) for w in (gate, up, down)]
    if None in matrices:
        return None
    g, u, d = matrices
    return kernels.Swiglu(g, u, d) if (g.n, g.k) == (u.n, u.k) == (d.k, d.n) else None


def swiglu_experts(experts: list[kernels.Swiglu], weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """Σ_e weights[e] · expert_e(x) for one token x [1, hidden]; None where x does not fit."""
    if not _fits(x, experts[0].down.n):
        return None
    x, weights = x.contiguous(), weights.to(torch.float32).contiguous()
    y = torch.empty_like(x)
    _calls().swiglu_experts_at(experts, weights.data_ptr(), x.data_ptr(), y.data_ptr(), torch_op.kernel_threads())
    return y


def softmax_route(z: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool, scaling: float):
    """(experts [1, k] int64, weights [1, k], logits [1, E]) of one token z [1, H] under softmax routing with an
    fp32 W [E, H] and no bias; None where that does not apply."""
    experts, hidden = weight.shape
    if not (_fits(z, hidden) and weight.dtype == torch.float32 and weight.is_contiguous() and 0 < top_k <= experts
            and hasattr(_calls(), "route_softmax_at")):
        return None
    z = z.contiguous()
    logits, top_i, top_w = torch.empty(1, experts), torch.empty(1, top_k, dtype=torch.int64), torch.empty(1, top_k)
    _calls().route_softmax_at(z.data_ptr(), weight.data_ptr(), experts, hidden, top_k, normalize, scaling,
                              logits.data_ptr(), top_i.data_ptr(), top_w.data_ptr(), torch_op.kernel_threads())
    return top_i, top_w, logits


class AttentionBlock:
    """One layer's grouped-query attention block: RMS norm, q/k/v (optional biases, q/k RMS norms per head or over
    all heads), rope over whole heads, attention over the cache, o (optional bias), the residual and the
    feed-forward's RMS norm. It holds fp32 copies of the small vectors."""

    def __init__(self, record: kernels.Attention, vectors: list[torch.Tensor | None]):
        self.record, self._vectors = record, vectors

    @classmethod
    def of(cls, q, k, v, o, *, attn_norm, ffn_norm, norm_eps: float, heads: int, kv_heads: int, head_dim: int,
           scale: float, interleaved: bool, biases=(None, None, None, None), q_norm=None, k_norm=None,
           qk_norm_full: bool = False, qk_norm_eps: float = 0.0) -> AttentionBlock | None:
        if not hasattr(_calls(), "attention_decode_at"):
            return None
        matrices = [_matrix(w) for w in (q, k, v, o)]
        if None in matrices:
            return None
        hidden, nq, nk = matrices[3].n, heads * head_dim, kv_heads * head_dim
        if [(m.n, m.k) for m in matrices] != [(nq, hidden), (nk, hidden), (nk, hidden), (hidden, nq)]:
            return None
        vectors = [None if t is None else t.detach().to(torch.float32).contiguous()
                   for t in (*biases, attn_norm, ffn_norm, q_norm, k_norm)]
        record = kernels.Attention(*matrices, *(0 if t is None else t.data_ptr() for t in vectors), norm_eps,
                                   qk_norm_eps, scale, hidden, heads, kv_heads, head_dim, qk_norm_full, interleaved)
        return cls(record, vectors)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: int, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h, z) for one token x [1, hidden] at ``position``, its key and value written to that slot of the caches
        [kv_heads, capacity, head_dim] (fp32, contiguous); None (nothing written) where they do not fit."""
        if not (_fits(x, self.record.hidden) and _cache_fits(k_cache, v_cache, position)):
            return None
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        h, z = torch.empty_like(x), torch.empty_like(x)
        _calls().attention_decode_at(self.record, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), position,
                                     k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], h.data_ptr(),
                                     z.data_ptr(), torch_op.kernel_threads())
        return h, z


def _cache_fits(k_cache: torch.Tensor, v_cache: torch.Tensor, position: int) -> bool:
    return (k_cache.dtype == v_cache.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and 0 <= position < k_cache.shape[1])


class MoEBlock:
    """A MoE layer on the CPU: softmax top-k routing over an fp32 router without bias, then the picked SwiGLU
    experts' weighted sum. Built from every expert's record (:func:`swiglu_expert`)."""

    def __init__(self, record: kernels.MoE, keep: tuple):
        self.record, self._keep = record, keep

    @classmethod
    def of(cls, router: torch.Tensor, experts: list[kernels.Swiglu | None], top_k: int, normalize: bool,
           scaling: float) -> MoEBlock | None:
        count, hidden = router.shape
        if not (hasattr(_calls(), "moe_decode_at") and router.dtype == torch.float32 and router.is_contiguous()
                and count == len(experts) and 0 < top_k <= count and None not in experts
                and all(e.gate.k == e.down.n == hidden for e in experts)):
            return None
        table = (ctypes.POINTER(kernels.Swiglu) * count)(*map(ctypes.pointer, experts))
        return cls(kernels.MoE(router.data_ptr(), table, count, hidden, top_k, normalize, scaling), (router, table))

    def __call__(self, z: torch.Tensor):
        """(y [1, H], experts [1, k] int64, weights [1, k], logits [1, E], the routing's seconds) for one token
        z [1, H]; None where it does not fit."""
        r = self.record
        if not _fits(z, r.hidden):
            return None
        z = z.contiguous()
        y, logits = torch.empty_like(z), torch.empty(1, r.num_experts)
        top_i, top_w = torch.empty(1, r.top_k, dtype=torch.int64), torch.empty(1, r.top_k)
        routing = _calls().moe_decode_at(r, z.data_ptr(), y.data_ptr(), logits.data_ptr(), top_i.data_ptr(),
                                         top_w.data_ptr(), torch_op.kernel_threads())
        return y, top_i, top_w, logits, routing


class DecodeStep:
    """A whole decode step in one call: the token's embedding row, every layer's attention block, MoE layer and
    residual with no host step between them, the final RMS norm and the LM head. Each layer brings its blocks, its
    cache tensors and its rope tables [positions, head_dim] (row p for position p)."""

    def __init__(self, record: kernels.Model, vocab: int, top_k: int, keep: list):
        self.record, self.vocab, self.top_k, self._keep = record, vocab, top_k, keep
        self.capacity = min(record.layers[i].capacity for i in range(record.count))

    @classmethod
    def of(cls, layers: list[tuple[AttentionBlock, MoEBlock, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
           *, embedding: torch.Tensor, embedding_scale: float, norm: torch.Tensor, norm_eps: float, head
           ) -> DecodeStep | None:
        """From (attention, moe, k_cache, v_cache, cos, sin) per layer, the embedding (bf16 or fp32 [vocab, hidden]),
        the final norm's weight and the LM head (a matrix :func:`_matrix` takes, no bias); None where a piece does
        not fit."""
        if not layers or not hasattr(_calls(), "decode_step_at"):
            return None
        hidden = layers[0][0].record.hidden
        records = []
        for attention, moe, k_cache, v_cache, cos, sin in layers:
            a = attention.record
            if not (_cache_fits(k_cache, v_cache, 0) and moe.record.hidden == a.hidden == hidden
                    and cos.shape == sin.shape and cos.shape[-1] == a.head_dim and cos.dtype == torch.float32
                    and cos.is_contiguous() and sin.is_contiguous()
                    and k_cache.shape == v_cache.shape == (a.kv_heads, k_cache.shape[1], a.head_dim)):
                return None
            records.append(kernels.Layer(ctypes.pointer(a), ctypes.pointer(moe.record), k_cache.data_ptr(),
                                         v_cache.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                         min(k_cache.shape[1], cos.shape[0])))
        top_k = {moe.record.top_k for _, moe, *_ in layers}
        table, lm_head = _matrix(embedding), _matrix(head)
        if len(top_k) != 1 or table is None or table.lut or lm_head is None or table.k != hidden or lm_head.k != hidden:
            return None
        norm = norm.detach().to(torch.float32).contiguous()
        array = (kernels.Layer * len(records))(*records)
        record = kernels.Model(array, len(records), table, embedding_scale, norm.data_ptr(), norm_eps, lm_head)
        return cls(record, lm_head.n, top_k.pop(), [layers, array, norm, embedding, head])

    def __call__(self, token: int, position: int):
        """(logits [1, vocab], experts and weights [layers, k], the routing's seconds) for ``token`` at ``position``,
        its keys and values written to every layer's cache; None where the position is past the caches."""
        if not 0 <= position < self.capacity:
            return None
        logits = torch.empty(1, self.vocab)
        top_i = torch.empty(self.record.count, self.top_k, dtype=torch.int64)
        top_w = torch.empty(self.record.count, self.top_k)
        routing = _calls().decode_step_at(self.record, token, position, logits.data_ptr(), top_i.data_ptr(),
                                          top_w.data_ptr(), torch_op.kernel_threads())
        return logits, top_i, top_w, routing
