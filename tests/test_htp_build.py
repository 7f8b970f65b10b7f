"""The HTP backend end to end on QNN's x86_64 HTP: calibrate → plan (residency npu) → build (EPContext)
→ npumoe.Engine(backend="htp"), against the reference engine (fp32 CPU, no plan). What every backend must
do (fp16 engine vs reference, fresh-process reload, rebuilds, bad feeds) is tests/test_conformance.py's;
this file holds what is the HTP's own: manifests, context binaries, w8a16, ExecuTorch and AI Hub.

The model is the shipped demo. Graphs are small (chunk 16, KV length 64) so that building and
running every graph on the emulated HTP stays within a couple of minutes.
"""

import importlib.util
import json
import re
import shutil

import numpy as np
import pytest

pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'npumoe[htp]')")
pytest.importorskip("onnx")
if importlib.util.find_spec("executorch") is not None:
    # ExecuTorch reaches the HTP through npumoe's QNN shim, which must be loaded before any onnxruntime-qnn
    # session loads the real libQnnHtp.so (see npumoe.backends.qualcomm_htp.shim); collection comes first.
    from npumoe.backends.qualcomm_htp.shim import qnn_sdk_root

    qnn_sdk_root()

from npu_check import ids, row_cosines

import npumoe
from npumoe.backends.qualcomm_htp.backend import GRAPH_DIR
from npumoe.backends.qualcomm_htp.qnn import session
from npumoe.cli import main
from npumoe.core.base.errors import ArtifactError, InputError
from npumoe.core.compiler.artifacts import build
from npumoe.core.planning.plan import Plan, plan
from npumoe.core.runtime.calibrate import calibrate, default_calibration_texts

PROMPTS = [
    b"def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1",
    b"The built-in function sorted() returns a new sorted list. ",
]
CHUNK, MAX_CONTEXT = 16, 64


@pytest.fixture(scope="module")
def model():
    return npumoe.load()  # the shipped demo model


@pytest.fixture(scope="module")
def htp_plan(model, tmp_path_factory):
    text = "".join(default_calibration_texts().values())[:1600]
    p = plan(model, calibrate(model, [text], chunk=CHUNK), target="htp", residency="npu",
             graphs_per_layer=1)  # conformance builds several shapes per group; here one keeps the builds short
    p.save(tmp_path_factory.mktemp("plan") / "plan.json")
    return p


@pytest.fixture(scope="module")
def fp16(model, htp_plan, tmp_path_factory):
    out = tmp_path_factory.mktemp("htp") / "fp16"
    return out, build(model, htp_plan, "htp", out, max_context=MAX_CONTEXT, progress=False, keep_onnx=True)


@pytest.fixture(scope="module")
def w8a16(model, htp_plan, tmp_path_factory):
    out = tmp_path_factory.mktemp("htp") / "w8a16"
    return out, build(model, htp_plan, "htp", out, max_context=MAX_CONTEXT, progress=False, precision="w8a16",
                      keep_onnx=True, jobs=2)  # graphs compiled in 2 processes


@pytest.fixture(scope="module")
def reference(model):
    eng = npumoe.Engine(model, max_context=MAX_CONTEXT)
    return {p: (eng.forward(ids(p)), eng.generate(ids(p)[:24], 16)) for p in PROMPTS}


def assert_fp16_bounds(eng, reference):
    """The issue's fp16 bar: row cosine ≥ 0.999 on every prompt, identical 16-step greedy tokens."""
    for prompt, (logits, _) in reference.items():
        assert row_cosines(eng.forward(ids(prompt)), logits).min() >= 0.999
    prompt = PROMPTS[0]
    np.testing.assert_array_equal(eng.generate(ids(prompt)[:24], 16), reference[prompt][1])
    assert eng.metrics["npu_launches"] > 0


