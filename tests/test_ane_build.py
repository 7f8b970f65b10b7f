"""The ANE backend end to end: calibrate → plan (residency npu) → npumoe build --target ane → lint →
the saved packages run by mil_exec inside npumoe.Engine, against the reference engine. What every
backend must do (fp16 engine vs reference, fresh-process reload, rebuilds, bad feeds) is
tests/test_conformance.py's; this file holds what is the ANE's own: int4 packages, lint, layout, states.

The model is the shipped demo once it exists, else a checkpoint of the same shapes whose
routers are scaled so routing is as decisive as a trained model's (random-init router
logits have std ≈ 0.5, so top-k near-ties that fp16 legitimately flips are common).
"""

import importlib.util
import struct
import sys
from collections import ChainMap
from pathlib import Path

import numpy as np
import pytest
from npu_check import ids, row_cosines

import npumoe
from npumoe.backends.apple_ane.backend import AneBackend
from npumoe.backends.apple_ane.lint import lint_package
from npumoe.backends.apple_ane.mlpackage import SPEC_PATH, Package
from npumoe.backends.apple_ane.rules import ANE_OPS
from npumoe.cli import main
from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.compiler.artifacts import build
from npumoe.core.compiler.program import build_program
from npumoe.core.ir.backend import Lowered
from npumoe.core.planning.plan import plan
from npumoe.core.runtime.calibrate import calibrate, default_calibration_texts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("coremltools") is None,
                                reason="coremltools is not installed (pip install 'npumoe[ane]')")
PROMPTS = [
    b"def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n\nprint(fib",
    b"The built-in function sorted() returns a new sorted list from the items in iterable. ",
]


@pytest.fixture(scope="module")
def model():
    return npumoe.load()  # the shipped demo model: trained routing, a fair int4 test


@pytest.fixture(scope="module")
def ane_plan(model, tmp_path_factory):
    text = "".join(default_calibration_texts().values())[:40_000]
    p = plan(model, calibrate(model, [text], chunk=64), target="ane", residency="npu",
             graphs_per_layer=1)  # conformance builds several shapes per group; here one keeps the builds short
    p.save(tmp_path_factory.mktemp("plan") / "plan.json")
    return p


@pytest.fixture(scope="module")
def converter_temporaries(tmp_path_factory):
    """Where coremltools puts its temporary packages during the fp16 build (its temporary directory)."""
    return tmp_path_factory.mktemp("coreml-tmp")


@pytest.fixture(scope="module")
def fp16(model, ane_plan, tmp_path_factory, converter_temporaries):
    """Built with the converter's temporaries in ``converter_temporaries`` (no RAM scratch), into an empty build
    cache of its own: every package is converted here, whatever other test files built before."""
    import tempfile

    from npumoe.backends.apple_ane import convert

    out = tmp_path_factory.mktemp("ane") / "fp16"
    before, tempfile.tempdir = tempfile.tempdir, str(converter_temporaries)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(convert, "MEMORY_SCRATCH", converter_temporaries / "no-such-dir")
            patch.setenv("NPUMOE_BUILD_CACHE", str(tmp_path_factory.mktemp("ane-build-cache")))
            return out, build(model, ane_plan, "ane", out, progress=False)
    finally:
        tempfile.tempdir = before


def test_a_build_leaves_no_converter_packages_behind(fp16, converter_temporaries):
    """coremltools keeps each converted model's package until the process exits; a build deletes each once its
    weights are in the multifunction package, so a many-graph build does not hold them all on disk."""
    assert fp16[1]["graphs"] and not any(g["cached"] for g in fp16[1]["graphs"].values())  # converted, not linked
    assert not list(converter_temporaries.rglob("*.mlpackage"))


