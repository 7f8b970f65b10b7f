"""Calibration and planning: what they measure, what they decide, and how they refuse bad input."""

import json

import numpy as np
import pytest
from cli_check import cli_error
from hf_compare import build_checkpoint, transformers

import npumoe
from npumoe.cli import main
from npumoe.core.base.errors import ArtifactError, InputError
from npumoe.core.planning.plan import (
    Plan,
    chosen_shapes,
    expected_overflow,
    expected_padding,
    optimal_shapes,
    plan,
    shape_costs,
)
from npumoe.core.planning.profile import RoutingProfile, imbalance, overlap_at_k
from npumoe.core.runtime.calibrate import calibrate

CFG = dict(vocab_size=256, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts_per_tok=2)


def byte_model(path, experts=8, seed=0):
    build_checkpoint(transformers.Qwen3MoeConfig(**CFG, num_experts=experts), path, seed=seed)
    (path / "npumoe_tokenizer.json").write_text('{"kind": "bytes"}')
    return npumoe.load(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return byte_model(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def profile(model):
    rng = np.random.default_rng(0)
    texts = [rng.integers(32, 127, 700).tolist() for _ in range(3)]
    return calibrate(model, texts, chunk=32)


def test_profile_counts_every_routed_token(model, profile):
    for i in model.spec.moe_layers:
        loads = profile.loads[i]
        assert loads.shape == (3 * (700 // 32), 8)  # full chunks only
        assert (loads.sum(axis=1) == 32 * 2).all()  # top-2 of 32 tokens
        assert profile.imbalance(i) == pytest.approx(np.mean(loads.max(1) / loads.mean(1)))
        assert list(profile.popularity(i)) == list(np.argsort(-loads.sum(0), kind="stable"))


def test_calibration_routes_without_the_lm_head_and_sees_what_a_full_forward_routes(model, monkeypatch):
    from npumoe.core.planning.profile import LoadRecorder
    from npumoe.core.runtime.engine import Engine

    ids = np.random.default_rng(1).integers(32, 127, 96)
    full, routed = LoadRecorder(model.spec), LoadRecorder(model.spec)
    Engine(model, chunk=32, on_route=full).forward(ids)
    engine = Engine(model, chunk=32, on_route=routed)
    heads = []
    run = engine._run
    monkeypatch.setattr(engine, "_run", lambda name, *args: heads.append(name) or run(name, *args))
    engine.route(ids)
    assert not any(name.startswith("lm_head") for name in heads)
    for i in model.spec.moe_layers:
        np.testing.assert_array_equal(routed.matrix(i), full.matrix(i))


def test_profile_round_trips_and_overlap(model, profile, tmp_path):
    path = profile.save(tmp_path / "p.json")
    again = RoutingProfile.load(path)
    for i in profile.layers:
        np.testing.assert_array_equal(again.loads[i], profile.loads[i])
    assert overlap_at_k(profile, again, 2) == {i: 1.0 for i in profile.layers}


def test_one_shape_never_pads_more_than_one_capacity():
    rng = np.random.default_rng(1)
    loads = rng.poisson(lam=rng.uniform(5, 40, size=8), size=(200, 8))
    (shapes,), _ = optimal_shapes([loads], align=1, max_overflow=0.10, count=1)
    pad, over = (x[:, 0].mean() for x in shape_costs(loads, shapes))
    assert shapes.shape == (1, 8) and over <= 0.10 * loads.sum(1).mean() + 1e-9
    # the best single capacity meeting the same overflow budget pads at least as much
    for c in range(1, loads.max() + 1):
        if expected_overflow(loads, np.array([c])).sum() <= 0.10 * loads.sum(1).mean():
            assert expected_padding(loads, np.array([c])).sum() >= pad - 1e-9
            break


def test_shapes_follow_the_routing_patterns():
    """Chunks alternate between two patterns (a topic shift moves load between experts): one shape must pad
    every chunk's quiet experts to the other pattern's size; two shapes fit both, and each chunk launches
    its own."""
    rng = np.random.default_rng(2)
    pattern = np.array([[40, 8, 8, 8], [8, 8, 8, 40]])
    loads = pattern[np.arange(300) % 2] + rng.integers(-2, 3, size=(300, 4))
    padding = {}
    for count in (1, 2):
        (shapes,), lam = optimal_shapes([loads], align=1, max_overflow=0.10, count=count)
        chosen = chosen_shapes(loads, shapes, lam)
        pad, over = shape_costs(loads, shapes)
        padding[count] = pad[np.arange(300), chosen].sum() / shapes.sum(axis=1)[chosen].sum()
        assert over[np.arange(300), chosen].mean() <= 0.10 * loads.sum(1).mean() + 1e-9
    assert padding[2] < 0.1 < padding[1]
    assert len(set(chosen[::2])) == len(set(chosen[1::2])) == 1 and chosen[0] != chosen[1]


def test_plan_respects_alignment_and_round_trips(model, profile, tmp_path):
    p = plan(model, profile, target="ane", residency="npu")
    for lp in p.layers.values():
        assert all(c % 16 == 0 for g in lp.groups for shape in g.shapes for c in shape)
        grouped = sorted(e for g in lp.groups for e in g.experts)
        assert grouped == list(range(8))  # every expert in exactly one group
    assert Plan.load(p.save(tmp_path / "plan.json")).to_json() == p.to_json()


def test_plan_with_capacity_tiers_still_loads(model, profile):
    """Plans written before shapes held capacity tiers and one ``capacity`` per group (0: CPU-resident)."""
    data = plan(model, profile, target="ane", residency="npu").to_json()
    for lp in data["layers"].values():
        lp |= {"tiers": [32, 16], "expert_tier": [0] * 8}
        del lp["overflow_cost"]
        for j, g in enumerate(lp["groups"]):
            g["capacity"] = 32 * j
            del g["shapes"]
    old = Plan.from_json(data)
    for lp in old.layers.values():
        assert lp.overflow_cost == 1.0
        assert [g.shapes for g in lp.groups] == [[] if j == 0 else [[32 * j] * len(g.experts)]
                                                for j, g in enumerate(lp.groups)]


def test_decode_graphs_hold_a_group_when_launches_cost_most_and_one_expert_when_bytes_do():
    from npumoe.core.ir.backend import Capabilities
    from npumoe.core.planning.plan import decode_graph_experts, graph_hit

    hit = np.array([0.5, 0.4, 0.3, 0.3, 0.2, 0.15, 0.1, 0.05])  # sums to top_k = 2
    launch_bound = Capabilities("slow launches", frozenset(), dispatch_seconds=1e-3, weight_bytes_per_second=1e15)
    byte_bound = Capabilities("free launches", frozenset(), dispatch_seconds=0.0, weight_bytes_per_second=1e9)
    assert decode_graph_experts(hit, 2, 1 << 20, launch_bound) == 8
    assert decode_graph_experts(hit, 2, 1 << 20, byte_bound) == 1
    assert graph_hit(hit, 2) == 1.0  # a graph of every expert: every token
    assert 0.4 < graph_hit(hit[:1], 2) <= 0.5  # one expert: exactly 0.5 (draws with replacement count a little low)


def test_decode_graph_cuts_round_trip_and_a_bad_cut_is_refused(model, profile):
    data = plan(model, profile, target="ane", residency="npu").to_json()
    for lp in data["layers"].values():
        lp["groups"][0]["decode_experts"] = 3
    cut = Plan.from_json(data)
    layer = next(iter(cut.layers))
    size = len(cut.layers[layer].groups[0].experts)
    decode = [g for g in cut.groups(layer, 1) if g.shapes]
    assert [len(g.experts) for g in decode][:size // 3] == [3] * (size // 3)
    assert sorted(e for g in decode for e in g.experts) == sorted(e for g in cut.groups(layer, cut.chunk)
                                                                  if g.shapes for e in g.experts)
    assert len({s.graph for g in decode for s in g.shapes}) == len(decode)
    data["layers"][str(layer)]["groups"][0]["decode_experts"] = size + 1
    with pytest.raises(ArtifactError, match="decode graphs"):
        Plan.from_json(data).check_model(model)


def test_auto_residency_keeps_tiny_experts_off_the_npu(model, profile):
    """These experts are far too small to pay for an HTP launch; forcing npu overrides that."""
    auto = plan(model, profile, target="htp", residency="auto")
    assert all(g.residency == "cpu" for lp in auto.layers.values() for g in lp.groups)
    forced = plan(model, profile, target="htp", residency="npu")
    assert all(g.residency == "npu" and g.shapes for lp in forced.layers.values() for g in lp.groups)


def test_htp_plans_store_each_expert_in_one_graph_and_decode_on_it(model, profile):
    """The HTP cannot share weights between graphs: each NPU group gets one compiled shape, decode launches it, so
    every expert's weights are in exactly one graph; the engine still computes the unplanned reference's tokens."""
    from npumoe.core.compiler.program import build_program

    p = plan(model, profile, target="htp", residency="npu", graphs_per_layer=6)
    assert p.decode == "prefill" and plan(model, profile, target="ane", residency="npu").decode == "own"
    graphs = build_program(model.spec, chunk=p.chunk, max_context=64, plan=p).graphs
    experts = [g for g in graphs.values() if g.kind == "experts" and g.placement == "npu"]
    names = [n for g in experts for n in g.weight_names()]
    assert experts and len(names) == len(set(names)) == 3 * model.spec.layers[0].ffn.num_experts * len(p.layers)
    for i in p.layers:
        assert [s.graph for g in p.groups(i, 1) for s in g.shapes] == [s.graph for g in p.groups(i, p.chunk)
                                                                      for s in g.shapes]
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))).decode == "prefill"
    ids = np.asarray(model.tokenizer.encode("def add(a, b):\n    return a + b\n"))
    np.testing.assert_array_equal(npumoe.Engine(model, plan=p).generate(ids, 8), npumoe.Engine(model).generate(ids, 8))


def test_profile_from_another_model_is_refused(profile, tmp_path):
    other = byte_model(tmp_path / "other", experts=4)
    with pytest.raises(ArtifactError, match="another model"):
        plan(other, profile, target="htp")


def first_layer(data: dict) -> dict:
    return next(iter(data["layers"].values()))


def nan_count(data):
    first_layer(data)["loads"][0][0] = float("nan")


def huge_count(data):
    first_layer(data)["loads"][0][0] = 10 ** 30


def negative_count(data):  # the chunk's sum kept: the count itself is what no calibration gives
    row = first_layer(data)["loads"][0]
    row[0], row[1] = -1000, row[1] + row[0] + 1000


def a_token_too_many(data):
    row = first_layer(data)["loads"][0]
    row[row.index(min(row))] += 1


def no_top_k(data):
    del first_layer(data)["top_k"]


def no_chunk(data):
    del data["chunk"]


@pytest.mark.parametrize("edit, message", [
    (nan_count, "loads hold the count nan, where 0 to the chunk's 32 tokens belong"),
    (huge_count, "loads hold the count 1000000000000000000000000000000, where 0 to"),
    (negative_count, "loads hold the count -1000, where 0 to the chunk's 32 tokens belong"),
    (a_token_too_many, "loads do not count chunk 32 × top-k 2 = 64 routed tokens in every chunk"),
    (no_top_k, "top_k is None, not a whole number ≥ 1"),
    (no_chunk, "its 'chunk' is None, not a whole number ≥ 1"),
])
def test_impossible_profile_counts_are_named_before_planning(model, profile, tmp_path, capsys, edit, message):
    """Negative counts planned groups "reading −1509.9 MB"; NaN, a missing field, a count past the chunk failed
    deep in numpy, or planned from nonsense."""
    data = profile.to_json()
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=f"edited.json is damaged: .*{message}.*npumoe calibrate"):
        RoutingProfile.load(path)
    assert "make a new one with npumoe calibrate" in cli_error(
        capsys, "plan", "--model", str(model.path), "--profile", str(path), "--target", "cpu", "--out",
        str(tmp_path / "plan.json"))


def test_plan_for_another_model_is_refused(model, profile, tmp_path):
    other = byte_model(tmp_path / "other", experts=4)
    p = plan(model, profile, target="htp", residency="npu")
    with pytest.raises(ArtifactError, match="another model"):
        npumoe.Engine(other, plan=p)


def test_infeasible_plan_names_the_limit(model, profile, monkeypatch):
    from dataclasses import replace

    from npumoe.core.ir import backend

    tiny = replace(backend.capabilities("ane"), max_graph_bytes=100)
    monkeypatch.setattr("npumoe.core.planning.plan.capabilities",
                        lambda t: tiny if t == "ane" else backend.capabilities(t))
    with pytest.raises(InputError, match="one expert needs .* GB but a ane graph may hold"):
        plan(model, profile, target="ane")


def test_short_or_empty_calibration_text(model, tmp_path, capsys):
    with pytest.raises(InputError, match="too short"):
        calibrate(model, ["abc"], chunk=32)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--model", str(model.path), "--text", str(empty), "--out", str(tmp_path / "p.json")])
    assert e.value.code == 2 and "empty" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_cli_calibrate_plan_plot(model, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 40)
    main_ok(["calibrate", "--model", str(model.path), "--text", str(text), "--chunk", "32",
             "--out", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")])
    main_ok(["plan", "--model", str(model.path), "--profile", str(tmp_path / "p.json"), "--target", "ane",
             "--residency", "npu", "--out", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png")])
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["kind"] == "npumoe.Plan" and data["target"] == "ane"
    main_ok(["calibrate", "--compare", str(tmp_path / "p.json"), str(tmp_path / "p.json")])


def main_ok(argv):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None)


def test_imbalance_of_balanced_load_is_one():
    assert imbalance(np.full((4, 8), 5)) == 1.0


@pytest.mark.parametrize("missing, expect", [("sdpa", "attn"), ("silu", "experts")])
def test_graphs_a_target_cannot_take_go_to_the_cpu_with_the_reason(model, profile, monkeypatch, missing, expect):
    """The planner places graph by graph from what a backend claims: a target without ``sdpa`` keeps every
    attention graph on the CPU, one without ``silu`` every expert group (and the dense SwiGLU graphs); the
    planned engine still computes the reference's logits."""
    from dataclasses import replace

    from npumoe.core.compiler.program import build_program
    from npumoe.core.ir import backend

    htp = backend.plugin("htp")
    partial = replace(htp, caps=replace(htp.caps, ops=htp.caps.ops - {missing}))
    monkeypatch.setattr("npumoe.core.planning.plan.plugin", lambda t: partial if t == "htp" else backend.plugin(t))
    p = plan(model, profile, target="htp", residency="npu")
    spec = model.spec
    assert p.cpu_graphs and all(reason == f"htp does not take the op {missing}" for reason in p.cpu_graphs.values())
    placed = build_program(spec, chunk=p.chunk, max_context=64, plan=p).graphs
    uses = {name for name, g in placed.items() if any(op.op == missing for op in g.ops)}
    assert all(placed[name].placement == "cpu" for name in uses)
    assert any(g.placement == "npu" for g in placed.values())  # the rest stays on the NPU
    if expect == "attn":
        assert {name for name, g in placed.items() if g.kind == "attention"} == uses
    else:  # no expert graph at all: every group CPU-resident
        assert not any(g.kind == "experts" for g in placed.values())
        assert all(g.residency == "cpu" for lp in p.layers.values() for g in lp.groups)
        assert {f"L{i}.experts" for i in spec.moe_layers} <= set(p.cpu_graphs)
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))).cpu_graphs == p.cpu_graphs
    ids = np.asarray(model.tokenizer.encode("def add(a, b):\n    return a + b\n"))
    np.testing.assert_allclose(npumoe.Engine(model, plan=p).forward(ids), npumoe.Engine(model).forward(ids), atol=1e-4)


def test_decode_graphs_per_layer_are_capped_by_widening_the_most_cut_groups(model, profile, monkeypatch):
    """A byte-bound device cuts groups into one-expert decode graphs; the cap widens the most-cut groups (doubling
    their experts per graph) until a layer has no more graphs than it allows, or one a group; every expert stays in
    exactly one decode graph."""
    import dataclasses

    from npumoe.core.planning import plan as plan_module

    real = plan_module.capabilities
    byte_bound = lambda target: real(target) if target == "cpu" else dataclasses.replace(  # noqa: E731
        real(target), dispatch_seconds=0.0, weight_bytes_per_second=1e9)
    monkeypatch.setattr(plan_module, "capabilities", byte_bound)
    free = plan(model, profile, target="ane", residency="npu", decode_graphs_per_layer=1000)
    capped = plan(model, profile, target="ane", residency="npu", decode_graphs_per_layer=3)

    def graphs(lp):
        return sum(len(g.decode_parts()) for g in lp.groups if g.shapes)

    assert max(graphs(lp) for lp in free.layers.values()) > 3  # the cap has something to do
    for i, lp in capped.layers.items():
        npu = [g for g in lp.groups if g.shapes]
        assert graphs(lp) <= max(3, len(npu))
        assert sorted(e for g in npu for part in g.decode_parts() for e in part) == sorted(e for g in npu
                                                                                           for e in g.experts)
        assert lp.predicted["decode_launches"] <= free.layers[i].predicted["decode_launches"] + 1e-9
    with pytest.raises(InputError, match="decode graphs per layer"):
        plan(model, profile, target="ane", decode_graphs_per_layer=0)


def test_the_decode_graph_cap_defaults_to_what_the_target_devices_hold(model, profile, monkeypatch):
    """The default cap is the most decode graphs a layer whose loaded overhead, over every MoE layer, stays within
    the allowed share of what an app may hold on each of the target's devices; 16 where no device records one."""
    import dataclasses

    from npumoe.core.planning import DECODE_GRAPHS_PER_LAYER, GRAPH_OVERHEAD_SHARE
    from npumoe.core.planning import plan as plan_module
    from npumoe.core.planning.costmodel import devices

    for target, layers in (("ane", 16), ("htp", 16), ("htp", 48), ("ane", 1), ("intel_npu", 16)):
        cap = plan_module.decode_graph_cap(target, layers)
        found = [(GRAPH_OVERHEAD_SHARE * d.ram_gb * d.app_share * 1e9, layers * d.graph_overhead_mb * 1e6)
                 for _, d in devices(target)]
        assert all(cap.graphs * per_graph <= share for share, per_graph in found), (target, layers)
        assert any((cap.graphs + 1) * per_graph > share for share, per_graph in found), (target, layers)
        assert f"{layers} MoE layers" in cap.source and "MB a loaded graph" in cap.source
    assert plan_module.decode_graph_cap("mlx", 16).graphs == DECODE_GRAPHS_PER_LAYER  # its records price no graph

    real = plan_module.capabilities
    monkeypatch.setattr(plan_module, "capabilities", lambda target: real(target) if target == "cpu" else
                        dataclasses.replace(real(target), dispatch_seconds=0.0, weight_bytes_per_second=1e9))
    monkeypatch.setattr(plan_module, "decode_graph_cap", lambda target, layers: plan_module.DecodeCap(3, "a record"))
    default = plan(model, profile, target="ane", residency="npu").to_json()
    assert default == plan(model, profile, target="ane", residency="npu", decode_graphs_per_layer=3).to_json()
    assert default != plan(model, profile, target="ane", residency="npu", decode_graphs_per_layer=1000).to_json()
