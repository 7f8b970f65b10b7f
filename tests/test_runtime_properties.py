"""Property tests of the host runtime: dispatch into static groups, overflow policies, combine.

The independent truth is a per-token numpy loop: y_t = Σ_j w_tj · FFN_{e_tj}(z_t).
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npumoe.core.compiler.graphs import experts_graph
from npumoe.core.compiler.interpreter import TorchGraphExecutor
from npumoe.core.compiler.program import ExpertGroup, StaticShape
from npumoe.core.ir.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec, RopeSpec, RouterSpec
from npumoe.core.planning.plan import OVERFLOW_POLICIES
from npumoe.core.runtime.cpu_experts import CpuExperts
from npumoe.core.runtime.metrics import Metrics
from npumoe.core.runtime.moe import MoELayer

H, I = 8, 6


def make_layer(experts: int, top_k: int, seed: int):
    att = AttentionSpec("gqa", 1, 1, H, H, 1.0, RopeSpec())
    moe = MoESpec(experts, RouterSpec(top_k=top_k, normalize=True), MLPSpec(I))
    spec = ModelSpec("t", 16, H, (LayerSpec(att, moe),), LayerSpec(att, moe).norm)
    g = torch.Generator().manual_seed(seed)
    w = {"layers.0.moe.router.weight": torch.randn(experts, H, generator=g)}
    for e in range(experts):
        for name, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            w[f"layers.0.moe.experts.{e}.{name}.weight"] = torch.randn(shape, generator=g) * 0.5
    return spec, moe, w


def numpy_ffn(w, e, z):
    g = z @ w[f"layers.0.moe.experts.{e}.gate.weight"].numpy().T
    u = z @ w[f"layers.0.moe.experts.{e}.up.weight"].numpy().T
    return (g / (1 + np.exp(-g)) * u) @ w[f"layers.0.moe.experts.{e}.down.weight"].numpy().T


def reference(w, z, experts, weights, keep=None):
    """Per-token loop; ``keep[t, j]`` False leaves pair (t, j) out (a dropped token-slot)."""
    z = z.numpy().astype(np.float64)
    out = np.zeros_like(z)
    for t in range(z.shape[0]):
        for j in range(experts.shape[1]):
            if keep is None or keep[t, j]:
                out[t] += weights[t, j] * numpy_ffn(w, int(experts[t, j]), z[t:t + 1])[0]
    return out


@st.composite
def scenarios(draw):
    experts = draw(st.integers(2, 8))
    top_k = draw(st.integers(1, min(3, experts)))
    seq = draw(st.integers(1, 24))
    order = draw(st.permutations(range(experts)))
    cuts = sorted(draw(st.sets(st.integers(1, experts - 1), max_size=experts - 1)))
    bounds = [0, *cuts, experts]
    groups = []
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        members = tuple(order[a:b])
        shapes = draw(st.integers(0, 3))  # 0: CPU-resident, compact; else the runtime picks one per chunk
        capacities = [tuple(draw(st.sampled_from([1, 2, 3, 5, 8, 16])) for _ in members) for _ in range(shapes)]
        shapes = tuple(StaticShape(f"g{j}.p{v}", c) for v, c in enumerate(capacities))
        groups.append(ExpertGroup(f"g{j}", members, shapes, draw(st.sampled_from([0.5, 1.0, 2.0]))))
    return experts, top_k, seq, groups, draw(st.integers(0, 2**16))


def run(scenario, overflow, device=None, chunks=0):
    experts, top_k, seq, groups, seed = scenario
    spec, moe, w = make_layer(experts, top_k, seed)
    graphs = {s.graph: TorchGraphExecutor(experts_graph(spec, 0, g.experts, s.capacities, s.graph), w)
              for g in groups for s in g.shapes}
    cpu = {e: TorchGraphExecutor(experts_graph(spec, 0, (e,), (1,), f"e{e}"), w) for e in range(experts)}
    layer = MoELayer(0, moe, w, groups, CpuExperts(cpu), overflow, device)
    z = torch.randn(seq, H, generator=torch.Generator().manual_seed(seed + 1))
    attn_out = torch.randn(seq, H, generator=torch.Generator().manual_seed(seed + 2))
    seen = {}
    m = Metrics()
    y = layer(z, attn_out, seq, lambda name, x: graphs[name](x), m,
              on_route=lambda i, e, wt, a: seen.update(experts=e.clone(), weights=wt.clone()), chunks=chunks)
    return w, z, attn_out, y.numpy(), seen, m.counts | {"seconds": m.seconds}, groups


def launched_capacity(groups, experts) -> dict[int, int]:
    """Each expert's slots in the chunk's launch: per static group, the shape with the least padding +
    overflow_cost · overflow for this chunk's loads (the first such); 0 for CPU-resident experts."""
    loads = np.bincount(experts.reshape(-1), minlength=max(e for g in groups for e in g.experts) + 1)
    capacity = {}
    for g in groups:
        if not g.shapes:
            capacity |= dict.fromkeys(g.experts, 0)
            continue
        costs = [sum(max(0, c - loads[e]) + g.overflow_cost * max(0, loads[e] - c)
                     for e, c in zip(g.experts, s.capacities)) for s in g.shapes]
        capacity |= dict(zip(g.experts, g.shapes[int(np.argmin(costs))].capacities))
    return capacity


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(scenarios())
def test_spill_computes_every_pair_exactly_once(scenario):
    w, z, _, y, seen, counts, groups = run(scenario, "spill")
    expected = reference(w, z, seen["experts"].numpy(), seen["weights"].numpy())
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert counts["dropped"] == counts["rerouted"] == 0
    assert counts["routed"] == seen["experts"].numel()


