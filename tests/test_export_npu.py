"""npumoe export for the NPU targets on the demo model: the program, its expert products delegated (QNN fp16 on QNN's
x86 HTP for htp; OpenVINO on its CPU device for intel_npu) and run by npumoe-run in a process of its own (no Python,
no torch), gives the greedy tokens of npumoe's engine running the same plan's expert groups on the same device
(`npumoe generate --target T`), and logits within the target's declared conformance bound of the reference engine's."""

import importlib.util
import json
import subprocess

import numpy as np
import pytest
from native_run import npumoe_run, skip_without_compiler

pytest.importorskip("executorch.exir", reason="npumoe export needs the executorch wheel (pip install executorch==1.5.1)")

import npumoe  # noqa: E402
from npumoe.core.compiler.artifacts import build  # noqa: E402
from npumoe.core.ir.backend import plugin  # noqa: E402
from npumoe.core.planning.plan import Plan  # noqa: E402
from npumoe.core.tools.export import export  # noqa: E402
from npumoe.models.demo import corpus  # noqa: E402

if importlib.util.find_spec("onnxruntime_qnn") is not None:
    from npumoe.backends.qualcomm_htp.shim import qnn_sdk_root

    qnn_sdk_root()  # before any onnxruntime-qnn session: ExecuTorch's QNN lowering needs the shim loaded first

CHUNK, CONTEXT, NEW = 16, 96, 32
TARGETS = {  # target: (the Python package its toolchain needs and how to install it, delegate library, delegate id)
    "htp": ("onnxruntime_qnn", "pip install 'npumoe[htp]'", "libexecutorch_backend_qnn.so", b"QnnBackend"),
    "intel_npu": ("nncf", "pip install nncf (ExecuTorch's OpenVINO partitioner imports it)",
                  "libexecutorch_backend_openvino.so", b"OpenvinoBackend"),
}


@pytest.fixture(scope="module")
def demo():
    return npumoe.load(dtype="float32")


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request):
    package, install = TARGETS[request.param][:2]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{request.param} needs {package}: {install}")
    skip_without_compiler()
    return request.param


@pytest.fixture(scope="module")
def plan(demo, target):
    """A plan for the target whose attention, dense parts and head stay on the CPU, as the program keeps them: only its
    expert groups run on the device, in the engine as in the program."""
    profile = npumoe.calibrate(demo, [t[:512] for t in corpus.calibration_texts(2)], chunk=CHUNK, window=256)
    experts_only = Plan.from_json(npumoe.plan(demo, profile, target=target, residency="npu").to_json())
    experts_only.dense_placement = "cpu"
    return experts_only


@pytest.fixture(scope="module")
def exported(demo, target, plan, tmp_path_factory):
    """Exported once per target: QNN's compile is slow."""
    out = tmp_path_factory.mktemp("export") / f"demo-{target}"
    return out, export(demo, target, out, plan=plan, max_context=CONTEXT, decode_on="npu")


@pytest.fixture(scope="module")
def ids(demo):
    """Held-out text over two chunks and part of a third: padding rows and chunk-to-chunk cache reads both run."""
    return demo.tokenizer.encode(corpus.heldout_texts(1)[0][:40])



@pytest.fixture(scope="module")
def device_tokens(demo, target, plan, ids, tmp_path_factory):
    """`npumoe generate --target T` over the same plan: its expert groups built for the device and run there."""
    artifacts = tmp_path_factory.mktemp("build") / target
    build(demo, plan, target, artifacts, max_context=CONTEXT, progress=False)
    engine = npumoe.Engine(demo, plan=plan, backend=target, artifacts=artifacts, max_context=CONTEXT)
    new = engine.generate(np.asarray(ids), max_new_tokens=NEW).tolist()
    assert engine.metrics["npu_launches"] > 0
    return ids + new


def generated(directory, ids, *flags: str) -> dict:
    done = npumoe_run(directory, "--tokens", ",".join(map(str, ids)), "--max-new-tokens", str(NEW), "--json", *flags)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)  # nothing but the result on stdout, although QNN's simulator prints there


def test_the_runner_gives_the_device_engines_tokens(demo, plan, exported, ids, device_tokens, target):
    result = generated(exported[0], ids, "--logits")
    assert result["tokens"] == device_tokens
    reference = npumoe.Engine(demo, plan=plan, max_context=CONTEXT)
    _, logits = reference.generate(np.asarray(ids), max_new_tokens=NEW, return_logits=True)
    bound = plugin(target).conformance.max_relative_error
    assert np.abs(np.asarray(result["logits"]) - logits).max() <= bound * np.abs(logits).max()


def test_the_expert_products_are_delegated(target, exported):
    out, manifest = exported
    assert manifest["npumoe_target"] == target
    assert [m["device"].split()[0] for m in manifest["methods"].values()] == [target, target]
    assert TARGETS[target][3] in (out / "model.pte").read_bytes()  # the delegate's id, in the program once delegated


def test_the_runner_links_the_delegate_but_neither_python_nor_torch(target, exported):
    needed = subprocess.run(["readelf", "-d", str(exported[0] / "npumoe-run")], capture_output=True, text=True,
                            check=True).stdout
    libraries = [line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line]
    assert {"libexecutorch.so", TARGETS[target][2]} <= set(libraries)
    assert not [lib for lib in libraries if lib.startswith(("libpython", "libtorch", "libc10"))]


def test_a_disaggregated_program_decodes_on_the_cpu_with_the_same_tokens(demo, target, plan, ids, device_tokens,
                                                                        tmp_path):
    """Without --decode-on the cost model places decode: the demo's step is all launches, so prefill is delegated
    to the device and decode lowered for the CPU (XNNPACK), in one program."""
    if target != "htp":
        pytest.skip("checked on htp, the seed's disaggregated target: one more export per target costs CI time")
    manifest = export(demo, target, tmp_path / "split", plan=plan, max_context=CONTEXT)
    assert [manifest["methods"][m]["device"].split()[0] for m in ("prefill", "decode")] == ["htp", "cpu"]
    placement = manifest["decode_placement"]
    assert placement["chosen_by"] == "cost model" and placement["cpu_seconds"] < placement["npu_seconds"]
    assert generated(tmp_path / "split", ids)["tokens"] == device_tokens
