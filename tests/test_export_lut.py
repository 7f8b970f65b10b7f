"""npumoe export of a quantised (int4, int2) checkpoint for the cpu target: the routed experts run as one ExecuTorch
custom op, ``npumoe::lut_swiglu_experts``, over the packed tiles held as program constants, the same LUT kernels the
engine runs; the native runner (a process without Python or torch) gives the engine's greedy tokens."""

import json

import numpy as np
import pytest
import torch
from native_run import npumoe_run, skip_without_compiler

import npumoe
from npumoe.core.base.errors import InputError
from npumoe.luts import experts_op, layout, spec
from npumoe.models.checkpoints.quantize import quantize_checkpoint
from npumoe.models.demo import corpus

pytest.importorskip("executorch.exir", reason="npumoe export needs the executorch wheel")

from npumoe.core.tools.export import export  # noqa: E402

CHUNK, CONTEXT, NEW = 32, 160, 32
# The decode steps run the very kernels of the engine's fused decode (measured 8e-7 relative: attention's XNNPACK
# sums); the same bound as the fp32 program's.
DECODE_TOLERANCE = 1e-5
# A prompt's rows go through the LUT-GEMV (8-bit activation tables) in the program, through the dequantising or int8
# GEMM in the engine: measured 1.3e-3 relative on the demo at 4 bits; bounded at the fp16 conformance level.
PROMPT_TOLERANCE = 5e-3


def swiglu_reference(x, ids, weights, packed):
    """numpy's y[r] = Σ_j w[r, j] · down(silu(gate x) ⊙ up x) over the dequantised matrices."""
    gate, up, down = ([spec.dequantize(p) for p in matrices] for matrices in packed)
    y = np.zeros_like(x)
    for r in range(x.shape[0]):
        for e, w in zip(ids[r], weights[r]):
            g, u = gate[e] @ x[r], up[e] @ x[r]
            y[r] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return y


@pytest.mark.parametrize("bits, symmetric", [(4, False), (2, False), (4, True)])
def test_the_op_is_the_weighted_sum_of_its_rows_experts(bits, symmetric):
    rng = np.random.default_rng(bits)
    experts, hidden, inter = 5, 64, 96
    packed = [[spec.pack(*spec.quantize(rng.standard_normal((n, k)).astype(np.float32) / 8, bits, 32, symmetric),
                         bits, 32, symmetric) for _ in range(experts)] for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))]
    stacks = [experts_op.stack([layout.to_tiles(p) for p in matrices]) for matrices in packed]
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    ids, weights = np.array([[0, 4], [2, 2], [3, 1]]), rng.random((3, 2)).astype(np.float32)
    y = experts_op.lut_swiglu_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(weights), stacks,
                                      bits, 32, inter).numpy()
    want = swiglu_reference(x, ids, weights, packed)
    assert np.abs(y - want).max() <= 2e-2 * np.abs(want).max()  # the 8-bit activation tables' error
    with pytest.raises(IndexError):
        experts_op.lut_swiglu_experts(torch.from_numpy(x), torch.from_numpy(ids + 3), torch.from_numpy(weights),
                                      stacks, bits, 32, inter)


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    out = tmp_path_factory.mktemp("q4") / "demo-q4"
    quantize_checkpoint(npumoe.load(dtype="float32").path, out, bits=4, group=64, linears="experts", progress=False)
    return npumoe.load(out)


@pytest.fixture(scope="module")
def exported(quantised, tmp_path_factory):
    skip_without_compiler()
    out = tmp_path_factory.mktemp("export") / "q4-cpu"
    export(quantised, "cpu", out, chunk=CHUNK, max_context=CONTEXT)
    return out


def run(directory, ids, new):
    done = npumoe_run(directory, "--tokens", ",".join(map(str, ids)), "--max-new-tokens", str(new), "--json",
                      "--logits")
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


@pytest.mark.parametrize("length, tolerance", [(1, DECODE_TOLERANCE), (75, PROMPT_TOLERANCE)])
def test_the_runner_gives_the_engines_tokens_on_an_int4_checkpoint(quantised, exported, length, tolerance):
    ids = quantised.tokenizer.encode(corpus.heldout_texts(1)[0][:length])
    new, logits = npumoe.Engine(quantised, max_context=CONTEXT).generate(np.asarray(ids), max_new_tokens=NEW,
                                                                         return_logits=True)
    result = run(exported, ids, NEW)
    assert result["tokens"] == ids + new.tolist()
    assert np.abs(np.asarray(result["logits"]) - logits).max() <= tolerance * np.abs(logits).max()


def test_the_program_holds_the_packed_experts_not_fp32_copies(quantised, exported):
    manifest = json.loads((exported / "manifest.json").read_text())
    fp32_experts = sum(quantised.weights[n].numel() * 4 for n in quantised.weights.packed)
    plain = sum(quantised.weights[n].numel() * 4 for n in quantised.weights if n not in quantised.weights.packed)
    assert manifest["files"]["model.pte"] < plain + fp32_experts / 4  # int4 tiles, scales and zeros: ~1/7 of fp32


def test_an_npu_target_refuses_a_quantised_checkpoint(quantised, tmp_path):
    with pytest.raises(InputError, match="target cpu"):
        export(quantised, "htp", tmp_path / "q4-htp")
