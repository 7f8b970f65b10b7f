"""Executors within a memory budget (LRU, prefetch) and the decode routing predictor that feeds the prefetch."""

import numpy as np
import pytest
import torch
from hf_compare import build_checkpoint, transformers

import npumoe
from npumoe.core.base.errors import InputError
from npumoe.core.ir.backend import DeviceMemoryFull
from npumoe.core.runtime.metrics import Metrics
from npumoe.core.runtime.predictor import RoutingPredictor, recall_at
from npumoe.core.runtime.residency import ResidentExecutors


def test_least_recently_used_is_evicted_first():
    loaded = []
    loaders = {n: (lambda n=n: loaded.append(n) or n.upper()) for n in "abcd"}
    m = Metrics()
    cache = ResidentExecutors(loaders, dict.fromkeys("abcd", 10), budget=25, metrics=m)
    assert [cache[n] for n in "ab"] == ["A", "B"]
    assert cache["a"] == "A"  # a hit: b is now the least recently used
    cache["c"]
    assert sorted(n for n in "abcd" if n in cache._resident) == ["a", "c"]
    cache.prefetch(["d", "a"])  # d evicts a (least recently used), then a, loaded again, evicts c
    assert loaded == ["a", "b", "c", "d", "a"]
    assert m.counts["executor_hits"] == 1 and m.counts["executor_misses"] == 3 and m.counts["evictions"] == 3
    assert cache["a"] == "A" and m.counts["prefetch_hits"] == 1
    assert m.counts["peak_resident_bytes"] == 20


def test_a_graph_larger_than_the_budget_still_runs():
    m = Metrics()
    cache = ResidentExecutors({"big": lambda: "BIG", "small": lambda: "SMALL"}, {"big": 100, "small": 1}, 10, m)
    assert cache["big"] == "BIG" and cache["small"] == "SMALL" and cache["big"] == "BIG"
    assert m.counts["evictions"] == 2


class Device:
    """A device that holds ``capacity`` loaded graphs and refuses the next one, as QNN does with MEM_ALLOC."""

    def __init__(self, capacity: int):
        self.capacity, self.live = capacity, set()

    def loader(self, name: str):
        def load():
            if len(self.live) >= self.capacity:
                raise DeviceMemoryFull("full")
            self.live.add(name)
            return Closing(self, name)
        return load


class Closing:
    def __init__(self, device, name):
        self.device, self.name = device, name

    def close(self):
        self.device.live.remove(self.name)


def test_a_full_device_sets_the_budget_to_what_it_held():
    """Without a budget every graph is loaded until the device refuses one; the rest load on demand, evicting."""
    device, m = Device(3), Metrics()
    cache = ResidentExecutors({n: device.loader(n) for n in "abcdef"}, dict.fromkeys("abcdef", 10), None, m)
    cache.load_all()
    assert cache.budget == 30 and device.live == {"b", "c", "d"} and m.counts["device_full"] == 1  # d evicted a
    assert [cache[n].name for n in "fedcba"] == list("fedcba")
    assert len(device.live) <= 3 and m.counts["device_full"] == 1  # the budget keeps it from refusing again


def test_a_graph_the_empty_device_refuses_is_named():
    cache = ResidentExecutors({"big": Device(0).loader("big")}, {"big": 5_000_000}, None, Metrics())
    with pytest.raises(InputError, match=r"graph big \(5 MB\) does not fit the device's memory even with every other"):
        cache.load_all()


@pytest.fixture(scope="module")
def demo():
    return npumoe.load()


