"""Our MIL graph passes, one job each, and the pipeline that runs them during conversion.

* ``npumoe::pow_to_mul`` — ``pow(x, 2)`` → ``mul(x, x)``: the ANE's fp16 pow is unstable enough
  to break RMSNorm (SqueezeBits 2025, "Don't let the pow in").
* ``npumoe::fold_rsqrt_epsilon`` — ``rsqrt(add(x, c))`` → ``rsqrt(x, epsilon=c + ε)``: the norm's
  add disappears into the op that needs it.
* ``npumoe::sdpa_sliced_q`` — long-chunk attention as independent query slices (matmul,
  softmax, matmul each) joined by one concat, so no single op holds the [S, L] logits of a
  whole chunk: the ANE fails to compile SDPA at long sequence lengths (same article). Unlike
  coremltools' ``scaled_dot_product_attention_sliced_q`` it slices masks of any rank and
  concatenates once, not once per slice.

The pipeline also drops ``common::fuse_layernorm_or_instancenorm``: ``layer_norm`` is an op
the ANE rejects (NPUMoE Fig. 4; rule ``ane-ops``), so normalisations stay as primitives.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil.mil import Builder as mb
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.converters.mil.mil.passes.helper import block_context_manager
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
from coremltools.converters.mil.mil.passes.pass_registry import register_pass

SLICED_Q_MIN_SEQ = 128  # chunks at least this long are sliced
SLICED_Q_SLICE = 64  # query rows per slice


def _replace(op, new_var) -> None:
    op.enclosing_block.replace_uses_of_var_after_op(anchor_op=op, old_var=op.outputs[0], new_var=new_var)
    op.enclosing_block.remove_ops([op])


class _PerOpPass(AbstractGraphPass):
    """Visit every op of every function once; subclasses rewrite one op at a time."""

    def apply(self, prog):
        for f in prog.functions.values():
            self._block(f)

    @block_context_manager
    def _block(self, block):
        for op in list(block.operations):
            for b in op.blocks:
                self._block(b)
            if op.enclosing_block is not None:  # not removed by an earlier rewrite
                self.rewrite(op)

    def rewrite(self, op) -> None:
        raise NotImplementedError


@register_pass(namespace="npumoe")
class pow_to_mul(_PerOpPass):
    def rewrite(self, op) -> None:
        if op.op_type == "pow" and op.y.val is not None and np.all(op.y.val == 2):
            _replace(op, mb.mul(x=op.x, y=op.x, name=op.name, before_op=op))


@register_pass(namespace="npumoe")
class fold_rsqrt_epsilon(_PerOpPass):
    def rewrite(self, op) -> None:
        if op.op_type != "rsqrt" or op.x.op is None or op.x.op.op_type != "add":
            return
        add = op.x.op
        if len(add.outputs[0].child_ops) != 1 or add.outputs[0] in add.enclosing_block.outputs:
            return
        const, x = (add.y, add.x) if add.y.val is not None else (add.x, add.y)
        if const.val is None or np.size(const.val) != 1:
            return
        folded = np.ravel(const.val)[0] + (op.epsilon.val if op.epsilon is not None else 0.0)
        eps = np.asarray(folded, dtype=types.nptype_from_builtin(x.dtype))
        _replace(op, mb.rsqrt(x=x, epsilon=eps, name=op.name, before_op=op))
        add.enclosing_block.remove_ops([add])


@register_pass(namespace="npumoe")
class sdpa_sliced_q(_PerOpPass):
    def rewrite(self, op) -> None:
        if op.op_type != "scaled_dot_product_attention" or op.query.shape[-2] < SLICED_Q_MIN_SEQ:
            return
        q, k, v, mask = op.query, op.key, op.value, op.attn_mask
        rank, seq, dim = q.rank, q.shape[-2], q.shape[-1]
        scale = np.asarray(dim**-0.5, dtype=types.nptype_from_builtin(q.dtype))
        pieces = []
        for start in range(0, seq, SLICED_Q_SLICE):
            stop = min(start + SLICED_Q_SLICE, seq)
            q_i = _rows(q, start, stop, op)
            logits = mb.mul(x=mb.matmul(x=q_i, y=k, transpose_y=True, before_op=op), y=scale, before_op=op)
            if mask is not None:
                m_i = _rows(mask, start, stop, op) if mask.shape[-2] == seq else mask
                logits = mb.add(x=logits, y=m_i, before_op=op)
            probs = mb.softmax(x=logits, axis=-1, before_op=op)
            pieces.append(mb.matmul(x=probs, y=v, before_op=op))
        _replace(op, mb.concat(values=pieces, axis=rank - 2, name=op.name, before_op=op))


def _rows(x, start: int, stop: int, before_op):
    """x[..., start:stop, :] with static bounds."""
    begin = [0] * (x.rank - 2) + [start, 0]
    end = list(x.shape[:-2]) + [stop, x.shape[-1]]
    return mb.slice_by_index(x=x, begin=begin, end=end, before_op=before_op)


def pipeline() -> PassPipeline:
    """coremltools' default pipeline with our passes: the numerics fixes right after the first
    constant folding, the attention slicing before the final fp16 casts and clean-up."""
    p = PassPipeline.DEFAULT
    # the fused forms (layer_norm, and batch_norm from a per-channel mul + add: a LayerNorm's weight and
    # bias) are not in the ANE op table the lint holds packages to; found by npumoe conformance's op.layernorm
    p.remove_passes(["common::fuse_layernorm_or_instancenorm", "common::fuse_elementwise_to_batchnorm"])
    first_fold = p.passes.index("common::const_elimination") + 1
    p.insert_pass(first_fold, "npumoe::fold_rsqrt_epsilon")
    p.insert_pass(first_fold, "npumoe::pow_to_mul")
    p.insert_pass(p.passes.index("common::dedup_op_and_var_names"), "npumoe::sdpa_sliced_q")
    return p
