"""What each device can hold: a build's weights at its precision, KV cache and activations against the RAM one
app may use, each compiled graph against the package limit — checked against the bytes a build writes, and by
hand on the demo and on Qwen3-30B-A3B's exact config (no weights needed)."""

import dataclasses
import math
import types
from pathlib import Path

import numpy as np
import pytest
from cli_check import cli_error

import npumoe
from npumoe.bench.scale import QWEN3_30B_A3B
from npumoe.cli import main
from npumoe.core.ir.backend import plugin
from npumoe.core.planning.costmodel import budget_lines, footprint, size, verdict, verdicts
from npumoe.core.planning.plan import plan
from npumoe.core.planning.profile import RoutingProfile
from npumoe.models.loader import config_spec

BUDGET_FIELDS = ("ram_gb", "app_share", "max_package_gb", "graph_overhead_mb")
TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 8


@pytest.mark.parametrize("target", ["htp", "ane"])
def test_every_device_says_what_it_holds(target):  # and where each figure comes from: test_build_targets.py
    for device in plugin(target).devices:
        assert all(getattr(device, f) is not None for f in BUDGET_FIELDS), device.name
        assert 0 < device.app_share <= 1 and device.max_package_gb <= device.ram_gb


# -- the demo ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    model = npumoe.load()
    return model, npumoe.calibrate(model, [TEXT], chunk=16)


def test_the_weights_counted_are_the_bytes_a_build_stores(demo, tmp_path):
    """intel_npu writes each graph's weights as fp16 in its own .bin: what the footprint counts, copies included."""
    pytest.importorskip("openvino", reason="the intel_npu target needs OpenVINO (pip install 'npumoe[intel]')")
    from npumoe.core.compiler.artifacts import build

    model, profile = demo
    p = npumoe.plan(model, profile, target="intel_npu", residency="npu")
    build(model, p, "intel_npu", tmp_path / "out", max_context=256, progress=False)
    written = sum(f.stat().st_size for f in (tmp_path / "out").rglob("*.bin"))
    need = footprint(model.spec, p, 256)
    assert need.package_weight_bytes == pytest.approx(written, rel=1e-3)  # the .bin's few int64 shape constants
    assert need.graphs == len(list((tmp_path / "out").rglob("*.xml")))


def test_the_demo_fits_every_device_by_the_numbers_of_its_config(demo):
    model, profile = demo
    need = footprint(model.spec, npumoe.plan(model, profile, target="ane", residency="npu"), 512, "int4")
    # config.json: 4 layers, 2 KV heads of 32, fp16 K and V at 512 positions
    assert need.kv_bytes == 4 * 2 * (2 * 512 * 32) * 2
    # 8 experts of 3 x 128 x 256 a layer at 4 + 16/32 bits, attention (q, o 128 x 128; k, v 64 x 128) and the
    # tied 256 x 128 head at fp16, plus the norms inside the graphs (128 and 32 each: under 4 KB)
    experts, dense = 4 * 8 * 3 * 128 * 256 * 4.5 / 8, (4 * (2 * 128 * 128 + 2 * 64 * 128) + 256 * 128) * 2
    assert 0 <= need.package_weight_bytes - experts - dense < 4096
    for v in verdicts("ane", need):
        assert v.fits and v.line.startswith(f"{v.device} ✓: ") and f"of the {v.budget_bytes / 1e9:g} GB an app may hold" in v.line


# -- Qwen3-30B-A3B's exact config ----------------------------------------------------------------------
# a layer's attention graph: q and o; k and v (4 KV heads of 128); its attention and FFN norms; q and k norms
ATTENTION = 2048 * 4096 * 2 + 2048 * 512 * 2 + 2048 * 2 + 128 * 2
EXPERT = 3 * 2048 * 768
HEAD = 151936 * 2048  # the LM head (its graph holds the final norm too); the embedding is as large, on the host
ROUTER = 128 * 2048


@pytest.fixture(scope="module")
def qwen3():
    """Its spec, and a profile of 16 chunks routed to skewed experts (a plan needs one; no weights)."""
    _, spec = config_spec(dict(QWEN3_30B_A3B))
    rng = np.random.default_rng(0)
    loads = {i: rng.multinomial(64 * 8, rng.dirichlet(np.full(128, 0.5)), size=16) for i in spec.moe_layers}
    profile = RoutingProfile(spec.fingerprint(), "Qwen3-30B-A3B", 64, {i: 8 for i in spec.moe_layers}, loads)
    model = types.SimpleNamespace(spec=spec, name="Qwen3-30B-A3B", weights_fingerprint=lambda mode=None: None)
    return spec, {t: plan(model, profile, target=t, residency="npu") for t in ("ane", "htp")}


