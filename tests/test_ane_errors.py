"""Bad input to the ANE backend: a typed error with one clear sentence; on the CLI, that sentence and exit 2."""

import importlib.util
import sys

import numpy as np
import pytest
import torch
from cli_check import cli_error
from hf_compare import build_checkpoint, transformers

import npumoe
from npumoe.backends.apple_ane import rules
from npumoe.backends.apple_ane.backend import AneBackend
from npumoe.backends.apple_ane.lint import check, lint_package
from npumoe.backends.apple_ane.mlpackage import SPEC_PATH, Package
from npumoe.core.base.errors import ArtifactError, BackendUnavailableError, InputError
from npumoe.core.compiler.artifacts import build
from npumoe.core.compiler.program import build_program
from npumoe.core.ir.backend import Lowered
from npumoe.core.planning.plan import plan
from npumoe.core.runtime.calibrate import calibrate

pytestmark = pytest.mark.skipif(importlib.util.find_spec("coremltools") is None,
                                reason="coremltools is not installed (pip install 'npumoe[ane]')")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Experts wider than attention, so an expert group is the largest unit of weights."""
    path = tmp_path_factory.mktemp("small")
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2)
    build_checkpoint(cfg, path)
    (path / "npumoe_tokenizer.json").write_text('{"kind": "bytes"}')
    model = npumoe.load(path)
    rng = np.random.default_rng(0)
    profile = calibrate(model, [rng.integers(0, 64, 512).tolist()], chunk=32)
    ane_plan = plan(model, profile, target="ane", residency="npu")
    ane_plan.save(path / "plan.json")
    return model, ane_plan, path


@pytest.fixture(scope="module")
def lm_head_package(small, tmp_path_factory):
    model, ane_plan, _ = small
    out = tmp_path_factory.mktemp("lm_head")
    graphs = [g for g in build_program(model.spec, ane_plan.chunk, 64, ane_plan).graphs.values() if g.kind == "lm_head"]
    backend = AneBackend()
    return backend, out, graphs, backend.build(graphs, model.weights, out, progress=False)


# -- packages that are not what they claim ------------------------------------------------------------
def test_not_an_ml_program(tmp_path, capsys):
    from coremltools.proto import Model_pb2

    spec = Model_pb2.Model(specificationVersion=4)
    spec.neuralNetwork.SetInParent()
    path = tmp_path / "old.mlpackage"
    (path / SPEC_PATH).parent.mkdir(parents=True)
    (path / SPEC_PATH).write_bytes(spec.SerializeToString())
    with pytest.raises(ArtifactError, match="holds a neuralNetwork model, not an ML program"):
        Package(path)
    assert "not an ML program" in cli_error(capsys, "lint", str(path))
    assert "is not an .mlpackage" in cli_error(capsys, "lint", str(tmp_path / "nothing.mlpackage"))


def test_function_that_does_not_exist(small, lm_head_package):
    model, _, _ = small
    backend, out, graphs, entries = lm_head_package
    entry = entries[graphs[0].name]
    with pytest.raises(ArtifactError, match=r"has no function 'L9_attn_s1'; it has lm_head_s"):
        Package(out / entry["package"]).function("L9_attn_s1")
    with pytest.raises(ArtifactError, match="has no function 'lm_head_s2'"):
        backend.load(Lowered.from_entry({**entry, "function": "lm_head_s2"}), out, graphs[0], model.weights)


# -- the lint ---------------------------------------------------------------------------------------
class Gather(torch.nn.Module):
    def forward(self, x, ids):
        return torch.index_select(x, 0, ids)  # an embedding-style row lookup


class TopK(torch.nn.Module):
    def forward(self, x):
        return torch.topk(x, 2, dim=1).values


class Compare(torch.nn.Module):
    def forward(self, x):
        return torch.where(x > 0, x, x * 0.5)


class RuntimeSlice(torch.nn.Module):
    def forward(self, x, position):
        p = position[0]
        return x[p:p + 2] * 2  # rows chosen at run time, and not as a state write


class Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


class OddState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 3, 40, 20, dtype=torch.float16))

    def forward(self, x):
        self.cache[:, :, :4, :] = x
        return x * 2


TORCH_DTYPES = {np.float16: torch.float16, np.float32: torch.float32, np.int32: torch.int32}


def convert(module, tmp_path, inputs, states=None, precision="FLOAT16"):
    """A small torch module as a saved ML program: inputs are (name, shape, numpy dtype)."""
    import coremltools as ct

    example = tuple(torch.zeros(shape, dtype=TORCH_DTYPES[dtype]) for _, shape, dtype in inputs)
    mlmodel = ct.convert(torch.jit.trace(module.eval(), example),
                         inputs=[ct.TensorType(name=n, shape=s, dtype=d) for n, s, d in inputs], states=states,
                         convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                         compute_precision=getattr(ct.precision, precision), skip_model_load=True)
    path = tmp_path / f"{type(module).__name__}.mlpackage"
    mlmodel.save(str(path))
    return path


def bad_package(kind, tmp_path):
    import coremltools as ct

    x = ("x", (4, 8), np.float16)
    if kind == "gather":
        return convert(Gather(), tmp_path, [x, ("ids", (2,), np.int32)])
    if kind == "topk":
        return convert(TopK(), tmp_path, [x])
    if kind == "comparison":
        return convert(Compare(), tmp_path, [x])
    if kind == "runtime_slice":
        return convert(RuntimeSlice(), tmp_path, [x, ("position", (1,), np.int32)])
    if kind == "fp32":
        return convert(Double(), tmp_path, [("x", (4, 8), np.float32)], precision="FLOAT32")
    if kind == "state":
        state = ct.StateType(wrapped_type=ct.TensorType(shape=(1, 3, 40, 20), dtype=np.float16), name="cache")
        return convert(OddState().half(), tmp_path, [("x", (1, 3, 4, 20), np.float16)], states=[state])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, op, rule", [
    ("gather", "gather", "ane-ops"),
    ("topk", "topk", "ane-ops"),
    ("comparison", "greater", "ane-ops"),
    ("runtime_slice", "slice_by_index", "dynamic-index"),
    ("fp32", "input", "fp16"),
    ("state", "state", "states"),
])
def test_lint_names_function_op_and_rule(kind, op, rule, tmp_path, capsys):
    path = bad_package(kind, tmp_path)
    found = [v for r in lint_package(path) for v in r.violations]
    assert any(v.function == "main" and v.op == op and v.rule == rule for v in found), found
    with pytest.raises(ArtifactError, match=r"function main, op \w+: rule [\w-]+"):
        check(path)
    err = cli_error(capsys, "lint", str(path))
    assert "ANE rule violation" in err and "function main" in err


def test_mil_exec_refuses_an_op_it_does_not_know(tmp_path):
    from npumoe.backends.apple_ane.mil_exec import MilFunction

    path = bad_package("gather", tmp_path)  # index_select: a negative-index guard (greater_equal, select), a gather
    with pytest.raises(ArtifactError, match=r"mil_exec cannot run MIL op '(\w+)' \(function main of Gather") as err:
        MilFunction(Package(path), "main")
    assert err.value.args[0].split("'")[1] in rules.REJECTED_OPS


# -- the toolchain and the plan ---------------------------------------------------------------------
def test_missing_coremltools_says_how_to_install(small, lm_head_package, monkeypatch, capsys):
    model, _, _ = small
    _, out, graphs, entries = lm_head_package
    for name in [m for m in sys.modules if m.split(".")[0] == "coremltools"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'npumoe\[ane\]'"):
        AneBackend().build(graphs, model.weights, out / "again", progress=False)
    assert "pip install 'npumoe[ane]'" in cli_error(capsys, "lint", str(out / entries[graphs[0].name]["package"]))


def test_group_larger_than_a_package_is_refused(small, tmp_path, monkeypatch, capsys):
    model, ane_plan, path = small
    biggest = max((g for lp in ane_plan.layers.values() for g in lp.groups), key=lambda g: g.weight_bytes)
    monkeypatch.setitem(rules.MAX_PACKAGE_BYTES, "ios", biggest.weight_bytes - 1)
    with pytest.raises(InputError, match=r"graph L\d\.experts\.g\d\.p\d needs .* GB of weights but an ANE package "
                                         r"may hold .* GB on ios"):
        build(model, ane_plan, "ane", tmp_path / "out", progress=False)
    err = cli_error(capsys, "build", "--model", str(path), "--plan", str(path / "plan.json"), "--target", "ane",
                    "--out", str(tmp_path / "out"))
    assert "--precision int4" in err
    assert not (tmp_path / "out").exists()  # nothing half-built is left behind


def test_unknown_precision_and_toolchain(small, tmp_path, capsys):
    _, _, path = small
    with pytest.raises(InputError, match="precision 'int3' is not one of fp16, int4, palettize4, palettize2"):
        AneBackend(precision="int3")
    with pytest.raises(InputError, match="--via executorch takes --precision fp16 or int4"):
        AneBackend(via="executorch", precision="palettize2")
    err = cli_error(capsys, "build", "--model", str(path), "--plan", str(path / "plan.json"), "--target", "ane",
                    "--via", "tflite", "--out", str(tmp_path / "out"))
    assert "--via 'tflite' is not one of coreml, executorch" in err
    err = cli_error(capsys, "build", "--model", str(path), "--plan", str(path / "plan.json"), "--target", "ane",
                    "--soc", "69", "--out", str(tmp_path / "out"))
    assert "--soc does not apply to target ane; its build options are: --via, --precision" in err


def test_artifacts_of_another_target_are_refused(small, lm_head_package):
    model, _, _ = small
    backend, out, graphs, entries = lm_head_package
    with pytest.raises(ArtifactError, match="was not built for the ANE"):
        backend.load(Lowered("onnx", ("x.onnx",)), out, graphs[0], model.weights)


def test_an_expert_groups_prefill_and_decode_graphs_share_one_package(small, monkeypatch):
    """Decode graphs cut from a group (one expert each here) read its weights: packed into another package than the
    group's prefill graph, each of those weights would be stored twice. Packages split by size still keep them."""
    from npumoe.backends.apple_ane.packaging import plan_packages
    from npumoe.core.compiler.graphs import experts_graph

    model = small[0]
    groups = {"g0": (0, 1), "g1": (2, 3)}
    prefill = [experts_graph(model.spec, 0, e, (16,) * len(e), f"L0.experts.{g}.p0") for g, e in groups.items()]
    decode = [experts_graph(model.spec, 0, (e,), (1,), f"L0.experts.{g}.d{k}")
              for g, experts in groups.items() for k, e in enumerate(experts)]
    graphs = prefill + decode  # the order a layer's graphs come in: every prefill graph, then every decode graph
    group_bytes = 2 * sum(2 * n for n in [model.spec.hidden_size * 64] * 3)  # two experts' three fp16 matrices
    monkeypatch.setitem(rules.MAX_PACKAGE_BYTES, "ios", group_bytes)  # one group a package
    packages = plan_packages(graphs, model.weights, "fp16", "ios")
    assert len(packages) == 2
    for package, (group, experts) in zip(packages, groups.items()):
        assert sorted(g.name for g in package.graphs) == sorted(
            [f"L0.experts.{group}.p0", *(f"L0.experts.{group}.d{k}" for k in range(len(experts)))])
