"""Nothing silently wrong: profiles, plans and artifacts belong to one set of weights, and NaN/Inf is named.

The truths: a fine-tune made here (a tiny checkpoint with one weight changed, so its config and spec
fingerprint are the base's; small enough that the fast fingerprint hashes every byte), and checkpoints with
a NaN planted in a known tensor.
"""

import json

import numpy as np
import pytest
import torch
from cli_check import cli_error
from hf_compare import build_checkpoint, transformers
from safetensors.torch import load_file, save_file

import npumoe
from npumoe.cli import main
from npumoe.core.base.errors import ArtifactError, NumericError
from npumoe.core.compiler.artifacts import build
from npumoe.core.ir import identity

IDS = np.random.default_rng(0).integers(0, 50, 200).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "base"
    build_checkpoint(transformers.Qwen3MoeConfig(
        vocab_size=50, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
    ), path)
    return path


def variant(src, dst, edits: dict):
    """Checkpoint ``src`` copied to ``dst`` with ``edits`` (stored name → fn(tensor)) applied to its weights."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    for name, edit in edits.items():
        tensors[name] = edit(tensors[name].clone())
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def nudged(t):
    t[0, 0] += 0.01
    return t


@pytest.fixture(scope="module")
def base_outputs(tiny, tmp_path_factory):
    """A profile, a CPU plan with its experts 'on the NPU', and that plan built, all from the base weights."""
    path = tmp_path_factory.mktemp("outputs")
    base = npumoe.load(tiny)
    profile = npumoe.calibrate(base, [IDS], chunk=16)
    profile.save(path / "profile.json")
    plan = npumoe.plan(base, profile, target="cpu", residency="npu")
    plan.save(path / "plan.json")
    build(base, plan, "cpu", path / "build", progress=False)
    return path


@pytest.fixture(scope="module")
def fine_tune(tiny, tmp_path_factory):
    """The base with one weight of one expert changed: same config, other weights."""
    edits = {"model.layers.1.mlp.experts.3.down_proj.weight": nudged}
    return variant(tiny, tmp_path_factory.mktemp("ft") / "ft", edits)


def test_fine_tune_shares_the_spec_but_not_the_weights(tiny, fine_tune):
    base, ft = npumoe.load(tiny), npumoe.load(fine_tune)
    assert base.fingerprint == ft.fingerprint
    assert base.weights_fingerprint() != ft.weights_fingerprint()


def test_base_profile_is_refused_for_the_fine_tune(base_outputs, fine_tune, capsys):
    from npumoe.core.planning.profile import RoutingProfile

    with pytest.raises(ArtifactError, match=r"other weights \(base, weights \w+\) than ft's .*calibrate ft first"):
        npumoe.plan(npumoe.load(fine_tune), RoutingProfile.load(base_outputs / "profile.json"), target="cpu")
    err = cli_error(capsys, "plan", "--model", str(fine_tune), "--profile", str(base_outputs / "profile.json"),
                    "--target", "cpu", "--out", str(base_outputs / "ft-plan.json"))
    assert "other weights" in err and "calibrate ft first" in err


def test_base_plan_is_refused_for_the_fine_tune(base_outputs, fine_tune, capsys):
    err = cli_error(capsys, "generate", "--model", str(fine_tune), "--plan", str(base_outputs / "plan.json"),
                    "--ids", "1,2,3", "-n", "2")
    assert "this plan was made from other weights (base" in err and "make one for ft with npumoe plan" in err


def test_base_artifacts_are_refused_for_the_fine_tune(tiny, base_outputs, fine_tune, capsys):
    err = cli_error(capsys, "generate", "--model", str(fine_tune), "--artifacts", str(base_outputs / "build"),
                    "--ids", "1,2,3", "-n", "2")
    assert "the artifact directory " in err and "build was made from other weights (base" in err
    assert "rebuild it for ft with npumoe build" in err
    npumoe.Engine(npumoe.load(tiny), artifacts=base_outputs / "build").generate(np.array([1, 2, 3]), 2)  # its own


def test_files_from_before_weights_were_recorded(tiny, base_outputs, tmp_path):
    """Plans and profiles hold measurements, not weights: accepted on the spec check. Artifacts hold compiled
    weights and nothing says which: refused with the fix."""
    base = npumoe.load(tiny)
    plan = json.loads((base_outputs / "plan.json").read_text())
    del plan["weights"]
    (tmp_path / "old-plan.json").write_text(json.dumps(plan))
    npumoe.Engine(base, plan=npumoe.Plan.load(tmp_path / "old-plan.json"))
    old = tmp_path / "old-build"
    old.mkdir()
    for f in (base_outputs / "build").iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["weights"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="records no weights fingerprint.*rebuild it for base with npumoe build"):
        npumoe.Engine(base, artifacts=old)


def test_fingerprint_is_cached_and_samples_large_files(tmp_path, monkeypatch):
    monkeypatch.setenv("NPUMOE_CACHE_DIR", str(tmp_path / "cache"))
    big = tmp_path / "big.safetensors"
    header = b'{"w":{"dtype":"U8","shape":[8388608],"data_offsets":[0,8388608]}}'
    data = bytearray(np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    big.write_bytes(len(header).to_bytes(8, "little") + header + data)
    first = identity.weights_fingerprint([big], "fast")
    monkeypatch.setattr(identity, "_hash_file", lambda *a: pytest.fail("re-read a file whose stat is unchanged"))
    assert identity.weights_fingerprint([big], "fast") == first
    monkeypatch.undo()
    monkeypatch.setenv("NPUMOE_CACHE_DIR", str(tmp_path / "cache"))
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # a fine-tune touches pages all over the file
    big.write_bytes(len(header).to_bytes(8, "little") + header + data)
    assert identity.weights_fingerprint([big], "fast") != first
    assert identity.weights_fingerprint([big], "full").startswith("full-")


@pytest.mark.parametrize("tensor, named", [
    ("model.layers.1.self_attn.o_proj.weight", "layer 1's attention (graph L1."),
    ("model.layers.0.mlp.experts.{e}.down_proj.weight", "layer 0's MoE feed-forward (router and graphs"),
])
def test_nan_weight_stops_generation_naming_the_layer(tiny, tensor, named, tmp_path, capsys):
    def poisoned(t):
        t[0, 0] = float("nan")
        return t

    path = variant(tiny, tmp_path / "nan", {tensor.format(e=e): poisoned for e in range(4)})
    with pytest.raises(NumericError, match="produced NaN or Inf"):
        npumoe.Engine(npumoe.load(path)).generate(np.array([1, 2, 3]), 2)
    err = cli_error(capsys, "generate", "--model", str(path), "--ids", "1,2,3", "-n", "2")
    assert named in err and "inspect --check-values" in err


def test_inspect_check_values_names_the_tensor(tiny, tmp_path, capsys):
    def poisoned(t):
        t[0, :3] = torch.tensor([float("nan"), float("inf"), float("nan")])
        return t

    path = variant(tiny, tmp_path / "nan", {"model.layers.0.self_attn.q_proj.weight": poisoned})
    main(["inspect", str(path)])
    assert f"npumoe inspect --check-values {path}" in " ".join(capsys.readouterr().out.split())
    main(["inspect", "--check-values", str(path)])
    out = capsys.readouterr().out
    assert "1 of " in out and "tensors hold NaN or Inf" in out
    assert "model.layers.0.self_attn.q_proj.weight: 2 NaN, 1 Inf of 1024" in out