@PROPERTY
@given(scenarios(), st.integers(1, 4))
def test_buffered_launches_compute_every_pair_exactly_once(scenario, chunks):
    """A prompt's tokens dispatched at once, each group launched up to once per chunk on what waits per expert:
    every routed pair runs once, in a launch or spilled, and the result is the per-token reference."""
    w, z, _, y, seen, counts, groups = run(scenario, "spill", chunks=chunks)
    expected = reference(w, z, seen["experts"].numpy(), seen["weights"].numpy())
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert counts["dropped"] == 0 and counts["routed"] == seen["experts"].numel()


@PROPERTY
@given(scenarios(), st.sampled_from(OVERFLOW_POLICIES))
def test_npu_launches_beside_the_cpu_experts_change_nothing(scenario, overflow):
    """The static launches on a worker thread while the CPU experts run give the serial result bit for bit; the
    overlap is accounted whenever both ran (hidden ≤ beside)."""
    _, _, _, serial, _, _, _ = run(scenario, overflow)
    with ThreadPoolExecutor(1) as device:
        _, _, _, overlapped, _, counts, _ = run(scenario, overflow, device)
    np.testing.assert_array_equal(overlapped, serial)
    seconds = counts["seconds"]
    assert seconds.get("cpu_hidden", 0.0) <= seconds.get("cpu_beside_npu", 0.0)


@PROPERTY
@given(scenarios())
def test_drop_accounts_for_every_slot_and_drops_lowest_saliency(scenario):
    w, z, attn_out, y, seen, counts, groups = run(scenario, "drop")
    experts, weights = seen["experts"].numpy(), seen["weights"].numpy()
    capacity = launched_capacity(groups, experts)
    saliency = attn_out.norm(dim=-1).numpy()
    keep = np.ones_like(experts, dtype=bool)
    for e, cap in capacity.items():
        if cap == 0:
            continue  # CPU-resident: every token runs
        pairs = np.argwhere(experts == e)
        if len(pairs) > cap:
            ranked = pairs[np.argsort(-saliency[pairs[:, 0]], kind="stable")]
            for t, j in ranked[cap:]:
                keep[t, j] = False
            kept_min = saliency[ranked[:cap, 0]].min()
            assert saliency[ranked[cap:, 0]].max() <= kept_min  # the lowest-saliency ones went
    assert counts["dropped"] == int((~keep).sum())
    assert counts["spilled"] == counts["rerouted"] == 0
    expected = reference(w, z, experts, weights, keep)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * max(np.abs(expected).max(), 1e-6))


