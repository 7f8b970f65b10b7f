"""`npumoe bench scale --full` on a shrunk OLMoE checkpoint, all three NPU targets: each command measured in its own
process, the artifacts against the checkpoint's own tensors and the files on disk, each target's new tokens against
the CPU reference, and a killed run resumed from its --work directory without re-running what it finished."""

import importlib.util
import json

import numpy as np
import pytest
from cli_check import cli_error

from npumoe.cli import main

pytest.importorskip("onnxruntime_qnn", reason="the htp target needs onnxruntime-qnn (pip install 'npumoe[htp]')")
pytest.importorskip("openvino", reason="the intel_npu target needs OpenVINO (pip install 'npumoe[intel]')")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("coremltools") is None,
                                reason="the ane target needs coremltools (pip install 'npumoe[ane]')")

SMALL = dict(hidden_size=64, intermediate_size=32, num_experts=4, num_hidden_layers=2, vocab_size=300,
             num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2, eos_token_id=299)
TARGETS = ("htp", "ane", "intel_npu")


@pytest.fixture
def shrunk(tmp_path, monkeypatch):
    from npumoe.bench import scale
    from npumoe.bench.scale import OLMOE_1B_7B_0924, write_random_checkpoint

    monkeypatch.setattr(scale, "CACHE", tmp_path)
    return write_random_checkpoint({**OLMOE_1B_7B_0924, **SMALL}, tmp_path / "olmoe", progress=False)


def test_bench_scale_full_builds_runs_and_resumes_each_target(shrunk, tmp_path, capsys, monkeypatch):
    from safetensors import safe_open

    from npumoe.bench import scale
    from npumoe.core.planning.costmodel import devices

    work, measured = tmp_path / "work", []
    real = scale.measure

    def killed_before_the_last_generate(argv, env=None):
        if argv[0] == "generate" and argv[argv.index("--target") + 1] == "intel_npu":
            raise KeyboardInterrupt  # as Ctrl-C would, with every other step recorded
        return real(argv, env)

    def counted(argv, env=None):
        measured.append((argv[0], argv[argv.index("--target") + 1] if "--target" in argv else None))
        return real(argv, env)

    monkeypatch.setattr(scale, "measure", killed_before_the_last_generate)
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "scale", "--ckpt", str(shrunk), "--full", "--work", str(work), "--keep-builds", "--json"])
    assert stopped.value.code == 130
    # what the builds hold on disk, before the resumed run (without --keep-builds) deletes them
    disk = {t: sum(p.stat().st_size for p in (work / f"build-{t}").rglob("*") if p.is_file()) for t in TARGETS}
    stored = {"htp": len(list((work / "build-htp").rglob("*_ctx.onnx"))),
              "ane": len(list((work / "build-ane").rglob("*.mlpackage"))),
              "intel_npu": len(list((work / "build-intel_npu").rglob("*.xml")))}

    monkeypatch.setattr(scale, "measure", counted)
    capsys.readouterr()
    main(["bench", "scale", "--ckpt", str(shrunk), "--full", "--work", str(work), "--json"])
    assert measured == [("generate", "intel_npu")]  # the rest came from the first run's record
    full = json.loads(capsys.readouterr().out)["full"]
    assert [s["key"] for s in full["steps"]] == ["calibrate", *(f"{step} {t}" for t in TARGETS
                                                                 for step in ("plan", "build", "generate"))]
    assert all(s["seconds"] > 0 and s["peak_anon_bytes"] > 0 for s in full["steps"])
    assert not any((work / f"build-{t}").exists() for t in TARGETS) and not (work / "build-cache" / "htp").exists()

    numel = {}
    for f in shrunk.glob("*.safetensors"):
        with safe_open(f, "np") as st:
            numel |= {k: int(np.prod(st.get_slice(k).get_shape())) for k in st.keys()}
    on_host = [k for k in numel if k.endswith(("embed_tokens.weight", "mlp.gate.weight"))]
    fp16_held = 2 * (sum(numel.values()) - sum(numel[k] for k in on_host))
    for t in TARGETS:
        result = full["targets"][t]
        a, g = result["artifacts"], result["agreement"]
        assert a["precision"] == "fp16" and a["weights_held_bytes"] == fp16_held, t
        assert a["bytes_on_disk"] == disk[t] > fp16_held, t
        assert a["units"] == stored[t] >= 1, t
        assert 1 <= g["of"] == len(g["tokens"]) <= 8 and g["agree"] >= g["of"] - 1, t
        assert [v["device"] for v in result["fits"]] == [d.name for _, d in devices(t)], t
        assert all(v["fits"] for v in result["fits"]), t  # a few hundred kB fits every device
    assert stored["htp"] == full["targets"]["htp"]["artifacts"]["graphs"]  # one graph a QNN context
    assert stored["ane"] < full["targets"]["ane"]["artifacts"]["graphs"]  # graphs sharing weights share a package


def test_bench_scale_full_refuses_what_it_cannot_run(shrunk, tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    full = ["bench", "scale", "--ckpt", str(shrunk), "--full"]
    assert "is not a bench scale --full work directory" in cli_error(capsys, *full, "--work", str(foreign))
    assert (foreign / "notes.txt").read_text() == "keep me" and len(list(foreign.iterdir())) == 1
    assert "unknown target 'gpu'" in cli_error(capsys, *full, "--targets", "htp,gpu")
    assert "give --work DIR too" in cli_error(capsys, *full, "--keep-builds")
    assert "go with --full" in cli_error(capsys, "bench", "scale", "--ckpt", str(shrunk), "--targets", "htp")