def test_the_converters_temporaries_go_to_memory_when_it_has_room(tmp_path, monkeypatch):
    import tempfile

    from npumoe.backends.apple_ane import convert

    monkeypatch.setattr(convert, "MEMORY_SCRATCH", tmp_path)
    with convert.converter_scratch(1 << 20):
        inside = Path(tempfile.gettempdir())
        assert inside.parent == tmp_path and inside.is_dir()
    assert not inside.exists() and Path(tempfile.gettempdir()) != inside
    monkeypatch.setattr(convert, "available_memory", lambda: convert.SPARE_MEMORY)  # no memory to spare
    with convert.converter_scratch(1 << 20):
        assert Path(tempfile.gettempdir()).parent != tmp_path


@pytest.fixture(scope="module")
def int4(model, ane_plan, tmp_path_factory):
    out = tmp_path_factory.mktemp("ane") / "int4"
    return out, build(model, ane_plan, "ane", out, progress=False, precision="int4", jobs=2)  # packages in 2 processes


@pytest.fixture(scope="module")
def planned_graphs(model, ane_plan, fp16):
    return build_program(model.spec, ane_plan.chunk, fp16[1]["max_context"], ane_plan).graphs


@pytest.fixture(scope="module")
def reference(model):
    eng = npumoe.Engine(model)
    return {p: (eng.forward(ids(p)), eng.generate(ids(p), 16)) for p in PROMPTS}


def packages(manifest: dict) -> dict[str, list[str]]:
    """Package path → the graphs whose functions it holds."""
    out: dict[str, list[str]] = {}
    for name, g in manifest["graphs"].items():
        out.setdefault(g["package"], []).append(name)
    return out


# -- numerics ---------------------------------------------------------------------------------------
def dequantized_experts(model, out, manifest) -> dict:
    """The expert weights as the int4 packages store them, decoded by coremltools' own op."""
    from coremltools.converters.mil.mil.ops.defs.iOS18.compression import (
        constexpr_blockwise_shift_scale,
    )

    weights = {}
    for rel in packages(manifest):
        if "experts" not in rel:
            continue
        pkg = Package(out / rel)
        for fn in pkg.functions:
            for op in pkg.operations(fn):
                if op.type == "constexpr_blockwise_shift_scale":
                    args = {k: pkg.value(a.arguments[0].value) for k, a in op.inputs.items()}
                    w = constexpr_blockwise_shift_scale.decompress(args["data"], args["scale"], args.get("offset"))
                    weights[op.outputs[0].name.split("_weight_conv")[0] + "_weight"] = w[:, :, 0, 0]
    names = {n.replace(".", "_"): n for n in model.weights if ".experts." in n}
    assert set(weights) == set(names)  # every expert weight is in an int4 package
    return {names[k]: v for k, v in weights.items()}


def test_int4_packages_run_exactly_the_quantized_model(model, ane_plan, int4):
    """Every NPU launch of a real int4 run against the reference executor on the same inputs, given the
    dequantized weights: only fp16 arithmetic may differ (end to end, a near-tie routing flip would hide it)."""
    import torch

    from npumoe.core.compiler.interpreter import TorchGraphExecutor

    out, manifest = int4
    weights = ChainMap({n: torch.from_numpy(np.asarray(w, dtype=np.float32))
                        for n, w in dequantized_experts(model, out, manifest).items()}, model.weights)
    eng = npumoe.Engine(model, ane_plan, backend="ane", artifacts=out)
    errors: dict[str, float] = {}

    def compared(name, ane):
        ref = TorchGraphExecutor(eng.program.graphs[name], weights)

        def run(inputs):
            got = ane(inputs)
            if ane.keeps_state:  # the reference reads the cache the ANE holds as states: the engine's copy
                layer = eng.program.graphs[name].layer
                inputs = {**inputs, "k_cache": eng.cache.k[layer], "v_cache": eng.cache.v[layer]}
            want = ref(inputs)
            for k in want:
                rel = float((got[k] - want[k]).norm() / want[k].norm())
                errors[f"{name}:{k}"] = max(errors.get(f"{name}:{k}", 0.0), rel)
            return got

        run.keeps_state = ane.keeps_state
        return run

    for name, g in eng.program.graphs.items():
        if g.placement == "npu":
            eng.executors[name] = compared(name, eng.executors[name])
    for prompt in PROMPTS:
        eng.generate(ids(prompt), 8)
    launched = {k.split(":")[0] for k in errors}
    assert {manifest["graphs"][n]["kind"] for n in launched} == {"attention", "experts", "lm_head"}
    assert max(errors.values()) < 5e-3  # fp16 storage between ops: ~1e-3