@PROPERTY
@given(scenarios())
def test_reroute_moves_overflow_to_experts_with_room(scenario):
    w, z, _, y, seen, counts, groups = run(scenario, "reroute")
    experts = seen["experts"].numpy()
    capacity = launched_capacity(groups, experts)
    demand = {e: int((experts == e).sum()) for e in capacity}
    overflow = sum(max(0, demand[e] - c) for e, c in capacity.items() if c)
    # every overflowing slot was either moved or, with nowhere to go, dropped
    assert counts["rerouted"] + counts["dropped"] == overflow
    assert counts["spilled"] == 0
    static_room = sum(max(0, c - demand[e]) for e, c in capacity.items() if c)
    assert counts["rerouted"] <= static_room
    assert np.isfinite(y).all()


def test_reroute_preserves_each_tokens_weight_sum():
    """Two experts, capacity 1 each, top-1: the second token must move to the other expert."""
    spec, moe, w = make_layer(2, 1, 0)
    w["layers.0.moe.router.weight"] = torch.tensor([[1.0] * H, [-1.0] * H])
    groups = [ExpertGroup("g0", (0, 1), (StaticShape("g0", (1, 1)),))]
    graphs = {"g0": TorchGraphExecutor(experts_graph(spec, 0, (0, 1), (1, 1), "g0"), w)}
    cpu = {e: TorchGraphExecutor(experts_graph(spec, 0, (e,), (1,), f"e{e}"), w) for e in range(2)}
    layer = MoELayer(0, moe, w, groups, CpuExperts(cpu), "reroute")
    z = torch.ones(2, H)  # both prefer expert 0
    m = Metrics()
    y = layer(z, z, 2, lambda name, x: graphs[name](x), m)
    assert m.counts["rerouted"] == 1 and m.counts["dropped"] == 0
    expected = numpy_ffn(w, 0, z[:1].numpy())[0], numpy_ffn(w, 1, z[1:].numpy())[0]
    np.testing.assert_allclose(y.numpy(), np.stack(expected), rtol=1e-5)  # weight renormalised to 1


def tiny_qwen3(path):
    """Two layers of 6 experts (top-2), written by transformers and loaded."""
    from hf_compare import build_checkpoint, transformers

    import npumoe

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=6, num_experts_per_tok=2,
    )
    build_checkpoint(cfg, path)
    return npumoe.load(path)


@pytest.mark.parametrize("chunk", [3, 8])
def test_planned_engine_matches_reference_with_spill(tmp_path, chunk):
    """A whole model under a deliberately tight plan: logits equal the unplanned program."""
    import npumoe
    from npumoe.core.planning.plan import plan
    from npumoe.core.runtime.calibrate import calibrate

    model = tiny_qwen3(tmp_path)
    ids = np.random.default_rng(0).integers(0, 64, 40)
    profile = calibrate(model, [ids], chunk=chunk)
    tight = plan(model, profile, target="ane", residency="npu", max_overflow=0.3)
    ref = npumoe.Engine(model, chunk=chunk).forward(ids)
    eng = npumoe.Engine(model, plan=tight)
    ours = eng.forward(ids)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    m = eng.metrics
    assert m["routed"] == 40 * 2 * 2 and m["dropped"] == 0 and m["npu_launches"] > 0