def by_hand(p, shares: bool, expert_bytes: float, dense_bytes: float) -> tuple[float, int]:
    """(package weight bytes, compiled graphs) from the plan's groups: a graph per prefill shape and one per
    decode part (one for the whole group when decode_experts is 0, none when decode runs on the prefill graphs);
    Core ML keeps a group's prefill graph and the decode graphs cut from it in one package, its weights once; a QNN
    context holds its own."""
    weights, graphs = 0.0, 0
    for lp in p.layers.values():
        for g in lp.groups:
            parts = math.ceil(len(g.experts) / g.decode_experts) if g.decode_experts else 1
            if shares:
                copies, units = 1, 1
            elif p.decode == "prefill":  # decode launches the group's prefill graph: no graph of its own
                copies = units = len(g.shapes)
            else:
                copies, units = len(g.shapes) + 1, len(g.shapes) + parts
            weights += copies * len(g.experts) * EXPERT * expert_bytes
            graphs += units
    graphs += (1 if shares else 2) * 49  # each layer's attention, the LM head: prefill and decode graphs
    return weights + (1 if shares else 2) * (48 * ATTENTION + HEAD + 2048) * dense_bytes, graphs


@pytest.mark.parametrize("target, precision, expert_bytes, dense_bytes", [
    ("ane", "fp16", 2, 2), ("ane", "int4", 4.5 / 8, 2), ("htp", "fp16", 2, 2), ("htp", "w4a16", 4.5 / 8, 1),
])
def test_qwen3_30b_by_hand(qwen3, target, precision, expert_bytes, dense_bytes):  # (ane: decode graphs cut from groups)
    spec, plans = qwen3
    need = footprint(spec, plans[target], 4096, precision)
    weights, graphs = by_hand(plans[target], plugin(target).shares_weights, expert_bytes, dense_bytes)
    assert need.package_weight_bytes == pytest.approx(weights, rel=1e-12)
    assert need.graphs == graphs
    assert need.host_weight_bytes == (HEAD + 48 * ROUTER) * 2  # the embedding and the routers, bf16
    assert need.kv_bytes == 48 * 2 * (4 * 4096 * 128) * 2
    assert need.activation_bytes == 64 * (2048 + 151936) * 2  # the LM head's prefill input and logits


@pytest.mark.parametrize("target, phone", [("ane", "Apple A17 Pro"), ("ane", "Apple A18"),
                                           ("htp", "Snapdragon 8 Gen 3")])
def test_qwen3_30b_does_not_fit_an_8_gb_phone_at_fp16(qwen3, target, phone):
    spec, plans = qwen3
    need = footprint(spec, plans[target], 4096, "fp16")
    device = next(d for d in plugin(target).devices if d.name == phone)
    v = verdict(device, need)
    assert device.ram_gb == 8 and not v.fits
    needed = need.package_weight_bytes + need.host_weight_bytes + need.kv_bytes + need.activation_bytes \
        + need.graphs * device.graph_overhead_mb * 1e6
    assert v.memory_over == pytest.approx(needed - 8e9 * device.app_share)
    assert f"{size(v.memory_over)} over" in v.line and v.line.startswith(f"{v.device} ✗: ")


def test_a_build_no_device_holds_names_the_nearest_and_by_how_much(qwen3):
    spec, plans = qwen3
    need = footprint(spec, plans["ane"], 4096, "fp16")
    found = verdicts("ane", need)
    assert not any(v.fits for v in found)
    nearest = min(found, key=lambda v: v.memory_over)
    assert nearest.device == "Apple M4 Max"  # the most RAM: 36 GB x 0.75
    assert budget_lines("ane", need)[-1] == (f"fits no ane device at fp16: the nearest, Apple M4 Max, is "
                                             f"{nearest.memory_over / 1e9:.1f} GB short of memory")
    at_int4 = {v.device: v for v in verdicts("ane", footprint(spec, plans["ane"], 4096, "int4"))}
    assert at_int4["Apple M4 Max"].fits and not at_int4["Apple A18"].fits  # its weights once: 20.2 GB of 27


def test_a_graph_larger_than_a_package_is_named_with_the_excess(qwen3):
    spec, plans = qwen3
    need = footprint(spec, plans["ane"], 4096, "fp16")
    head = (HEAD + 2048) * 2
    assert need.largest_graph.startswith("lm_head") and need.largest_graph_bytes == head
    device = dataclasses.replace(plugin("ane").devices[0], ram_gb=512.0, max_package_gb=0.5)  # memory aside
    v = verdict(device, need)
    assert not v.fits and v.memory_over == 0 and v.package_over == head - 0.5e9
    assert f"largest graph 622 MB: {(head - 0.5e9) / 1e6:.0f} MB over the 500 MB limit" in v.line
    assert v.line.startswith(f"{v.device} ✗: ")


# -- npumoe plan ---------------------------------------------------------------------------------------
def test_plan_prints_a_verdict_per_device(demo, tmp_path, capsys):
    model, profile = demo
    profile.save(tmp_path / "profile.json")
    main(["plan", "--profile", str(tmp_path / "profile.json"), "--target", "ane", "--residency", "npu",
          "--precision", "int4", "--max-context", "256", "--out", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert "can hold of this build at int4, context 256" in out
    for device in plugin("ane").devices:
        assert any(line.strip().startswith(f"{device.name} ✓: ") for line in out.splitlines())


def test_plan_refuses_a_precision_the_target_does_not_build(demo, tmp_path, capsys):
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--out", str(tmp_path / "plan.json")]
    assert "'w9' is not one of fp16, w8a16, w4a16" in cli_error(capsys, *args, "--target", "htp", "--precision", "w9")
    assert "builds fp16 weights only" in cli_error(capsys, *args, "--target", "intel_npu", "--precision", "int4")
    assert not Path(tmp_path / "plan.json").exists()