def test_manifest_describes_every_graph_and_file(model, htp_plan, fp16):
    out, manifest = fp16
    backend = manifest["backend"]
    assert (backend["soc_model"], backend["htp_arch"], backend["precision"]) == ("69", "v79", "fp16")
    assert backend["qnn_version"].startswith("2.")
    npu = [g for g in npumoe.Engine(model, htp_plan, max_context=MAX_CONTEXT).program.graphs.values()
           if g.placement == "npu"]
    assert set(manifest["graphs"]) == {g.name for g in npu}
    for g in npu:
        entry = manifest["graphs"][g.name]
        assert entry["inputs"] == {n: list(t.shape) for n, t in g.inputs.items()}
        assert entry["outputs"] == {n: list(t.shape) for n, t in g.outputs.items()}
        assert entry["context_binary_bytes"] > 0
        assert set(entry["files"]) <= set(manifest["files"])
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert on_disk == set(manifest["files"])
    assert json.loads((out / "manifest.json").read_text())["files"] == manifest["files"]


def test_epcontext_reload_gives_the_compiled_graphs_outputs(fp16):
    """A context model loaded from disk and the same ONNX graph compiled afresh agree exactly."""
    out, manifest = fp16
    rng = np.random.default_rng(0)
    names = list(manifest["graphs"])
    for name in [next(n for n in names if ".attn." in n), next(n for n in names if ".experts." in n)]:
        entry = manifest["graphs"][name]
        fresh = session((out / entry["onnx"]).read_bytes(), "69", fp16=True)
        reloaded = session(out / entry["context_model"], "69", fp16=True)
        feed = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in fresh.get_inputs()}
        for a, b in zip(fresh.run(None, feed), reloaded.run(None, feed)):
            np.testing.assert_array_equal(a, b)


def test_rebuild_gives_identical_onnx_bytes(model, htp_plan, fp16, tmp_path, monkeypatch):
    manifest = fp16[1]
    monkeypatch.setenv("NPUMOE_BUILD_CACHE", str(tmp_path / "empty-cache"))  # compiled afresh, not linked
    again = build(model, htp_plan, "htp", tmp_path / "again", max_context=MAX_CONTEXT, progress=False,
                  keep_onnx=True)
    assert not any(g["cached"] for g in again["graphs"].values())
    onnx_files = [f for f in manifest["files"] if f.endswith(".onnx")]
    assert len(onnx_files) == 2 * len(manifest["graphs"])  # the plain graph and its EPContext model
    for rel in onnx_files:
        assert again["files"][rel] == manifest["files"][rel], rel


def test_w8a16_within_bounds_and_recorded(model, htp_plan, w8a16, reference):
    out, manifest = w8a16
    backend = manifest["backend"]
    assert backend["precision"] == "w8a16"
    assert "uint16" in backend["quantization"]["activations"] and "uint8" in backend["quantization"]["linear_weights"]
    assert set(backend["calibration"]["samples_per_graph"]) == set(manifest["graphs"])
    graph = (out / GRAPH_DIR / f"{next(iter(manifest['graphs']))}.onnx").read_bytes()
    assert b"DequantizeLinear" in graph
    eng = npumoe.Engine(model, htp_plan, backend="htp", artifacts=out)
    agree = []
    for prompt, (logits, _) in reference.items():
        got = eng.forward(ids(prompt))
        assert row_cosines(got, logits).min() >= 0.99
        agree.extend(got.argmax(-1) == logits.argmax(-1))
    assert np.mean(agree) >= 0.95


# -- bad input against a real build -------------------------------------------------------------------
def test_an_altered_context_binary_is_named(model, htp_plan, fp16, tmp_path):
    out, manifest = fp16
    altered = tmp_path / "altered"
    shutil.copytree(out, altered)
    binary = next(f for f in manifest["files"] if f.endswith(".bin"))
    data = bytearray((altered / binary).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (altered / binary).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=re.escape(binary) + ".*no longer matches the sha256"):
        npumoe.Engine(model, htp_plan, backend="htp", artifacts=altered)


def test_a_prompt_longer_than_the_compiled_kv_length(model, htp_plan, fp16):
    eng = npumoe.Engine(model, htp_plan, backend="htp", artifacts=fp16[0])
    with pytest.raises(InputError, match=f"KV cache holds {MAX_CONTEXT}"):
        eng.forward(np.zeros(MAX_CONTEXT + 1, dtype=np.int64))
    with pytest.raises(InputError, match=f"exceeds the KV cache length {MAX_CONTEXT}"):
        eng.generate(np.zeros(MAX_CONTEXT - 4, dtype=np.int64), max_new_tokens=16)