def test_decode_graphs_per_expert_read_only_the_hit_experts(tmp_path):
    """A plan whose decode graphs hold one expert each decodes what the unplanned program decodes, launching
    one graph per routed expert and reading (group size - top_k) experts' weights less a layer than one graph per
    group does."""
    import dataclasses

    import npumoe
    from npumoe.core.planning.plan import plan
    from npumoe.core.runtime.calibrate import calibrate

    model = tiny_qwen3(tmp_path)
    ids = np.random.default_rng(1).integers(0, 64, 12)
    whole = plan(model, calibrate(model, [ids], chunk=4), target="ane", residency="npu")
    assert all(len(lp.groups) == 1 and lp.groups[0].decode_experts == 0 for lp in whole.layers.values())
    per_expert = dataclasses.replace(whole, layers={
        i: dataclasses.replace(lp, groups=[dataclasses.replace(lp.groups[0], decode_experts=1)])
        for i, lp in whole.layers.items()})
    ref_tokens, ref_logits = npumoe.Engine(model, chunk=4).generate(ids, 6, return_logits=True)
    read = {}
    for name, p in (("whole", whole), ("per_expert", per_expert)):
        engine = npumoe.Engine(model, plan=p)
        tokens, logits = engine.generate(ids, 6, return_logits=True)
        np.testing.assert_array_equal(tokens, ref_tokens)
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5 * np.abs(ref_logits).max())
        engine.metrics_.reset()
        engine.decode(int(tokens[-1]))
        read[name] = engine.metrics["weight_bytes"]
        launches = sum(n for graph, n in engine.metrics_.graph_runs.items() if ".experts." in graph)
        assert launches == 2 * (2 if name == "per_expert" else 1)  # two layers: top-2 graphs, or the group's one
    expert = 4 * 3 * 16 * 32  # gate, up, down at fp32
    assert read["whole"] - read["per_expert"] == 2 * (6 - 2) * expert


def test_experts_run_side_by_side_equal_each_run_alone(monkeypatch):
    """TorchGraphExecutor.run_many (a decode step's CPU experts, their bf16 linears batched into one kernel
    call per step) gives exactly what each executor gives alone; graphs whose steps differ run one by one. On the
    exact bf16 kernels (the dot-product GEMM, which several rows take where the CPU has it, rounds activations to
    bf16: tests/test_luts_torch_op.py holds it to its spec)."""
    import npumoe
    from npumoe.luts import torch_op

    monkeypatch.setattr(torch_op, "BF16_DOT_FROM", 1 << 30)

    model = npumoe.load(dtype="bfloat16")
    layer = model.spec.moe_layers[0]
    executors = [TorchGraphExecutor(experts_graph(model.spec, layer, (e,), (2,), f"e{e}"), model.weights)
                 for e in range(4)]
    torch.manual_seed(0)
    inputs = [{"x": torch.randn(rows, model.spec.hidden_size)} for rows in (1, 2, 1, 3)]
    side_by_side = TorchGraphExecutor.run_many(executors, inputs)
    for run, x, got in zip(executors, inputs, side_by_side):
        assert torch.equal(got["y"], run(x)["y"])
        widened = TorchGraphExecutor(run.graph, {n: model.weights[n].float() for n in run.graph.weight_names()})
        torch.testing.assert_close(got["y"], widened(x)["y"], rtol=0, atol=1e-4)  # torch's fp32 ops: the truth
    pair = TorchGraphExecutor(experts_graph(model.spec, layer, (0, 1), (2, 2), "pair"), model.weights)  # more steps
    x = {"x": torch.randn(4, model.spec.hidden_size)}
    mixed = TorchGraphExecutor.run_many([executors[0], pair], [inputs[0], x])
    assert torch.equal(mixed[0]["y"], executors[0](inputs[0])["y"]) and torch.equal(mixed[1]["y"], pair(x)["y"])