def test_int4_logits_stay_close_to_the_fp32_reference(model, ane_plan, int4, reference):
    eng = npumoe.Engine(model, ane_plan, backend="ane", artifacts=int4[0])
    for prompt, (logits, _) in reference.items():
        assert row_cosines(eng.forward(ids(prompt)), logits).mean() >= 0.99


# -- what the packages are --------------------------------------------------------------------------
def test_every_package_passes_the_ane_lint(fp16, int4, capsys, monkeypatch):
    for out, manifest in (fp16, int4):
        for rel in packages(manifest):
            reports = lint_package(out / rel)
            assert [v for r in reports for v in r.violations] == []
            ops = {op.type for r in reports for op in Package(out / rel).operations(r.function)}
            assert ops <= ANE_OPS
    monkeypatch.setenv("COLUMNS", "200")
    main(["lint", str(fp16[0])])  # returns normally: no violation
    table = capsys.readouterr().out
    for g in fp16[1]["graphs"].values():
        assert g["function"] in table
    assert "all pass the ANE rules" in table


def weight_blob(path):
    blob = path / SPEC_PATH.parent / "weights" / "weight.bin"
    return blob.stat().st_size, struct.unpack_from("<I", blob.read_bytes(), 0)[0]


def test_multifunction_packages_store_weights_once(model, fp16, planned_graphs):
    out, manifest = fp16
    for rel, names in packages(manifest).items():
        pkg = Package(out / rel)
        assert sorted(pkg.functions) == sorted(manifest["graphs"][n]["function"] for n in names)
        unique = {w for n in names for w in planned_graphs[n].weight_names()}
        fp16_bytes = 2 * sum(model.weights[w].numel() for w in unique)
        size, blobs = weight_blob(out / rel)
        assert fp16_bytes <= size <= fp16_bytes + 128 * (blobs + 1)  # one copy + 64-byte headers and alignment
        if len(names) > 1:
            assert size < sum(pkg.const_bytes(f) for f in pkg.functions)  # not one copy per function


def test_int4_shrinks_expert_packages(fp16, int4):
    for rel in packages(fp16[1]):
        fp16_size, int4_size = weight_blob(fp16[0] / rel)[0], weight_blob(int4[0] / rel)[0]
        if "experts" in rel:
            assert int4_size < 0.35 * fp16_size  # 4 bits + one fp16 scale per 32 weights
        else:
            assert int4_size == fp16_size  # attention and LM head stay fp16


def test_attention_kv_cache_is_two_pow2_states_shared_by_prefill_and_decode(model, fp16):
    out, manifest = fp16
    att = model.spec.layers[0].attention
    for rel, names in packages(manifest).items():
        pkg = Package(out / rel)
        states = [{n: s.shape for n, s in pkg.inputs(f).items() if s.state} for f in pkg.functions]
        if manifest["graphs"][names[0]]["kind"] != "attention":
            assert states == [{}] * len(states)
            continue
        layers = {manifest["graphs"][n]["layer"] for n in names}
        assert len(names) == 2 * len(layers)  # a prefill-chunk and a decode function per layer
        assert all(s == states[0] for s in states) and sorted(states[0]) == ["k_cache", "v_cache"]
        for shape in states[0].values():
            assert shape[0] == len(layers)
            assert all(d & (d - 1) == 0 for d in shape[1:]) and min(shape[2:]) >= 32
            assert shape[1] >= att.num_kv_heads and shape[2] >= manifest["max_context"] and shape[3] >= att.head_dim


