"""npumoe export of a quantised (int4, int2) checkpoint for the cpu target: the routed experts run as one ExecuTorch
custom op, ``npumoe::lut_swiglu_experts``, and every other packed linear (attention, dense, the LM head) as
``npumoe::lut_linear_rows``, over the packed tiles held as program constants, the same LUT kernels the engine runs;
the native runner (a process without Python or torch) gives the engine's greedy tokens."""

import json
from collections import Counter

import numpy as np
import pytest
import torch
from native_run import npumoe_run, skip_without_compiler

import npumoe
from npumoe.core.base.errors import InputError
from npumoe.luts import experts_op, layout, linear_op, spec, torch_op
from npumoe.models.checkpoints.quantize import quantize_checkpoint
from npumoe.models.demo import corpus

pytest.importorskip("executorch.exir", reason="npumoe export needs the executorch wheel")

from npumoe.core.tools.export import export  # noqa: E402

CHUNK, CONTEXT, NEW = 32, 160, 32
# A 1-token prompt and its decode steps: 3e-7 relative on the demo (every linear packed) but for one step of 32 at
# 2.9e-4 (not yet explained). It was 3.2e-3 while the program's packed linears chose their path for a short prompt's
# real rows (the LUT-GEMV) and the engine for the padded chunk it runs (the int8 GEMM): the prompt's keys and values
# differed, and every decode step reads them (issue 33).
DECODE_TOLERANCE = 5e-4
# A prompt's rows go through the LUT-GEMV (8-bit activation tables) in the program, through the dequantising or int8
# GEMM in the engine: measured 1.3e-3 relative on the demo at 4 bits; bounded at the fp16 conformance level.
PROMPT_TOLERANCE = 5e-3


def swiglu_reference(x, ids, weights, gate, up, down):
    """numpy's y[r] = Σ_j w[r, j] · down(silu(gate x) ⊙ up x), each a list of the experts' matrices."""
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
    want = swiglu_reference(x, ids, weights, *([spec.dequantize(p) for p in matrices] for matrices in packed))
    assert np.abs(y - want).max() <= 2e-2 * np.abs(want).max()  # the 8-bit activation tables' error
    with pytest.raises(IndexError):
        experts_op.lut_swiglu_experts(torch.from_numpy(x), torch.from_numpy(ids + 3), torch.from_numpy(weights),
                                      stacks, bits, 32, inter)


def test_the_fp32_op_is_the_weighted_sum_of_its_rows_experts():
    rng = np.random.default_rng(0)
    experts, hidden, inter = 5, 64, 96
    gate, up, down = (rng.standard_normal((experts, n, k)).astype(np.float32) / 8
                      for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)))
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    ids, weights = np.array([[0, 4], [2, 2], [3, 1]]), rng.random((3, 2)).astype(np.float32)
    stacks = [torch.from_numpy(m) for m in (gate, up, down)]
    y = experts_op.swiglu_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(weights),
                                  *stacks).numpy()
    want = swiglu_reference(x, ids, weights, gate, up, down)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()  # fp32 sums in another order
    with pytest.raises(IndexError):
        experts_op.swiglu_experts(torch.from_numpy(x), torch.from_numpy(ids + 3), torch.from_numpy(weights), *stacks)


def test_the_fp32_linear_op_is_the_product():
    rng = np.random.default_rng(1)
    w, x = rng.standard_normal((300, 96)).astype(np.float32), rng.standard_normal((3, 96)).astype(np.float32)
    y = linear_op.f32_linear_rows(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("bits, symmetric", [(4, False), (2, True), (6, False)])
def test_the_linear_op_is_the_engines_product_for_decode_and_prompt_rows(bits, symmetric):
    rng = np.random.default_rng(bits)
    packed = spec.quantize_pack(rng.standard_normal((48, 128)).astype(np.float32) / 8, bits, 32, symmetric)
    engine = torch_op.LutLinear(packed)
    zeros = torch.zeros(0, dtype=torch.uint8) if engine.zeros is None else engine.zeros
    dense = spec.dequantize(packed)
    for rows in (1, 3, 75):  # the LUT-GEMV, and a prompt's paths (the int8 or dequantising GEMM where they win)
        x = torch.from_numpy(rng.standard_normal((rows, 128)).astype(np.float32))
        y = linear_op.lut_linear_rows(x, None, engine.tiles, engine.scales, zeros, bits, 32)
        assert torch.equal(y, engine(x))  # the engine's own path for as many rows, bit for bit
        want = x.numpy() @ dense.T
        assert np.abs(y.numpy() - want).max() <= 2e-2 * np.abs(want).max()  # 8-bit activations' error at most
    padded = torch.cat((x[:2], torch.ones(30, 128)))  # a chunk of 2 real rows: the engine runs the chunk whole
    y = linear_op.lut_linear_rows(padded, torch.tensor([2]), engine.tiles, engine.scales, zeros, bits, 32)
    assert torch.equal(y[:2], engine(padded)[:2]) and not y[2:].any()


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    out = tmp_path_factory.mktemp("q4") / "demo-q4"
    quantize_checkpoint(npumoe.load(dtype="float32").path, out, bits=4, group=64, progress=False)  # every linear
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


def program_constants(pte: bytes) -> tuple[Counter, Counter]:
    """(byte sizes of the program's float constants: its float tensors and every delegate's named data, bytes of its
    uint8 constants), each a multiset, read from the serialised program."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.exir.scalar_type import ScalarType

    width = {ScalarType.FLOAT: 4, ScalarType.HALF: 2, ScalarType.BFLOAT16: 2, ScalarType.BYTE: 1}
    pte_file = deserialize_pte_binary(pte)
    floats, uint8 = Counter(), Counter()
    seen = set()
    for plan in pte_file.program.execution_plan:
        for value in plan.values:
            tensor = value.val
            if getattr(tensor, "data_buffer_idx", 0) <= 0 or tensor.data_buffer_idx in seen:
                continue  # not a constant, or one another method shares
            seen.add(tensor.data_buffer_idx)
            nbytes = int(np.prod(tensor.sizes)) * width.get(tensor.scalar_type, 0)
            (uint8 if tensor.scalar_type == ScalarType.BYTE else floats)[nbytes] += 1
    named = pte_file.named_data
    for buffer in [] if named is None else named.buffers:
        floats[len(buffer)] += 1
    return floats, uint8


def test_the_program_holds_packed_linears_not_float_copies(quantised, exported):
    floats, uint8 = program_constants((exported / "model.pte").read_bytes())
    weights = quantised.weights
    plain = Counter(weights[n].numel() for n in weights if n not in weights.packed)
    for name, linear in weights.packed.items():
        n, k = linear.out_features, linear.in_features
        if ".moe.experts." not in name:  # (the routed experts' tiles are stacked into one constant a layer)
            assert uint8[linear.tiles.numel()] > 0, name  # its tiles, as the program's own constant
        for width in (4, 2):  # no fp32 (or half) copy of it beyond what plain fp32 weights of as many bytes explain
            assert floats[width * n * k] <= 2 * plain[width * n * k // 4], (name, width)


def test_an_npu_target_refuses_a_quantised_checkpoint(quantised, tmp_path):
    with pytest.raises(InputError, match="target cpu"):
        export(quantised, "htp", tmp_path / "q4-htp")