def test_a_prompts_experts_in_one_pass_equal_each_run_alone():
    """TorchGraphExecutor.prompt_many (a prompt's bf16 SwiGLU experts: gate and up products into two buffers by one
    kernel call, silu and product over the whole buffers, the down products by another; a product the kernels do
    not take, such as 20 rows on the portable build, by the graph's own linear) gives each expert's rows exactly
    what running its graph gives, and declines experts that are not plain bf16 SwiGLUs."""
    import npumoe

    model = npumoe.load(dtype="bfloat16")
    layer = model.spec.moe_layers[0]
    executors = [TorchGraphExecutor(experts_graph(model.spec, layer, (e,), (1,), f"e{e}"), model.weights)
                 for e in range(4)]
    counts = [1, 5, 20, 3]  # the GEMV and a GEMM with its last rows as dot products, on builds that have them
    torch.manual_seed(0)
    x = torch.randn(sum(counts), model.spec.hidden_size)
    got = TorchGraphExecutor.prompt_many(executors, x, counts)
    want = torch.cat([run({"x": part})["y"] for run, part in zip(executors, torch.split(x, counts))])
    assert torch.equal(got, want)
    pair = TorchGraphExecutor(experts_graph(model.spec, layer, (0, 1), (2, 2), "pair"), model.weights)  # two experts
    assert TorchGraphExecutor.prompt_many([executors[0], pair], x[:5], [1, 4]) is None
    graph = executors[0].graph
    fp32 = TorchGraphExecutor(graph, {n: model.weights[n].float() for n in graph.weight_names()})
    assert TorchGraphExecutor.prompt_many([fp32], x[:2], [2]) is None


@pytest.mark.parametrize("bits", [4, 2])
def test_a_prompts_packed_experts_in_one_pass_equal_each_run_alone(bits, tmp_path, monkeypatch):
    """prompt_many on packed SwiGLU experts (npumoe quantize): every expert's products that the op would give the
    int8 GEMM in one kernel call, those it would give the LUT-GEMV in another, per product kind (gate and up, then
    down) — each expert's rows exactly what running its graph gives, which calls every linear on its own."""
    import npumoe
    from npumoe.luts import torch_op
    from npumoe.models.checkpoints.quantize import quantize_checkpoint
    from npumoe.models.loader import DEMO_DIR

    quantize_checkpoint(DEMO_DIR, tmp_path / "q", bits=bits, group=64)
    model = npumoe.load(tmp_path / "q")
    layer = model.spec.moe_layers[0]
    executors = [TorchGraphExecutor(experts_graph(model.spec, layer, (e,), (1,), f"e{e}"), model.weights)
                 for e in range(4)]
    counts = [1, 5, 20, 3]  # below and above the int8 GEMM's rows (tests fix the crossovers at the defaults)
    torch.manual_seed(0)
    x = torch.randn(sum(counts), model.spec.hidden_size)
    calls = torch_op._kernels().calls
    if not hasattr(calls, "gemv_rows_many_at"):
        pytest.skip(f"the {torch_op._kernels().isa} kernels run emulated, one call at a time")
    batches = []
    for name in ("gemv_rows_many_at", "gemm_i8_many_at"):
        original = getattr(calls, name)
        def spied(tasks, threads, run=original, name=name):
            if (ran := run(tasks, threads)) is not False:  # (the int8 batch declines where the build has no int8 GEMM)
                batches.append((name, len(tasks)))
            return ran

        monkeypatch.setattr(calls, name, spied)
    got = TorchGraphExecutor.prompt_many(executors, x, counts)
    monkeypatch.undo()
    want = torch.cat([run({"x": part})["y"] for run, part in zip(executors, torch.split(x, counts))])
    assert torch.equal(got, want)
    int8 = calls.gemm_i8_many_at([], 1)  # does the build have one?

    def path(rows):  # lut_product's choice
        if int8 and torch_op.uses_int8(rows, bits):
            return "gemm_i8_many_at"
        return None if torch_op.uses_gemm(rows, bits) else "gemv_rows_many_at"

    expected = [(name, per_expert * sum(path(rows) == name for rows in counts)) for per_expert in (2, 1)
                for name in ("gemm_i8_many_at", "gemv_rows_many_at")]
    assert batches == [(name, n) for name, n in expected if n]