def test_our_mil_passes_shaped_the_saved_programs(model, fp16):
    out, manifest = fp16
    att, eps = model.spec.layers[0].attention, set()
    norm_eps = {model.spec.norm.eps, model.spec.layers[0].norm.eps, att.qk_norm_eps}
    for rel in packages(manifest):
        pkg = Package(out / rel)
        for fn in pkg.functions:
            ops = pkg.operations(fn)
            producer = {o.name: op.type for op in ops for o in op.outputs}
            consts = {op.outputs[0].name: pkg.value(op.attributes["val"]) for op in ops if op.type == "const"}
            assert "pow" not in producer.values()  # pow(x, 2) → mul(x, x)
            for op in (op for op in ops if op.type == "rsqrt"):  # add(eps) folded into rsqrt's epsilon
                assert producer[op.inputs["x"].arguments[0].name] != "add"
                eps.add(float(consts[op.inputs["epsilon"].arguments[0].name]))
    assert eps and all(any(abs(e - n) <= 1e-3 * n for n in norm_eps) for e in eps)


def test_linear_layers_are_1x1_convs_on_ane_layout(fp16, planned_graphs):
    out, manifest = fp16
    for name, g in manifest["graphs"].items():
        ops = Package(out / g["package"]).operations(g["function"])
        assert sum(op.type == "conv" for op in ops) == sum(op.op == "linear" for op in planned_graphs[name].ops)
        for arg, spec in g["function_inputs"].items():
            if spec["layout"] == "ane":
                rows, channels = g["inputs"][arg]
                assert spec["shape"] == [1, channels, 1, rows]


def test_manifest_describes_functions_states_and_compression(fp16, int4):
    for out, manifest in (fp16, int4):
        assert manifest["backend"]["name"] == "ane"
        for g in manifest["graphs"].values():
            pkg = Package(out / g["package"])
            declared = pkg.inputs(g["function"])
            assert {n: list(s.shape) for n, s in declared.items() if not s.state} == {
                n: s["shape"] for n, s in g["function_inputs"].items()}
            assert (g["states"] is not None) == any(s.state for s in declared.values())
            assert g["compression"]["precision"] in ("fp16", "int4")
            assert any(f.startswith(g["package"] + "/") for f in manifest["files"])
    assert {g["compression"]["precision"] for g in int4[1]["graphs"].values() if g["kind"] == "experts"} == {"int4"}


# -- the ExecuTorch path ----------------------------------------------------------------------------
def test_executorch_lowers_to_pte_and_says_where_it_runs(model, ane_plan, tmp_path):
    pytest.importorskip("executorch", reason="executorch is not installed (pip install executorch==1.5.1)")
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = build_program(model.spec, ane_plan.chunk, 512, ane_plan)
    graphs = [g for g in program.graphs.values() if g.kind == "lm_head" or g.name.startswith("L0.experts.g0")]
    backend = AneBackend(via="executorch")
    entries = backend.build(graphs, model.weights, tmp_path, progress=False)
    for rel in {e["package"] for e in entries.values()}:
        pte = deserialize_pte_binary((tmp_path / rel).read_bytes())
        pte = getattr(pte, "program", pte)
        methods = {p.name for p in pte.execution_plan}
        assert methods == {e["function"] for e in entries.values() if e["package"] == rel}
        assert {d.id for p in pte.execution_plan for d in p.delegates} == {"CoreMLBackend"}
    if sys.platform != "darwin":
        g = graphs[0]
        with pytest.raises(BackendUnavailableError, match="runs only on macOS"):
            backend.load(Lowered.from_entry(entries[g.name]), tmp_path, g, model.weights)
