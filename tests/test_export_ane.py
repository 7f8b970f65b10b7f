"""npumoe export --target ane on the demo model: the program exports with its expert products delegated to Core ML;
the Core ML models it carries (unpacked from the program itself) pass the ANE lint, which a planted violation fails;
one partition, run by npumoe's MIL interpreter, computes the layer's expert products (numpy over the demo's weights);
and npumoe-run on Linux says in one line where the program runs."""

import subprocess
import sys

import numpy as np
import pytest
from native_run import skip_without_compiler

pytest.importorskip("executorch.exir", reason="npumoe export needs the executorch wheel")
pytest.importorskip("coremltools", reason="npumoe export --target ane needs coremltools (pip install 'npumoe[ane]')")

import npumoe  # noqa: E402
from npumoe.backends.apple_ane import lint  # noqa: E402
from npumoe.backends.apple_ane.mil_exec import MilFunction  # noqa: E402
from npumoe.backends.apple_ane.mlpackage import SPEC_PATH, Package  # noqa: E402
from npumoe.backends.apple_ane.pte import core_ml_packages  # noqa: E402
from npumoe.cli import main  # noqa: E402
from npumoe.core.base.errors import ArtifactError  # noqa: E402
from npumoe.core.ir.backend import FP16_CONFORMANCE  # noqa: E402
from npumoe.core.ir.spec import MoESpec  # noqa: E402
from npumoe.core.ir.weights import expert  # noqa: E402
from npumoe.core.planning.plan import Plan  # noqa: E402
from npumoe.core.tools.export import export  # noqa: E402
from npumoe.models.demo import corpus  # noqa: E402

CHUNK, CONTEXT = 16, 96


@pytest.fixture(scope="module")
def demo():
    return npumoe.load(dtype="float32")


@pytest.fixture(scope="module")
def exported(demo, tmp_path_factory):
    skip_without_compiler()
    profile = npumoe.calibrate(demo, [t[:512] for t in corpus.calibration_texts(2)], chunk=CHUNK, window=256)
    plan = Plan.from_json(npumoe.plan(demo, profile, target="ane", residency="npu").to_json())
    plan.dense_placement = "cpu"  # as the program keeps them: attention, dense parts and head on ExecuTorch's CPU
    out = tmp_path_factory.mktemp("export") / "demo-ane"
    return out, export(demo, "ane", out, plan=plan, max_context=CONTEXT, decode_on="npu")


@pytest.fixture(scope="module")
def packages(exported, tmp_path_factory):
    return core_ml_packages((exported[0] / "model.pte").read_bytes(), tmp_path_factory.mktemp("coreml"))


def test_each_moe_layer_has_one_core_ml_model_that_both_methods_share(demo, exported, packages):
    _, manifest = exported
    assert [m["device"].split()[0] for m in manifest["methods"].values()] == ["ane", "ane"]
    moe_layers = sum(isinstance(layer.ffn, MoESpec) for layer in demo.spec.layers)
    assert len(packages) == moe_layers
    for package in packages:
        assert set(Package(package).functions) == {"prefill", "decode"}  # one model, its weights stored once


def test_the_core_ml_partitions_pass_the_ane_lint(packages):
    for package in packages:
        reports = lint.check(package)
        assert all(r.placement == "ANE" for r in reports)


def test_a_planted_rejected_op_fails_the_lint(packages, tmp_path):
    planted = tmp_path / "planted.mlpackage"
    subprocess.run(["cp", "-r", str(packages[0]), str(planted)], check=True)
    package = Package(planted)
    next(op for op in package.operations("prefill") if op.type == "matmul").type = "gather"
    (planted / SPEC_PATH).write_bytes(package.spec.SerializeToString())
    with pytest.raises(ArtifactError, match="ane-ops"):
        lint.check(planted)


def test_a_partition_computes_its_layers_expert_products(demo, packages):
    """Partition n (the n-th MoE layer's) on the MIL interpreter against numpy over the layer's fp16-rounded weights:
    every expert's gated product of its rows, within the fp16 conformance bound."""
    layer = 1
    function = MilFunction(Package(packages[layer]), "prefill")
    (name, spec), = function.inputs.items()
    x = np.random.default_rng(0).standard_normal(spec.shape).astype(np.float16)
    (y,) = function({name: x}, {}).values()

    def weight(e, part):
        return demo.weights[f"{expert(layer, e)}.{part}.weight"].numpy().astype(np.float16).astype(np.float32)

    truth = []
    for e, rows in enumerate(x.astype(np.float32)):
        gate, up = rows @ weight(e, "gate").T, rows @ weight(e, "up").T
        truth.append((gate / (1 + np.exp(-gate)) * up) @ weight(e, "down").T)
    truth = np.stack(truth)
    assert y.shape == truth.shape
    assert np.abs(y.astype(np.float32) - truth).max() <= FP16_CONFORMANCE.max_relative_error * np.abs(truth).max()


def test_npumoe_lint_reads_the_program_and_refuses_other_files(exported, tmp_path, capsys):
    out, _ = exported
    main(["lint", str(out / "model.pte")])
    assert "all pass the ANE rules" in capsys.readouterr().out
    (tmp_path / "junk.pte").write_bytes(b"not a program")
    with pytest.raises(SystemExit) as exit_:
        main(["lint", str(tmp_path / "junk.pte")])
    assert exit_.value.code == 2 and "is not an ExecuTorch program" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the Core ML delegate may be there")
def test_the_runner_says_in_one_line_that_the_program_needs_core_ml(exported):
    out, _ = exported
    done = subprocess.run([str(out / "npumoe-run"), str(out / "model.pte"), "--tokens", "1,2,3"], env={},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "CoreMLBackend" in done.stderr and "macOS or iOS" in done.stderr
