"""The mlx target (the Apple GPU through MLX; MLX's CPU backend here): luts codes as MLX's quantised matrices hold
exactly the values every other target holds, a quantised checkpoint runs on them, and its bad input is one line.
Its numbers on the demo model are the conformance suite's (tests/test_conformance.py --backend mlx)."""

import json
import subprocess
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the mlx target needs MLX (pip install 'npumoe[mlx]')",
                         exc_type=ImportError)

from cli_check import cli_error  # noqa: E402

import npumoe  # noqa: E402
from npumoe.backends.mlx.weights import quantized_from_packed  # noqa: E402
from npumoe.core.compiler.artifacts import build, load_executors  # noqa: E402
from npumoe.core.compiler.interpreter import TorchGraphExecutor  # noqa: E402
from npumoe.core.compiler.program import build_program  # noqa: E402
from npumoe.core.ir.backend import get_backend  # noqa: E402
from npumoe.core.planning.plan import Plan  # noqa: E402
from npumoe.core.tools.conformance import random_feed  # noqa: E402
from npumoe.luts import mappings, spec  # noqa: E402
from npumoe.models.checkpoints.lut import npu_codes  # noqa: E402
from npumoe.models.checkpoints.quantize import quantize_checkpoint  # noqa: E402

ARCH = dict(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("bits", spec.BITS)
def test_luts_codes_are_mlx_matrices_of_the_same_values(bits):
    rng = np.random.default_rng(bits)
    for group in spec.GROUPS:
        for symmetric in (False, True) if bits > 1 else (False,):
            packed = spec.quantize_pack(rng.standard_normal((24, 256)).astype(np.float32), bits, group, symmetric)
            matrix = quantized_from_packed(packed)
            got = mx.dequantize(matrix.codes, matrix.scales, matrix.biases, group_size=group, bits=bits)
            want = spec.dequantize(packed)
            assert np.array_equal(np.array(got), want), (bits, group, symmetric)  # bit for bit
            x = rng.standard_normal((3, 256)).astype(np.float32)
            product = np.array(matrix.matmul(mx.array(x)))
            np.testing.assert_allclose(product, x @ want.T, rtol=1e-5, atol=1e-5)  # fp32 summation order only


def planned_build(model, out, **options):
    ids = np.random.default_rng(1).integers(0, model.spec.vocab_size, 64).tolist()
    profile = npumoe.calibrate(model, [ids], chunk=8)
    build(model, npumoe.plan(model, profile, target="mlx", residency="npu"), "mlx", out, max_context=64,
          progress=False, **options)
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from hf_compare import build_checkpoint, transformers

    source, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("q3")
    build_checkpoint(transformers.Qwen3MoeConfig(**ARCH), source)
    quantize_checkpoint(source, out, bits=3, group=32, head_bits=3)
    return out


def test_a_quantised_checkpoint_runs_its_own_codes(quantized, tmp_path):
    """Every graph built from a checkpoint of 3-bit luts codes computes what the interpreter computes over the same
    dequantised values (the engine's CPU experts would run them on the LUT kernels, whose int8 tables are not)."""
    model = npumoe.load(quantized)
    manifest = planned_build(model, tmp_path / "mlx")
    held = {name: tuple(f) for g in manifest["graphs"].values() for name, f in g["quantized"].items()}
    assert held == {name: (3, 32) for name in model.weights.packed}  # every packed matrix, as MLX quantised
    groups = [g for g in manifest["graphs"].values() if g["kind"] == "experts"]
    assert {g["experts"] for g in groups if len(g["quantized"]) > 3} == {"gather_qmm"}  # a group: one product each
    program = build_program(model.spec, chunk=manifest["chunk"], max_context=64, plan=Plan.from_json(manifest["plan"]))
    graphs = [program.graphs[name] for name in manifest["graphs"]]
    executors = load_executors(get_backend("mlx"), tmp_path / "mlx", graphs, model.weights, model)
    dequantised = dict(model.weights)
    for graph in graphs:
        feed = random_feed(graph)
        want = TorchGraphExecutor(graph, dequantised)(feed)
        for name, got in executors[graph.name](feed).items():
            np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-5, err_msg=f"{graph.name}: {name}")


