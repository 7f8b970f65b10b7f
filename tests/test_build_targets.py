"""npumoe build --targets: one calibration, every vendor built and validated, one directory to run from."""

import importlib.util
import json

import numpy as np
import pytest
import torch
from cli_check import cli_error
from npu_check import write_texts

import npumoe
from npumoe.cli import main

pytest.importorskip("onnxruntime_qnn", reason="the htp target needs onnxruntime-qnn (pip install 'npumoe[htp]')")
pytest.importorskip("coremltools", reason="the ane target needs coremltools (pip install 'npumoe[ane]')")
MLX = importlib.util.find_spec("mlx") is not None  # the Apple GPU's target (MLX's CPU backend here), if installed
TARGETS = ["htp", "ane", *["mlx"] * MLX]
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "  # 79 bytes: 3 chunks


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_texts(tmp_path_factory.mktemp("texts"), heldout_chars=600)


@pytest.fixture(scope="module")
def built(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("targets") / "build"
    main(["build", "--targets", ",".join(TARGETS), "--text", str(texts[0]), "--heldout", str(texts[1]), "--chunk",
          "32", "--max-context", "256", "--residency", "npu", "--graphs-per-layer", "1", "--out", str(out)])
    return out


def test_one_command_builds_and_validates_every_target(built):
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["kind"] == "npumoe.Targets" and list(manifest["targets"]) == TARGETS
    assert (built / "profile.json").is_file()  # the one calibration both plans came from
    for target, entry in manifest["targets"].items():
        assert json.loads((built / entry["dir"] / "manifest.json").read_text())["target"] == target
        v = entry["validation"]
        assert v["cosine"] > 0.999 and v["top1_agreement"] > 0.95 and v["greedy_match"] >= 8, (target, v)
        assert v["perplexity"] == pytest.approx(v["reference_perplexity"], rel=0.02)
        assert v["npu_launches_per_chunk"] > 0 and v["dropped_pct"] == 0


def test_generate_picks_a_target_from_the_directory(built, capsys):
    model = npumoe.load()
    prompt = "def add(a, b):\n    return"
    want = model.tokenizer.decode(npumoe.Engine(model).generate(np.asarray(model.tokenizer.encode(prompt)), 6))
    capsys.readouterr()
    main(["generate", "--artifacts", str(built), "--target", "ane", "--prompt", prompt, "-n", "6"])
    assert capsys.readouterr().out.strip() == want.strip()
    assert f"holds builds for {', '.join(TARGETS)}, not 'cpu'" in cli_error(capsys, "generate", "--artifacts", str(built),
                                                               "--target", "cpu")


# -- disaggregated generation: prefill on one target, the KV cache handed over once, decode on another -------------
@pytest.mark.parametrize("prefill_on, decode_on", [
    ("ane", "mlx"), ("htp", "cpu"),
    ("ane", "cpu"),  # the ANE's fp16 states read back, the CPU's fused decode kernels writing after them
])
def test_disaggregated_generation_gives_the_reference_tokens(built, capsys, prefill_on, decode_on):
    if "mlx" in (prefill_on, decode_on) and not MLX:
        pytest.skip("the mlx target needs MLX (pip install 'npumoe[mlx]')")
    model = npumoe.load()
    want = npumoe.Engine(model).generate(np.asarray(model.tokenizer.encode(PROMPT)), 24)
    capsys.readouterr()
    main(["generate", "--artifacts", str(built), "--prefill-on", prefill_on, "--decode-on", decode_on,
          "--prompt", PROMPT, "-n", "24", "--trace", str(built.parent / f"{prefill_on}-{decode_on}.json")])
    out = capsys.readouterr()
    assert out.out.strip() == model.tokenizer.decode(want).strip()  # 24 greedy tokens, the CPU reference's
    source = "AneExecutor state" if prefill_on == "ane" else "host cache"
    assert f"hand-off {prefill_on} -> {decode_on}" in out.err and source in out.err
    trace = json.loads((built.parent / f"{prefill_on}-{decode_on}.json").read_text())
    phases = [e["name"] for e in trace["traceEvents"] if e["name"] in ("prefill", "handoff", "decode")]
    assert phases == ["prefill", "handoff"] + ["decode"] * 23  # one hand-off, between the prompt and decode


def test_each_engine_runs_its_own_phase_and_the_ane_states_hold_what_its_graphs_returned(built):
    """The prefill engine launched no decode graph, the decode engine no prompt chunk; what the hand-off read from
    the ANE package's padded fp16 states is, value for value, what the attention functions returned as k_new and
    v_new (the host's copy, written by the engine from those outputs)."""
    model = npumoe.load()
    eng = npumoe.DisaggregatedEngine(model, "ane", "cpu", artifacts=built)
    eng.generate(np.asarray(model.tokenizer.encode(PROMPT)), 8)
    for engine, seq, runs in ((eng.prefill, 32, 3), (eng.decode, 1, 7)):  # 3 chunks; 7 steps after the first token
        graphs = engine.program.graphs
        attention = {g: n for g, n in engine.metrics_.graph_runs.items() if g in graphs and graphs[g].kind == "attention"}
        assert {graphs[g].meta["seq"] for g in attention} == {seq} and set(attention.values()) == {runs}
    handoff, cache = eng.last_handoff, eng.prefill.cache
    assert handoff.source == "AneExecutor state" and handoff.length == len(PROMPT) == cache.length
    for i in range(model.spec.num_layers):
        assert torch.equal(handoff.k[i], cache.k[i][:, :cache.length])
        assert torch.equal(handoff.v[i], cache.v[i][:, :cache.length])
        assert (handoff.k[i] != 0).any(dim=-1).all()  # no unwritten (zero) slot among the prompt's


def test_a_cache_from_another_model_is_refused(tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(npumoe.load().path, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))  # a config alike in shapes
    prefill = npumoe.Engine(npumoe.load())
    prefill.forward([1, 2, 3])
    with pytest.raises(npumoe.InputError, match="prefill and decode must load the same checkpoint"):
        npumoe.Engine(npumoe.load(other)).import_kv(prefill.export_kv())


@pytest.mark.parametrize("argv, message", [
    (["--prefill-on", "ane", "--decode-on", "tpu"], "unknown target 'tpu'"),
    (["--prefill-on", "ane", "--decode-on", "intel_npu"], "holds builds for htp, ane"),
    (["--prefill-on", "htp", "--decode-on", "ane"], "keeps its KV cache on its device"),
    (["--prefill-on", "ane"], "--prefill-on needs --decode-on too"),
    (["--prefill-on", "ane", "--decode-on", "cpu", "--target", "htp"], "--target applies to a one-target run"),
])
def test_bad_disaggregation_is_one_line(built, capsys, argv, message):
    assert message in cli_error(capsys, "generate", "--artifacts", str(built), *argv, "-n", "2")


def test_an_npu_prefill_needs_artifacts(capsys):
    assert "--prefill-on ane runs built artifacts; pass --artifacts BUILD" in cli_error(
        capsys, "generate", "--prefill-on", "ane", "--decode-on", "cpu", "-n", "2")


def test_a_decode_target_not_installed_names_its_extra(built):
    import subprocess
    import sys

    script = ("import sys; sys.modules['mlx'] = None\n"  # as if MLX were not installed
              "from npumoe.cli import main\n"
              f"main(['generate', '--artifacts', {str(built)!r}, '--prefill-on', 'ane', '--decode-on', 'mlx'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1 and "pip install 'npumoe[mlx]'" in errors[0], done.stderr


@pytest.mark.parametrize("argv, message", [
    (["--targets", "htp,tpu"], "unknown target 'tpu'; installed: cpu"),
    (["--targets", "cpu"], "names cpu, which runs graphs as they are"),
    (["--targets", "htp", "--plan", "p.json"], "without --plan, --target or --layers"),
    (["--targets", "ane", "--soc", "57"], "--soc applies to none of ane"),
    ([], "give --targets htp,ane"),
])
def test_bad_target_lists_are_named_before_any_work(tmp_path, capsys, argv, message):
    assert message in cli_error(capsys, "build", *argv, "--out", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# -- npumoe compare ----------------------------------------------------------------------------------
def test_compare_json_gives_every_target_its_metrics_and_estimates(built, capsys):
    from npumoe.core.planning.costmodel import devices

    main(["compare", str(built), "--json"])
    result = json.loads(capsys.readouterr().out)
    manifest = json.loads((built / "manifest.json").read_text())
    for target, row in result["targets"].items():
        for key in ("cosine", "top1_agreement", "greedy_match", "padded_pct", "spilled_pct", "dropped_pct",
                    "npu_launches_per_chunk", "artifact_bytes", "estimated"):
            assert key in row, key
        assert row["cosine"] == manifest["targets"][target]["validation"]["cosine"]
        work = manifest["targets"][target]["workload"]
        for _, device in devices(target):  # the roofline by hand
            decode = 1 / (work["decode_weight_bytes"] / (device.dram_gb_s * 1e9)
                          + work["decode_launches"] * device.launch_us * 1e-6)
            assert row["estimated"][device.name]["decode_tok_s"] == pytest.approx(decode)
    assert {c["device"] for c in result["cost_model_check"]} <= {d.name for _, d in devices()}


@pytest.mark.skipif(not MLX, reason="the mlx target needs MLX (pip install 'npumoe[mlx]')")
def test_compare_estimates_ane_prefill_with_gpu_decode_per_mac(built, capsys):
    """A row per Mac whose ANE and GPU are both built (the iPhones have no GPU record), its request times worked
    out by hand from the two targets' own estimates, the KV bytes a token caches and the chip's bandwidth."""
    from npumoe.core.planning.costmodel import devices

    main(["compare", str(built), "--json"])
    result = json.loads(capsys.readouterr().out)
    rows, split = result["targets"], result["disaggregated"]
    assert [r["chip"] for r in split] == ["Apple M2", "Apple M4", "Apple M4 Max"]
    bandwidth = {d.name: d.dram_gb_s for _, d in devices()}
    kv_per_token = rows["ane"]["footprint"]["kv_bytes"] / 256  # fp16 K and V of every layer
    for r in split:
        ane, gpu = rows["ane"]["estimated"][r["chip"]], rows["mlx"]["estimated"][f"{r['chip']} GPU"]
        assert (r["prefill"]["target"], r["decode"]["target"]) == ("ane", "mlx") and r["assumptions"]
        for q in r["requests"]:
            handoff = q["prompt"] * 3 * kv_per_token / (bandwidth[r["chip"]] * 1e9)
            seconds = q["prompt"] / ane["prefill_tok_s"] + handoff + q["new"] / gpu["decode_tok_s"]
            assert q["seconds"] == pytest.approx(seconds) and q["handoff_seconds"] == pytest.approx(handoff)
            alone = q["prompt"] / ane["prefill_tok_s"] + q["new"] / ane["decode_tok_s"]
            assert q["speedup"]["ane"] == pytest.approx(alone / seconds)
    main(["compare", str(built)])
    out = capsys.readouterr().out
    assert "disaggregated generation per chip" in out and "assumed: hand-off" in out


@pytest.mark.skipif(not MLX, reason="the mlx target needs MLX (pip install 'npumoe[mlx]')")
def test_compare_html_shows_the_disaggregated_rows_the_json_holds(built, tmp_path, capsys):
    from html.parser import HTMLParser

    main(["compare", str(built), "--json"])
    split = json.loads(capsys.readouterr().out)["disaggregated"]
    page = tmp_path / "report.html"
    main(["compare", str(built), "--html", str(page)])

    class Rows(HTMLParser):  # every table row's cells, as text
        def __init__(self):
            super().__init__()
            self.rows: list[list[str]] = []

        def handle_starttag(self, tag, attrs):
            if tag == "tr":
                self.rows.append([])
            elif tag in ("td", "th"):
                self.rows[-1].append("")

        def handle_data(self, data):
            if self.rows and self.rows[-1]:
                self.rows[-1][-1] += data

    parser = Rows()
    parser.feed(page.read_text())
    for r in split:
        for q in r["requests"]:
            want = [r["chip"], f"{r['prefill']['target']} → {r['decode']['target']}", f"{q['prompt']} + {q['new']}",
                    f"{q['seconds']:.3g}"]
            assert any(row[:4] == want for row in parser.rows), want
    assert "assumed: hand-off" in page.read_text()


def test_compare_says_what_each_device_can_hold_of_each_build(built, capsys):
    from npumoe.core.planning.costmodel import devices

    main(["compare", str(built), "--json"])
    result = json.loads(capsys.readouterr().out)
    for target, row in result["targets"].items():
        assert row["footprint"]["precision"] == "fp16" and row["footprint"]["max_context"] == 256
        assert [v["device"] for v in row["fits"]] == [d.name for _, d in devices(target)]
        assert all(v["fits"] for v in row["fits"])  # the demo: under 1 GB anywhere
    main(["compare", str(built)])
    lines = capsys.readouterr().out.splitlines()
    for _, device in (pair for target in result["targets"] for pair in devices(target)):
        assert any(line.strip().startswith(f"{device.name} ✓: ") for line in lines)


def test_compare_html_renders_in_chromium_with_its_numbers(built, tmp_path, capsys):
    import shutil
    import subprocess

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (ci/apt-packages.txt lists it; ci/test.sh installs it)")
    page = tmp_path / "report.html"
    main(["compare", str(built), "--html", str(page)])
    capsys.readouterr()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    cosine = json.loads((built / "manifest.json").read_text())["targets"]["ane"]["validation"]["cosine"]
    assert f"{cosine:.5f}" in dom and "Snapdragon 8 Gen 3" in dom and dom.count("data:image/png;base64") >= 2
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=1000,1400", page.as_uri()],
                   capture_output=True, timeout=120)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (1400, 1000) and pixels.std() > 0.05  # drawn, not a blank page


def test_compare_refuses_what_is_no_multi_target_build(built, tmp_path, capsys):
    import shutil

    assert "is a single target's build" in cli_error(capsys, "compare", str(built / "htp"))
    broken = tmp_path / "broken"
    shutil.copytree(built, broken)
    shutil.rmtree(broken / "ane")
    assert "has no manifest.json, so ane cannot be compared" in cli_error(capsys, "compare", str(broken))
    other = tmp_path / "other"
    shutil.copytree(built, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "model": "0123456789abcdef"}))
    assert "a comparison needs one model" in cli_error(capsys, "compare", str(other))
    (tmp_path / "a-file").write_text("mine")
    assert "--html" in cli_error(capsys, "compare", str(built), "--html", str(tmp_path / "a-file" / "r.html"))
    assert "--html" in cli_error(capsys, "compare", str(built), "--html", str(tmp_path / "a-file"))  # not ours


def test_cost_model_records_cite_every_number():
    from npumoe.core.ir.backend import plugins
    from npumoe.core.planning.costmodel import Workload, devices, estimate

    for _, device in devices():
        assert {k for k, _ in device.sources} == {"npu_tops", "dram_gb_s", "launch_us", "ram_gb", "app_share",
                                                  "max_package_gb", "graph_overhead_mb"}
        assert all(source.strip() for _, source in device.sources)
    for record in plugins().values():  # each figure checks a device of its own backend
        assert all(p.source and p.device in {d.name for d in record.devices} for p in record.published)
    small, large = Workload(1e9, 10, 2e9, 64, 5e9, 20), Workload(2e9, 10, 4e9, 64, 10e9, 20)
    for _, device in devices():  # more bytes a token: slower, never faster
        assert estimate(device, large).decode_tok_s < estimate(device, small).decode_tok_s
        assert estimate(device, large).prefill_tok_s <= estimate(device, small).prefill_tok_s