CFG = dict(vocab_size=256, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def planned(demo):
    """A plan with several expert groups and shapes, and held-out tokens."""
    from npumoe.models.demo import corpus

    profile = npumoe.calibrate(demo, [t[:1500] for t in corpus.calibration_texts(4)], chunk=16)
    ids = demo.tokenizer.encode(corpus.heldout_texts(1)[0][:400])
    return npumoe.plan(demo, profile, target="htp", residency="npu"), np.asarray(ids[:48])


@pytest.mark.parametrize("budget", [0, "half"])
def test_same_logits_under_any_budget(demo, planned, budget):
    """Graphs evicted and loaded again compute what resident ones do; resident bytes never pass the budget by more
    than one graph (the one being run)."""
    plan, ids = planned
    reference = npumoe.Engine(demo, plan=plan)
    sizes = reference.executors.sizes
    limit = sum(sizes.values()) // 2 if budget == "half" else budget
    engine = npumoe.Engine(demo, plan=plan, max_resident_bytes=limit)
    np.testing.assert_array_equal(engine.forward(ids), reference.forward(ids))
    np.testing.assert_array_equal(engine.generate(ids[:16], 8), reference.generate(ids[:16], 8))
    m = engine.metrics
    assert m["evictions"] > 0 and m["executor_misses"] > 0
    assert m["peak_resident_bytes"] <= max(limit, max(sizes.values()))


def test_prefetch_with_the_predictor_keeps_the_logits(demo, planned):
    plan, ids = planned
    reference = npumoe.Engine(demo, plan=plan).generate(ids[:16], 8)
    probe = npumoe.Engine(demo, plan=plan)
    half = sum(probe.executors.sizes.values()) // 2
    engine = npumoe.Engine(demo, plan=plan, max_resident_bytes=half, predictor=RoutingPredictor(demo))
    np.testing.assert_array_equal(engine.generate(ids[:16], 8), reference)
    m = engine.metrics
    assert m["prefetches"] > 0 and m["prefetch_hits"] > 0
    assert 0 < m["predicted_hits"] <= m["routed_experts"]


def test_early_router_is_exact_when_attention_adds_nothing(tmp_path):
    """Attention output projections at zero make h = x, so the router one attention early sees what the router
    sees: at decode every routed expert is predicted (a transformers checkpoint, run by the engine)."""
    def silence_attention(model):
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()

    build_checkpoint(transformers.Qwen3MoeConfig(**CFG), tmp_path, prepare=silence_attention)
    (tmp_path / "npumoe_tokenizer.json").write_text('{"kind": "bytes"}')
    model = npumoe.load(tmp_path)
    engine = npumoe.Engine(model, predictor=RoutingPredictor(model))
    logits = engine.forward(np.arange(1, 20))
    engine.metrics_.reset()
    for _ in range(8):
        logits = engine.decode(int(np.argmax(logits[-1] if logits.ndim == 2 else logits)))
    m = engine.metrics
    assert m["routed_experts"] == 8 * 2 * 2  # 8 tokens, 2 layers, top-2
    assert m["predicted_hits"] == m["routed_experts"]


def test_fitted_map_learns_cross_layer_routing(demo):
    """Traces where layer 1 always routes to the experts layer 0 chose, while the early router logits carry no
    information: the fitted map must predict from the previous layer's choice alone."""
    gen = torch.Generator().manual_seed(1)
    k, experts = demo.spec.layers[1].ffn.router.top_k, demo.spec.layers[1].ffn.num_experts
    traces = []
    for _ in range(40):
        previous = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(8)])
        traces.append((1, torch.randn(8, demo.spec.hidden_size, generator=gen), previous, previous.clone()))
    predictor = RoutingPredictor(demo).fit(traces, ridge=1e-4)
    for _, x, previous, routed in traces[:10]:
        for t in range(len(x)):
            assert recall_at(predictor.top(1, x[t:t + 1], k, previous[t:t + 1]), routed[t]) == 1.0


def test_npu_launches_overlap_the_cpu_experts(demo, planned):
    """A plan that spills: with the NPU groups on their worker thread the logits are the serial run's, and the CPU
    experts' time beside the launches is accounted (part of it hidden under them)."""
    plan, ids = planned
    serial = npumoe.Engine(demo, plan=plan, overlap=False)
    overlapped = npumoe.Engine(demo, plan=plan, overlap=True)  # the NPU graphs on a CPU worker: a stand-in device
    np.testing.assert_array_equal(overlapped.forward(ids), serial.forward(ids))
    seconds = overlapped.metrics["seconds"]
    assert overlapped.metrics["spilled"] > 0 and 0 < seconds["cpu_hidden"] <= seconds["cpu_beside_npu"]
    assert "cpu_beside_npu" not in serial.metrics["seconds"]


def test_buffering_pads_less_and_keeps_the_logits(demo, planned):
    """A 3-chunk prompt layer by layer, each expert's tokens waiting for full launches: the per-chunk run's logits,
    with fewer padded slots."""
    plan, ids = planned
    per_chunk = npumoe.Engine(demo, plan=plan, buffering=False)
    buffered = npumoe.Engine(demo, plan=plan)
    np.testing.assert_allclose(buffered.forward(ids), per_chunk.forward(ids), atol=2e-5)
    np.testing.assert_array_equal(buffered.generate(ids[:40], 6), per_chunk.generate(ids[:40], 6))
    assert buffered.metrics["padded"] < per_chunk.metrics["padded"]
    assert buffered.metrics["routed"] == per_chunk.metrics["routed"]


def test_routing_traces_pair_each_chunk_with_the_state_that_entered_its_layer(demo):
    """Three chunks a window: a trace per MoE layer and chunk, in the order the engine routes them, each holding
    the chunk's hidden state entering the layer and the experts the engine's router chose for it."""
    from npumoe.core.runtime.predictor import routing_traces

    ids = np.asarray(demo.tokenizer.encode("def add(a, b):\n    return a + b\n" * 3))[:48]
    routed = []
    npumoe.Engine(demo, chunk=16, on_route=lambda layer, e, *_: routed.append((layer, e.clone()))).route(ids)
    traces = routing_traces(demo, [ids], chunk=16)
    layers = list(demo.spec.moe_layers)
    assert [t[0] for t in traces] == layers * 3  # chunk-major: every layer of chunk 0, then chunk 1, ...
    assert sorted((layer, e.tolist()) for layer, e in routed) == sorted((t[0], t[3].tolist()) for t in traces)
    for (layer, x, previous, experts) in traces:
        assert x.shape == (16, demo.spec.hidden_size) and experts.shape == (16, 2)
        assert previous is None if layer == layers[0] else previous.shape == (16, 2)