def test_precision_int4_holds_the_codes_the_ane_and_htp_hold(tmp_path):
    model = npumoe.load()
    manifest = planned_build(model, tmp_path / "mlx", precision="int4")
    assert manifest["backend"]["precision"] == "int4"
    for name, entry in manifest["graphs"].items():
        arrays = mx.load(str(tmp_path / "mlx" / entry["weights"]))
        assert bool(entry["quantized"]) == (entry["kind"] == "experts"), name  # the routed experts only
        for matrix, (bits, group) in entry["quantized"].items():
            want = spec.dequantize(npu_codes(model.weights, matrix, mappings.NPU_INT4))
            got = mx.dequantize(arrays[matrix], arrays[f"{matrix}.scales"], arrays[f"{matrix}.biases"],
                                group_size=group, bits=bits)
            assert (bits, group) == (4, 32) and np.array_equal(np.array(got), want)


def test_bf16_activations_run_as_mlx_lm_runs_a_bf16_model(tmp_path):
    """--activations bfloat16: the graphs compute in bf16 (mlx-lm's way with a bf16 model), so the logits agree with
    the fp32 reference to bf16 rounding; MLX's CPU backend gathers only fp32, so there each expert runs alone."""
    model = npumoe.load()
    manifest = planned_build(model, tmp_path / "mlx", activations="bfloat16", device="cpu")
    assert {g["experts"] for g in manifest["graphs"].values() if g["kind"] == "experts"} == {"per expert"}
    ids = np.asarray(model.tokenizer.encode("def fibonacci(n):\n    a, b = 0, 1\n"))
    ran = npumoe.Engine(model, backend="mlx", artifacts=tmp_path / "mlx")
    want = npumoe.Engine(model, chunk=ran.program.chunk, max_context=ran.cache.capacity).forward(ids)
    got = ran.forward(ids)
    cosines = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cosines.min() > 0.999 and np.abs(got - want).max() > 1e-5  # close, and not fp32's own


def test_bad_options_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert "--precision 'int3' is not one of stored, int4, int8" in cli_error(
        capsys, "build", "--targets", "mlx", "--precision", "int3", "--out", out)
    assert "--activations 'fp8' is not one of float32, bfloat16, float16" in cli_error(
        capsys, "build", "--targets", "mlx", "--activations", "fp8", "--out", out)
    if not mx.is_available(mx.gpu):
        assert "has no GPU" in cli_error(capsys, "build", "--targets", "mlx", "--device", "gpu", "--out", out)


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="this MLX has a GPU to run a GPU build on")
def test_a_gpu_build_is_refused_in_one_line_where_mlx_has_no_gpu(tmp_path, capsys):
    """Artifacts built on a Mac for its GPU (their manifest says so), run where this MLX has none: exit 2, one line
    naming the fix, before any graph runs."""
    manifest = planned_build(npumoe.load(), tmp_path / "mlx")
    for entry in manifest["graphs"].values():
        entry["device"] = "gpu"
    (tmp_path / "mlx" / "manifest.json").write_text(json.dumps(manifest))
    assert "has no GPU" in cli_error(capsys, "generate", "--target", "mlx", "--artifacts", str(tmp_path / "mlx"),
                                     "-n", "2")


def test_without_mlx_the_record_still_imports_and_using_it_names_the_extra():
    script = ("import sys; sys.modules['mlx'] = None\n"  # as if MLX were not installed
              "from npumoe.core.base.errors import BackendUnavailableError\n"
              "from npumoe.core.ir.backend import get_backend, plugin\n"
              "assert plugin('mlx').caps.name == 'mlx'\n"
              "try:\n    get_backend('mlx')\nexcept BackendUnavailableError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "pip install 'npumoe[mlx]'" in done.stdout and len(done.stdout.strip().splitlines()) == 1


def test_compare_estimates_the_apple_gpus_from_their_records(tmp_path, capsys):
    from npu_check import write_texts

    from npumoe.cli import main

    calibration, heldout = write_texts(tmp_path, heldout_chars=400)
    main(["build", "--targets", "mlx", "--text", str(calibration), "--heldout", str(heldout), "--chunk", "16",
          "--max-context", "128", "--residency", "npu", "--out", str(tmp_path / "out")])
    capsys.readouterr()
    main(["compare", str(tmp_path / "out"), "--json"])
    report = json.loads(capsys.readouterr().out)
    estimated = report["targets"]["mlx"]["estimated"]
    assert set(estimated) == {"Apple M2 GPU", "Apple M4 GPU", "Apple M4 Max GPU"}
    decode = [estimated[chip]["decode_tok_s"] for chip in ("Apple M2 GPU", "Apple M4 GPU", "Apple M4 Max GPU")]
    assert 0 < decode[0] < decode[1] < decode[2]  # decode reads weights: it follows 100 < 120 < 546 GB/s
    validation = json.loads((tmp_path / "out" / "manifest.json").read_text())["targets"]["mlx"]["validation"]
    assert validation["cosine"] > 0.9999 and validation["greedy_match"] >= 8
