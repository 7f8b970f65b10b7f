"""On the shipped demo model: a plan for every target, run by the host runtime, gives the
reference engine's logits (overflow spilled, so nothing is lost), and the planner's predictions
agree with what the runtime then measures on held-out text."""

import numpy as np
import pytest

import npumoe
from npumoe.models.demo import corpus

CHUNK = 64


@pytest.fixture(scope="module")
def demo():
    return npumoe.load()


@pytest.fixture(scope="module")
def profile(demo):
    return npumoe.calibrate(demo, [t[:1536] for t in corpus.calibration_texts(8)], chunk=CHUNK, window=512)


@pytest.fixture(scope="module")
def held(demo):
    return np.asarray(demo.tokenizer.encode(corpus.heldout_texts(1)[0])[: 3 * CHUNK + 17])


@pytest.fixture(scope="module")
def reference(demo, held):
    return npumoe.Engine(demo).forward(held)


@pytest.mark.parametrize("target", ["cpu", "htp", "ane"])
def test_planned_engine_matches_the_reference(demo, profile, held, reference, target):
    plan = npumoe.plan(demo, profile, target=target, residency="npu")
    eng = npumoe.Engine(demo, plan=plan)
    logits = eng.forward(held)
    scale = np.abs(reference).max()
    assert np.abs(logits - reference).max() <= 1e-5 * scale
    m = eng.metrics
    assert m["dropped"] == 0 and m["npu_launches"] > 0
    assert m["routed"] == len(held) * 2 * demo.spec.num_layers  # top-2 in every layer
    caps = npumoe.core.ir.backend.capabilities(target)
    assert all(c % caps.alignment == 0 for lp in plan.layers.values() for g in lp.groups for s in g.shapes for c in s)


def test_trained_routing_is_skewed_and_capacities_follow_it(demo, profile):
    """The demo exists to route like a real MoE: its calibrated imbalance is well above 1, and
    the optimiser gives the hottest expert at least the (largest) capacity of the coldest."""
    for layer in demo.spec.moe_layers:
        loads = profile.loads[layer]
        assert (loads.max(axis=1) / loads.mean(axis=1)).mean() > 1.4
    plan = npumoe.plan(demo, profile, target="ane", residency="npu")
    for layer, lp in plan.layers.items():
        largest = {e: max(shape[k] for shape in g.shapes) for g in lp.groups for k, e in enumerate(g.experts)}
        caps = [largest[e] for e in profile.popularity(layer)]
        assert caps[0] >= caps[-1]