def test_a_small_budget_keeps_few_contexts_alive_and_the_tokens(model, htp_plan, fp16, monkeypatch):
    """Under a budget of a third of the build, contexts are created and freed on demand (counted at QNN's session
    and the executor's close, not timed): the live ones' bytes never pass the budget, and the greedy tokens equal
    those of the build with every graph loaded."""
    from npumoe.backends.qualcomm_htp.backend import HtpBackend
    from npumoe.backends.qualcomm_htp.executor import HtpExecutor

    out, manifest = fp16
    prompt = ids(PROMPTS[0])[:24]
    unbounded = npumoe.Engine(model, htp_plan, backend="htp", artifacts=out).generate(prompt, 8)
    sizes = {n: g["bytes"] for n, g in manifest["graphs"].items()}
    budget = sum(sizes.values()) // 3
    live, peak, created = {}, [0], [0]
    load, close = HtpBackend.load, HtpExecutor.close

    def counted_load(self, artifact, out_dir, graph, weights):
        executor = load(self, artifact, out_dir, graph, weights)
        live[id(executor)] = sizes[graph.name]
        created[0] += 1
        peak[0] = max(peak[0], sum(live.values()))
        return executor

    def counted_close(self):
        del live[id(self)]
        close(self)

    monkeypatch.setattr(HtpBackend, "load", counted_load)
    monkeypatch.setattr(HtpExecutor, "close", counted_close)
    eng = npumoe.Engine(model, htp_plan, backend="htp", artifacts=out, max_resident_bytes=budget)
    np.testing.assert_array_equal(eng.generate(prompt, 8), unbounded)
    assert created[0] > len(sizes)  # some graphs were loaded again after an eviction
    assert 0 < peak[0] <= budget and eng.metrics["evictions"] == created[0] - len(live)


# -- the command line: build for another SoC, generate with a trace ---------------------------------
def test_cli_build_generate_and_trace(model, htp_plan, reference, tmp_path, capsys):
    plan_path = htp_plan.save(tmp_path / "plan.json")
    out = tmp_path / "v75"
    cli(["build", "--model", str(model.path), "--plan", str(plan_path), "--target", "htp", "--soc", "57",
         "--max-context", str(MAX_CONTEXT), "--out", str(out)])
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["backend"]["soc_model"], manifest["backend"]["htp_arch"]) == ("57", "v75")
    # by default only what the device runs: each graph's context model and binary, not its fp32 ONNX
    assert all(entry["onnx"] is None for entry in manifest["graphs"].values())
    assert not [f for f in manifest["files"] if f.endswith(".onnx") and not f.endswith("_ctx.onnx")]
    capsys.readouterr()
    prompt = ids(PROMPTS[0])[:24]
    cli(["generate", "--model", str(model.path), "--target", "htp", "--artifacts", str(out), "-n", "4",
         "--ids", ",".join(map(str, prompt)), "--trace", str(tmp_path / "trace.json")])
    assert capsys.readouterr().out.split() == [str(t) for t in reference[PROMPTS[0]][1][:4]]
    trace = json.loads((tmp_path / "trace.json").read_text())
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    by_thread = {name: [e for e in trace["traceEvents"] if e["ph"] == "X" and threads[e["tid"]] == name]
                 for name in threads.values()}
    assert {"attention", "router"} <= {e["name"] for e in by_thread["Host"]}
    launches = by_thread["HTP graphs"]
    assert {e["name"] for e in launches} == set(manifest["graphs"]) - unused_graphs(manifest, launches)
    assert all(e["args"]["accelerator_cycles"] > 0 for e in launches)
    assert any(e["args"]["cycles"] > 0 for e in by_thread["HTP ops"])
    cycles = trace["otherData"]["htp_graph_cycles"]
    assert sum(c["launches"] for c in cycles.values()) == len(launches)


