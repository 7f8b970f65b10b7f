"""The interpreter's fused cached attention equals the ops it replaces (concat, concat, sdpa)."""

import pytest
import torch

import npumoe
from npumoe.core.compiler.graphs import attention_graph
from npumoe.core.compiler.interpreter import OP_IMPLS, TorchGraphExecutor, _sdpa_over_parts


@pytest.mark.parametrize("heads, kv_heads, sinks", [(4, 4, False), (8, 2, False), (8, 2, True)])
@pytest.mark.parametrize("seq", [1, 5])
def test_sdpa_over_parts_is_sdpa_of_the_concatenations(heads, kv_heads, sinks, seq):
    g = torch.Generator().manual_seed(heads * 10 + seq)
    old, dim = 7, 16
    q = torch.randn(heads, seq, dim, generator=g)
    k_old, v_old = torch.randn(kv_heads, old, dim, generator=g), torch.randn(kv_heads, old, dim, generator=g)
    k_new, v_new = torch.randn(kv_heads, seq, dim, generator=g), torch.randn(kv_heads, seq, dim, generator=g)
    mask = torch.where(torch.rand(seq, old + seq, generator=g) < 0.3, float("-inf"), 0.0)
    mask[:, old] = 0.0  # every row sees something
    extra = [torch.randn(heads, generator=g)] if sinks else []
    want = OP_IMPLS["sdpa"](q, torch.cat((k_old, k_new), 1), torch.cat((v_old, v_new), 1), mask, *extra, scale=0.25)
    got = _sdpa_over_parts(q, k_old, k_new, v_old, v_new, mask, *extra, scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_attention_graphs_run_fused_with_the_op_by_op_result():
    model = npumoe.load()
    graph = attention_graph(model.spec, 0, 1, 32)
    fused = TorchGraphExecutor(graph, model.weights)
    assert any(step[0] is _sdpa_over_parts for step in fused._steps)
    assert not any(step[0] is OP_IMPLS["concat"] for step in fused._steps)
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(t.shape, generator=g) for n, t in graph.inputs.items() if t.dtype == "float32"}
    inputs["mask"] = torch.zeros(graph.inputs["mask"].shape)
    env = dict(inputs)
    for op in graph.ops:
        args = [model.weights[a[2:]] if a.startswith("w:") else env[a] for a in op.inputs]
        env[op.outputs[0]] = OP_IMPLS[op.op](*args, **op.a)
    got = fused(inputs)
    for name in graph.outputs:
        torch.testing.assert_close(got[name], env[name], rtol=1e-5, atol=1e-5)
