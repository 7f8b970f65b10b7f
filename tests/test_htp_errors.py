"""Bad input to the HTP backend that needs no built model: typed errors with one clear sentence.

(An altered artifact and a prompt longer than the compiled KV length are in test_htp_build.py,
which has a build to alter.)
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'npumoe[htp]')")
pytest.importorskip("onnx")

from npumoe.backends import onnx_export
from npumoe.backends.qualcomm_htp import qnn
from npumoe.backends.qualcomm_htp.backend import HtpBackend
from npumoe.core.base.errors import BackendUnavailableError, InputError
from npumoe.core.ir.backend import get_backend
from npumoe.core.ir.graph import Graph, GraphBuilder, Op, TensorType, w


def tiny_graph(act: str = "gelu") -> tuple[Graph, dict]:
    b = GraphBuilder()
    h = b("linear", "x", w("up.weight"))
    b.rename_output(b(act, h, approximate="none") if act == "gelu" else b(act, h), "y")
    graph = Graph("tiny.ffn", "ffn", {"x": TensorType((8, 16))}, {"y": TensorType((8, 16))}, b.ops)
    return graph, {"up.weight": torch.randn(16, 16, generator=torch.Generator().manual_seed(0))}


def test_unknown_soc_lists_the_known_ones():
    with pytest.raises(InputError, match=r"--soc '12345'.*69 = Snapdragon 8 Elite"):
        HtpBackend(soc="12345")


def test_unknown_precision_and_option():
    with pytest.raises(InputError, match="--precision 'int2'"):
        get_backend("htp", precision="int2")
    with pytest.raises(InputError, match="--colour does not apply to the HTP"):
        get_backend("htp", colour="red")


def test_a_node_the_htp_rejects_is_named_with_its_ir_op(monkeypatch, tmp_path):
    """Erf is not an HTP op: lowering gelu through it must fail the build, naming node, ONNX op and IR op."""

    def gelu_via_erf(b, op, out):  # not the exact GELU formula, which onnxruntime would fuse into Gelu
        return b.node("Mul", op.inputs[0], b.node("Erf", op.inputs[0]), out=out)

    monkeypatch.setitem(onnx_export.LOWERINGS, "gelu", gelu_via_erf)
    graph, weights = tiny_graph("gelu")
    with pytest.raises(InputError, match=r"rejects node 'y/Erf_\d+' \(ONNX Erf, lowered from IR op 'gelu'") as err:
        HtpBackend().lower(graph, weights, tmp_path)
    assert "tiny.ffn" in str(err.value)


def test_a_node_that_fails_at_qnn_finalize_is_named_with_its_ir_op(monkeypatch, tmp_path):
    """GatherND on a 16 MB graph input passes onnxruntime's HTP capability check but QNN cannot finalize it
    (QNN_COMMON_ERROR_MEM_ALLOC); the error must still name the node, its ONNX op and its IR op."""

    def slice_via_gathernd(b, op, out):
        rows = np.arange(op.a["start"], op.a["stop"], op.a["step"]).reshape(-1, 1)
        return b.node("GatherND", op.inputs[0], b.const(rows, np.int64), out=out)

    monkeypatch.setitem(onnx_export.LOWERINGS, "slice", slice_via_gathernd)
    b = GraphBuilder()
    z = b("relu", "z")  # a node before the culprit, so that finding it takes the bisection
    b.rename_output(b("add", b("slice", "x", axis=0, start=0, stop=8, step=1), z), "y")
    graph = Graph("tiny.rows", "ffn", {"x": TensorType((1 << 16, 64)), "z": TensorType((8, 64))},
                  {"y": TensorType((8, 64))}, b.ops)
    with pytest.raises(InputError, match=r"node '(slice_\d+)/GatherND_\d+' \(ONNX GatherND, lowered from IR op 'slice' "
                                         r"→ \1\) in graph tiny.rows is rejected by the HTP: .*MEM_ALLOC"):
        HtpBackend().lower(graph, {}, tmp_path)


def test_an_ir_op_without_lowering_is_named(tmp_path):
    graph, weights = tiny_graph("relu")
    graph.ops[1] = Op("lut_linear", graph.ops[1].inputs, graph.ops[1].outputs)
    with pytest.raises(InputError, match="graph tiny.ffn has IR op 'lut_linear'"):
        HtpBackend().lower(graph, weights, tmp_path)


def test_the_same_graph_compiles_and_runs_on_the_htp(tmp_path):
    graph, weights = tiny_graph("gelu")
    entry = HtpBackend().lower(graph, weights, tmp_path)
    x = torch.randn(8, 16)
    got = HtpBackend().load(entry, tmp_path, graph, weights)({"x": x})["y"]
    want = torch.nn.functional.gelu(x @ weights["up.weight"].T)
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)


def test_missing_onnxruntime_qnn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'onnxruntime-qnn==2\.7\.0'"):
        qnn.ort_qnn()


def test_mask_floor_keeps_softmax_finite():
    from npumoe.backends.qualcomm_htp.executor import MASK_FLOOR, encode
    from npumoe.core.ir.graph import Graph, Role, TensorType

    graph = Graph("g", "attention", {"mask": TensorType((1, 2), role=Role.MASK), "x": TensorType((1, 2))}, {}, [])
    feed = encode(graph, {"mask": torch.tensor([[0.0, float("-inf")]]), "x": torch.tensor([[0.0, float("-inf")]])})
    np.testing.assert_array_equal(feed["mask"], [[0.0, MASK_FLOOR]])
    np.testing.assert_array_equal(feed["x"], [[0.0, float("-inf")]])  # only what is declared a mask is floored


def test_executorch_after_onnxruntime_qnn_in_one_process_is_refused():
    """ExecuTorch would silently get the real libQnnHtp.so (and fail with error 14001): say what to do."""
    pytest.importorskip("executorch", reason="executorch is not installed (pip install executorch==1.5.1)")
    script = (
        "import numpy as np, torch\n"
        "from npumoe.backends.qualcomm_htp.backend import HtpBackend\n"
        "from npumoe.backends.qualcomm_htp.shim import qnn_sdk_root\n"
        "from npumoe.core.base.errors import BackendUnavailableError\n"
        "from test_htp_errors import tiny_graph\n"
        "import tempfile, pathlib\n"
        "HtpBackend().lower(*tiny_graph(), pathlib.Path(tempfile.mkdtemp()))\n"
        "try:\n    qnn_sdk_root()\nexcept BackendUnavailableError as err:\n    print(err)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("QNN_SDK_ROOT", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert "already loaded onnxruntime-qnn's libQnnHtp.so" in done.stdout, done.stderr[-2000:]
    assert "run --via executorch in its own process" in done.stdout


def test_qnn_library_notices_stay_off_stdout(tmp_path):
    """QNN prints a '# LIBNATIVE' notice to the process's stdout when it loads: it must not reach npumoe's
    output, where it would corrupt `--json` documents."""
    script = ("import sys, npumoe\n"
              "from pathlib import Path\n"
              "from npumoe.core.compiler.graphs import experts_graph\n"
              "from npumoe.backends.qualcomm_htp.backend import HtpBackend\n"
              "m = npumoe.load()\n"
              "HtpBackend().lower(experts_graph(m.spec, 0, (0,), (8,), 'g'), m.weights, Path(sys.argv[1]))\n"
              "print('done')\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "done\n"