def test_packed_experts_side_by_side_equal_each_linear_called_alone(tmp_path, monkeypatch):
    """A decode step's packed experts (npumoe quantize) run side by side, their LUT-GEMVs batched into one
    kernel call per step, give exactly what calling every linear on its own gives."""
    import npumoe
    from npumoe.core.compiler import interpreter
    from npumoe.luts.torch_op import lut_linear_many
    from npumoe.models.checkpoints.quantize import quantize_checkpoint
    from npumoe.models.loader import DEMO_DIR

    quantize_checkpoint(DEMO_DIR, tmp_path / "q", bits=4, group=64, linears="all")
    model = npumoe.load(tmp_path / "q")
    layer = model.spec.moe_layers[0]
    executors = [TorchGraphExecutor(experts_graph(model.spec, layer, (e,), (1,), f"e{e}"), model.weights)
                 for e in range(4)]
    torch.manual_seed(0)
    inputs = [{"x": torch.randn(1, model.spec.hidden_size)} for _ in executors]
    batches = []

    def spied(xs, linears):
        batches.append(len(xs)) if (ys := lut_linear_many(xs, linears)) is not None else None
        return ys

    monkeypatch.setitem(interpreter.BATCHED, interpreter._lut_linear, spied)
    side_by_side = TorchGraphExecutor.run_many(executors, inputs)
    assert batches == [8, 4]  # gate and up of the 4 experts, then their downs
    monkeypatch.setattr(interpreter, "BATCHED", {})  # every linear on its own
    for run, x, got in zip(executors, inputs, side_by_side):
        assert torch.equal(got["y"], run(x)["y"])


@pytest.mark.parametrize("stored", ["bfloat16", "int4"])
def test_a_tokens_experts_fused_into_one_call_equal_the_interpreted_sum(stored, tmp_path):
    """combine_many (a decode token's SwiGLU experts in one kernel call: gate and up of all, the activation, every
    down, the weighted sum) gives Σ_e w_e · expert_e(x) as the interpreter computes it step by step. bf16 matrices
    to float rounding; packed ones to the LUT's own rounding (the down projection quantises its activation into
    8-bit tables, where a last-place difference in silu can move one table entry by a step)."""
    import npumoe
    from npumoe.models.checkpoints.quantize import quantize_checkpoint
    from npumoe.models.loader import DEMO_DIR

    if stored == "int4":
        quantize_checkpoint(DEMO_DIR, tmp_path / "q", bits=4, group=64, linears="all")
        model = npumoe.load(tmp_path / "q")
    else:
        model = npumoe.load(dtype="bfloat16")
    layer = model.spec.moe_layers[0]
    executors = [TorchGraphExecutor(experts_graph(model.spec, layer, (e,), (1,), f"e{e}"), model.weights)
                 for e in (5, 0, 3)]
    torch.manual_seed(1)
    x, gates = torch.randn(1, model.spec.hidden_size), torch.rand(3)
    fused = TorchGraphExecutor.combine_many(executors, x, gates)
    interpreted = sum(w * run({"x": x})["y"] for w, run in zip(gates, executors))
    scale = float(interpreted.abs().max())
    torch.testing.assert_close(fused, interpreted, rtol=0, atol=(1e-6 if stored == "bfloat16" else 2e-3) * scale)
    assert TorchGraphExecutor.combine_many(executors, torch.randn(2, model.spec.hidden_size), gates[:2]) is None
    if stored == "bfloat16":  # an expert of fp32 matrices joins the call; one of fp16 ones leaves it to the caller
        graph, names = executors[0].graph, executors[0].graph.weight_names()
        widened = TorchGraphExecutor(graph, {n: model.weights[n].float() for n in names})
        torch.testing.assert_close(TorchGraphExecutor.combine_many([widened, *executors[1:]], x, gates), interpreted,
                                   rtol=0, atol=1e-5 * scale)
        halved = TorchGraphExecutor(graph, {n: model.weights[n].half() for n in names})
        assert TorchGraphExecutor.combine_many([halved, *executors[1:]], x, gates) is None

