"""npumoe build --targets: one calibration, every vendor built and validated, one directory to run from."""

import json

import numpy as np
import pytest

import npumoe
from cli_check import cli_error
from npumoe.cli import main
from npumoe.models.demo import corpus

pytest.importorskip("onnxruntime_qnn", reason="the htp target needs onnxruntime-qnn (pip install 'npumoe[htp]')")
pytest.importorskip("coremltools", reason="the ane target needs coremltools (pip install 'npumoe[ane]')")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    calibration, heldout = folder / "calibration.txt", folder / "heldout.txt"
    calibration.write_text("\n".join(t[:1500] for t in corpus.calibration_texts(4)))
    heldout.write_text(corpus.heldout_texts(1)[0][:600])
    return calibration, heldout


@pytest.fixture(scope="module")
def built(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("targets") / "build"
    main(["build", "--targets", "htp,ane", "--text", str(texts[0]), "--heldout", str(texts[1]), "--chunk", "32",
          "--max-context", "256", "--residency", "npu", "--out", str(out)])
    return out


def test_one_command_builds_and_validates_every_target(built):
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["kind"] == "npumoe.Targets" and list(manifest["targets"]) == ["htp", "ane"]
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
    assert "holds builds for htp, ane, not 'cpu'" in cli_error(capsys, "generate", "--artifacts", str(built),
                                                               "--target", "cpu")


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