def unused_graphs(manifest: dict, launches: list) -> set:
    """Expert groups that no routed token reached in this short run (launched only when non-empty), and the
    chunk-wide LM heads: generating takes the prompt's last position through the one-row head (forward() uses them)."""
    ran = {e["name"] for e in launches}
    return {n for n, g in manifest["graphs"].items()
            if (g["kind"] == "experts" and n not in ran) or (g["kind"] == "lm_head" and not n.endswith(".s1"))}


def cli(argv):
    try:
        main(argv)
    except SystemExit as exit_:
        assert exit_.code in (0, None)


def test_ai_hub_compile_jobs_take_each_graphs_static_onnx(fp16):
    """What `npumoe hub compile` submits, up to the network: every graph's checked, static-shape ONNX model."""
    import onnx

    from npumoe.backends.qualcomm_htp.hub import compile_requests
    from npumoe.core.compiler.artifacts import read_manifest

    out, manifest = fp16
    requests = compile_requests(read_manifest(out), out)
    assert [name for name, _ in requests] == sorted(manifest["graphs"])
    for name, path in requests:
        model = onnx.load(path)
        onnx.checker.check_model(model, full_check=True)
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        assert shapes == {n: s for n, s in manifest["graphs"][name]["inputs"].items() if n in shapes}


# -- --via executorch: QNN partitioner .pte files on ExecuTorch's runtime (through the QNN shim) ----------
@pytest.fixture(scope="module")
def experts_pte(model, htp_plan, tmp_path_factory):
    """Expert groups as .pte on the HTP, attention and LM head on the CPU: ExecuTorch lowering is slow
    (~4 s a graph here), and attention is checked graph by graph below."""
    pytest.importorskip("executorch", reason="executorch is not installed (pip install executorch==1.5.1)")
    experts_only = Plan.from_json(htp_plan.to_json())
    experts_only.dense_placement = "cpu"
    out = tmp_path_factory.mktemp("htp") / "pte"
    manifest = build(model, experts_only, "htp", out, max_context=MAX_CONTEXT, progress=False, via="executorch")
    return out, manifest, experts_only


def test_executorch_pte_matches_the_reference_engine(model, experts_pte, reference):
    out, manifest, experts_only = experts_pte
    assert manifest["backend"]["via"] == "executorch"
    assert all(g["format"] == "pte" and g["kind"] == "experts" for g in manifest["graphs"].values())
    assert_fp16_bounds(npumoe.Engine(model, experts_only, backend="htp", artifacts=out), reference)


def test_executorch_attention_fp16_and_experts_16a8w(model, htp_plan, tmp_path):
    """An attention graph in fp16 and an expert group in QnnQuantizer 16a8w (--precision w8a16), each against
    the reference executor on inputs recorded from the reference program."""
    pytest.importorskip("executorch", reason="executorch is not installed (pip install executorch==1.5.1)")
    import torch

    from npumoe.backends.qualcomm_htp.calibration import capture
    from npumoe.backends.qualcomm_htp.pte import PteExecutor, save_pte
    from npumoe.backends.qualcomm_htp.qnn import chipset
    from npumoe.core.compiler.interpreter import TorchGraphExecutor

    program = npumoe.Engine(model, htp_plan, max_context=MAX_CONTEXT).program
    attention = program.layers[0].attention[CHUNK]
    experts = next(n for n, g in program.graphs.items() if g.kind == "experts")
    feeds = capture(model, htp_plan, MAX_CONTEXT, [attention, experts], tokens=2 * CHUNK)
    for name, precision, bound in ((attention, "fp16", 0.999), (experts, "w8a16", 0.99)):
        graph, path = program.graphs[name], tmp_path / f"{name}.{precision}.pte"
        save_pte(graph, model.weights, path, precision, chipset("69"), feeds[name][:-1])
        inputs = {k: torch.from_numpy(v) for k, v in feeds[name][-1].items()}
        got = PteExecutor(path, graph)(inputs)
        for key, want in TorchGraphExecutor(graph, model.weights)(inputs).items():
            assert row_cosines(got[key].reshape(-1).numpy(), want.reshape(-1).numpy()) >= bound, (name, precision, key)
