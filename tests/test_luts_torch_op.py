"""npumoe::lut_linear against the numpy spec, and torch.export of a module that uses it."""

import dataclasses
import threading

import numpy as np
import pytest
import torch

from npumoe.core.base.errors import InputError
from npumoe.luts import spec, torch_op


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 40)
    return linear, torch_op.LutLinear.from_linear(linear, bits=4, group=64)


def reference(linear, bits=4, group=64):
    return spec.quantize_pack(linear.weight.detach().numpy(), bits, group)


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 33, 64, 600])  # at 4 bits: GEMV, int8 GEMM, GEMM (ISA-dependent)
def test_op_matches_the_spec(layer, rows):
    linear, module = layer
    packed = reference(linear)
    x = torch.randn(rows, 256)
    y = module(x)
    bias = linear.bias.detach().numpy()
    if torch_op.uses_int8(rows, 4) and torch_op._kernels().isa in ("avx512", "avx2"):  # builds with byte dots
        expected = np.stack([spec.int8_gemv(packed, row) for row in x.numpy()]) + bias
        assert np.allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    elif not torch_op.uses_gemm(rows, 4):
        expected = np.stack([spec.lut_gemv(packed, row) for row in x.numpy()]) + bias
        assert np.allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    else:
        expected = x.numpy().astype(np.float64) @ spec.dequantize(packed).T.astype(np.float64) + bias
        assert np.allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_leading_dims_dtype_and_symmetric_weights(layer):
    linear, _ = layer
    module = torch_op.LutLinear(spec.quantize_pack(linear.weight.detach().numpy(), 2, 32, symmetric=True))
    assert module.zeros is None and module.bias is None
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    y = module(x)
    assert y.shape == (3, 5, 40) and y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), module(x.float()).to(torch.bfloat16).float())


def test_export_keeps_the_custom_op(layer):
    _, module = layer
    x = torch.randn(6, 256)
    exported = torch.export.export(module, (x,))
    assert any(node.target is torch.ops.npumoe.lut_linear.default for node in exported.graph.nodes)
    assert torch.equal(exported.module()(x), module(x))
    torch.library.opcheck(torch.ops.npumoe.lut_linear, (x, module.tiles, module.scales, module.zeros, 4, 64, 40))


def test_module_follows_buffers_that_are_replaced(layer):
    """The kernels' view of the buffers is kept between calls, so it must notice new buffers."""
    linear, _ = layer
    module = torch_op.LutLinear.from_linear(linear, bits=4, group=64)
    other = torch_op.LutLinear.from_linear(torch.nn.Linear(256, 40), bits=4, group=64)
    x = torch.randn(1, 256)
    before = module(x)
    module.tiles, module.scales, module.zeros, module.bias = other.tiles, other.scales, other.zeros, other.bias
    assert torch.equal(module(x), other(x)) and not torch.equal(module(x), before)
    assert torch.equal(module.dequantized(), other.dequantized())


def test_wrong_input_width_is_refused(layer):
    _, module = layer
    with pytest.raises(InputError, match="do not fit a weight with 256 inputs"):
        module(torch.randn(2, 128))


BF16_DOT = torch_op._kernels().calls.bf16_dot if hasattr(torch_op._kernels().calls, "bf16_dot") else False


def bf16_truth(x, w, b=None):
    """What the CPU executor's linear on a bf16 matrix computes: the dot-product GEMM's product of bf16-rounded
    activations (spec.bf16_dot_gemm) where it takes the rows, else fp32 math on the widened weights."""
    if torch_op._bf16_path(x, w) == "dot":
        y = torch.from_numpy(spec.bf16_dot_gemm(w.view(torch.int16).numpy(), x.reshape(-1, x.shape[-1]).numpy()))
        y = y.reshape(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b
    return torch.nn.functional.linear(x, w.float(), b)


@pytest.fixture
def without_bf16_dot(monkeypatch):
    """The exact GEMV and torch's widened GEMM only, as on a CPU without AVX-512 BF16."""
    monkeypatch.setattr(torch_op, "BF16_DOT_FROM", 1 << 30)


@pytest.mark.parametrize("dot", [True, False], ids=["with-dot", "without-dot"])
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 16, 17, 129])  # every path on every ISA
def test_bf16_linear_takes_the_path_its_rows_call_for(rows, dot, monkeypatch):
    """The CPU executor's linear on a bf16 matrix: the exact GEMV for few rows; from BF16_DOT_FROM rows the
    dot-product GEMM on bf16-rounded activations where the CPU has it (spec.bf16_dot_gemm is the truth), else
    the widening GEMM from its rows on SIMD builds, the GEMV up to its row limit and torch's fp32 GEMM on the
    widened weights past both (torch's F.linear on w.float() is the truth of these three)."""
    from npumoe.core.compiler.interpreter import OP_IMPLS
    from npumoe.luts.torch_op import BF16_GEMV_MAX_ROWS, _kernels, bf16_linear

    if not dot:
        monkeypatch.setattr(torch_op, "BF16_DOT_FROM", 1 << 30)
    torch.manual_seed(rows)
    w, x, b = torch.randn(70, 96).to(torch.bfloat16), torch.randn(rows, 96), torch.randn(70)
    path = torch_op._bf16_path(x, w)
    isa = _kernels().isa
    assert path == ("dot" if dot and BF16_DOT and rows >= torch_op.BF16_DOT_FROM
                    else "gemm" if rows >= (_kernels().crossovers.bf16_gemm or 1 << 30)
                    else "gemv" if rows <= BF16_GEMV_MAX_ROWS[isa] else None)
    torch.testing.assert_close(OP_IMPLS["linear"](x, w, b), bf16_truth(x, w, b), rtol=0, atol=1e-4)
    assert (bf16_linear(x, w) is None) == (path is None)
    if path == "dot":  # the activations' rounding shows: further from the widened fp32 product than the GEMV
        assert (OP_IMPLS["linear"](x, w, b) - torch.nn.functional.linear(x, w.float(), b)).abs().max() > 1e-3
    assert bf16_linear(x, w.T.contiguous().T) is None  # strided: torch's path


@pytest.fixture(params=["amx", "avx512_bf16"])
def dot_engine(request):
    """Each engine of the dot-product GEMM this CPU has: AMX tiles (the default where present) and AVX-512 BF16."""
    calls = torch_op._kernels().calls
    if request.param == "amx" and not calls.bf16_amx_set(True):
        pytest.skip("this CPU has no AMX tiles (AVX-512 BF16 alone is tested)")
    calls.bf16_amx_set(request.param == "amx")
    yield request.param
    calls.bf16_amx_set(True)


@pytest.mark.skipif(not BF16_DOT, reason="the bf16 dot-product GEMM runs on the AVX-512 build of a CPU with AVX-512 "
                    "BF16, which this run lacks or does not use (NPUMOE_LUT_KERNEL), and no emulator here runs it")
@pytest.mark.parametrize("rows, outputs, inputs", [(2, 5, 32), (3, 12, 64), (8, 6, 32), (9, 7, 64), (65, 13, 96),
                                                   (17, 70, 96), (200, 70, 2048), (33, 96, 64)])
def test_bf16_dot_gemm_matches_the_spec(rows, outputs, inputs, dot_engine):
    """Row tails (each short pass of 1-3 activation rows; weight rows not a multiple of 6, nor of AMX's 32 or 16;
    activation rows not a multiple of 16) and more than one 64-row activation tile; to fp32 summation order against
    the float64 sum of the exact products."""
    kernels = torch_op._kernels()
    rng = np.random.default_rng(rows)
    w = torch.from_numpy(rng.standard_normal((outputs, inputs), np.float32)).bfloat16().view(torch.int16).numpy()
    x = rng.standard_normal((rows, inputs)).astype(np.float32)
    expected = spec.bf16_dot_gemm(w, x)
    np.testing.assert_allclose(kernels.bf16_dot_gemm(w, x), expected, rtol=0, atol=2e-6 * np.sqrt(inputs) * 8)
    with pytest.raises(InputError, match="multiples of 32"):
        kernels.bf16_dot_gemm(w[:, :31].copy(), x[:, :31].copy())


@pytest.mark.skipif(not BF16_DOT, reason="the bf16 dot-product GEMM runs on the AVX-512 build of a CPU with AVX-512 "
                    "BF16, which this run lacks or does not use (NPUMOE_LUT_KERNEL), and no emulator here runs it")
def test_bf16_dot_gemm_tasks_sharing_their_rows(dot_engine):
    """Gate and up read the same activations, which the kernel rounds once for both: each task, shared rows or
    not, still gets its own product (spec.bf16_dot_gemm), NaN and infinity rounded as torch rounds them."""
    rng = np.random.default_rng(3)
    ws = [torch.from_numpy(rng.standard_normal((n, 64), np.float32)).bfloat16().view(torch.int16).numpy()
          for n in (7, 64, 37)]
    shared, own = rng.standard_normal((2, 5, 64)).astype(np.float32)
    shared[1, 3], shared[2, 5] = np.nan, np.inf
    xs = [shared, shared, own]
    ys = [np.empty((5, w.shape[0]), np.float32) for w in ws]
    torch_op._kernels().calls.bf16_dot_gemm_many_at(
        [(w.ctypes.data, x.ctypes.data, y.ctypes.data, 5, *w.shape) for w, x, y in zip(ws, xs, ys)], 2)
    for w, x, y in zip(ws, xs, ys):
        np.testing.assert_allclose(y, spec.bf16_dot_gemm(w, x), rtol=1e-6, atol=1e-5)


def test_bf16_round_is_torchs_rounding():
    x = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    x[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    torch.testing.assert_close(torch.from_numpy(spec.bf16_round(x.numpy())), x.bfloat16().float(), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("rows, outputs, inputs", [(5, 70, 96), (16, 1024, 256), (3, 37, 100), (128, 64, 2048)])
def test_bf16_rows_computed_together_equal_each_row_alone(rows, outputs, inputs, without_bf16_dot, monkeypatch):
    """A prefill's rows share each widened weight in the GEMV (AVX-512: two activation rows at a time); every
    output still sums the same products in the same order as a one-row call: bit for bit."""
    from npumoe.luts.torch_op import bf16_linear

    run = torch_op._kernels()
    monkeypatch.setattr(run, "crossovers", dataclasses.replace(run.crossovers, bf16_gemm=None))  # the GEMV alone

    torch.manual_seed(rows)
    w, x = torch.randn(outputs, inputs).to(torch.bfloat16), torch.randn(rows, inputs)
    together = bf16_linear(x, w)
    assert together is not None or rows > 16  # (AVX2 and NEON take up to 16 rows)
    if together is not None:
        assert torch.equal(together, torch.cat([bf16_linear(x[i:i + 1], w) for i in range(rows)]))


@pytest.mark.parametrize("dot", [True, False], ids=["with-dot", "without-dot"])
def test_bf16_linears_batched_in_one_call_equal_each_alone(dot, monkeypatch):
    """Several (x, W) pairs of different shapes in one kernel call per path, two of them sharing their x (as an
    expert's gate and up do), give what each call alone gives, bit for bit, and their path's truth within float
    rounding; a pair the kernels cannot take comes back as None, the others computed."""
    from npumoe.luts.torch_op import BF16_GEMV_MAX_ROWS, _kernels, bf16_linear, bf16_linear_many

    if not dot:
        monkeypatch.setattr(torch_op, "BF16_DOT_FROM", 1 << 30)
    torch.manual_seed(3)
    shapes = [(1, 70, 96), (3, 1024, 64), (2, 5, 208), (16, 40, 32), (9, 30, 64), (20, 12, 32), (50, 20, 48)]  # m, n, k
    xs = [torch.randn(m, k) for m, _, k in shapes]
    ws = [torch.randn(n, k).to(torch.bfloat16) for _, n, k in shapes]
    xs.insert(4, xs[3]), ws.insert(4, torch.randn(24, 32).to(torch.bfloat16))  # 16 rows: the GEMM's, on SIMD builds
    batched = bf16_linear_many(xs, ws)
    for x, w, y in zip(xs, ws, batched):
        assert (y is None) == (torch_op._bf16_path(x, w) is None)  # (50 rows: no GEMV or GEMM on portable builds)
        if y is not None:
            assert torch.equal(y, bf16_linear(x, w))
            torch.testing.assert_close(y, bf16_truth(x, w), rtol=0, atol=1e-4)
    *computed, fp32 = bf16_linear_many(xs, [*ws[:-1], ws[-1].float()])
    assert fp32 is None and all(y is b is None or torch.equal(y, b) for y, b in zip(computed, batched))
    too_many = torch.randn(BF16_GEMV_MAX_ROWS[_kernels().isa] + 1, 31)  # more rows than the GEMV takes, K odd
    odd_w = torch.randn(5, 31).to(torch.bfloat16)
    assert bf16_linear_many([*xs[:-1], too_many], [*ws[:-1], odd_w])[-1] is None
    assert bf16_linear_many([too_many], [odd_w]) is None


def test_bf16_gemms_past_the_transposition_budget_run_in_groups():
    """Tasks whose transposed inputs pass the widening GEMM's budget (16M floats; two distinct 1024 x 8192 inputs
    here) run a group at a time, and still give what each call alone gives, bit for bit (SIMD builds)."""
    calls = torch_op._kernels().calls
    if not hasattr(calls, "bf16_gemm_many_at") or torch_op._kernels().crossovers.bf16_gemm is None:
        pytest.skip("the widening bf16 GEMM runs on SIMD builds, natively")
    torch.manual_seed(5)
    xs = [torch.randn(1024, 8192), torch.randn(1024, 8192), torch.randn(40, 8192)]
    xs.insert(1, xs[0])  # a second matrix on the first x: in its group, sharing the transposed copy
    ws = [torch.randn(n, 8192).to(torch.bfloat16) for n in (7, 13, 6, 9)]
    ys = [torch.empty(x.shape[0], w.shape[0]) for x, w in zip(xs, ws)]
    calls.bf16_gemm_many_at([(w.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], *w.shape)
                             for x, w, y in zip(xs, ws, ys)], 2)
    for x, w, y in zip(xs, ws, ys):
        alone = torch.empty_like(y)
        calls.bf16_gemm_at(w.data_ptr(), x.data_ptr(), x.shape[0], *w.shape, alone.data_ptr(), 2)
        assert torch.equal(y, alone)


def test_packed_linears_batched_in_one_call_equal_each_alone():
    """Several one-row packed linears (other shapes, bits, symmetric or not, with a bias) in one kernel call
    give what each call alone gives, bit for bit, and the spec's LUT-GEMV within float rounding; a prompt's rows go
    through the batched row calls, each linear they take bit for bit its own call's, and those they do not take (a
    bias, outputs off the 16-row blocks) back to the caller (None)."""
    from npumoe.luts.torch_op import LutLinear, lut_linear_many

    rng = np.random.default_rng(4)
    formats = [(70, 128, 4, 64, False), (1000, 64, 2, 32, True), (16, 256, 8, 128, False), (33, 96, 3, 32, False)]
    packs = [spec.quantize_pack(rng.standard_normal((n, k)).astype(np.float32), b, g, sym)
             for n, k, b, g, sym in formats]
    linears = [LutLinear(p, bias=torch.randn(p.meta.shape[0]) if i == 2 else None) for i, p in enumerate(packs)]
    xs = [torch.randn(1, k) for _, k, *_ in formats]
    batched = lut_linear_many(xs, linears)
    for x, lin, p, y in zip(xs, linears, packs, batched):
        assert torch.equal(y, lin(x))
        want = spec.lut_gemv(p, x[0].numpy()) + (0 if lin.bias is None else lin.bias.numpy())
        np.testing.assert_allclose(y[0].numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    prompt = [LutLinear(spec.quantize_pack(rng.standard_normal((n, k)).astype(np.float32), b, 32))
              for n, k, b in [(64, 128, 4), (32, 256, 2), (48, 96, 3), (64, 128, 4)]] + linears[:1]
    rows = [torch.randn(r, lin.in_features) for r, lin in zip((2, 9, 12, 1, 5), prompt)]
    rows[3] = rows[0][:1]  # (one row among a prompt's: the GEMV's single-row path)
    batched = lut_linear_many(rows, prompt)
    run = torch_op._kernels()
    int8 = run.calls.gemm_i8_many_at([], 1)  # (a build without the int8 GEMM leaves its rows to the caller)
    for x, lin, y in zip(rows, prompt, batched):
        path = torch_op._rows_path(run, x, lin)  # None for 70 outputs: not whole 16-row blocks
        assert (y is not None) == (path == "gemv" or path == "int8" and int8), (x.shape, lin)
        assert y is None or torch.equal(y, lin(x))
    assert batched[-1] is None and batched[1] is not None


def test_a_prompts_attention_splits_its_queries_across_the_held_threads():
    """Inside torch_on_one_thread a prompt's attention runs its query positions in parts, one a held thread (the
    first on the caller), with the same result as in one piece; a decode query, a short prompt and attention outside
    the block run whole on the caller."""
    from npumoe.core.compiler.interpreter import OP_IMPLS, QUERIES_A_THREAD, _queries_on_held_threads

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        seen = []

        def attend(q, mask):  # records its thread, query count, mask rows and first query value
            seen.append((threading.get_ident(), q.shape[-2], mask.shape[0], q[0, 0, 0]))
            return q[..., :1] + mask
        attention = _queries_on_held_threads(mask_at=0)(attend)
        prompt, decode = torch.randn(4, 40, 16), torch.randn(4, 1, 16)
        with torch_op.torch_on_one_thread():
            y = attention(prompt, torch.randn(40, 1))
            split, seen[:] = list(seen), []
            attention(decode, torch.randn(1, 1))
            attention(prompt[:, :2 * QUERIES_A_THREAD - 1], torch.randn(2 * QUERIES_A_THREAD - 1, 1))
            whole = list(seen)
        assert y.shape == (4, 40, 1) and sorted(n for _, n, _, _ in split) == [13, 13, 14]
        assert all(n == m for _, n, m, _ in split)
        caller = threading.get_ident()  # the first part on the caller, the others on helper threads
        assert [t == caller for t, _, _, first in split] == [bool(first == prompt[0, 0, 0]) for *_, first in split]
        assert [n for _, n, _, _ in whole] == [1, 2 * QUERIES_A_THREAD - 1] and {t for t, *_ in whole} == {caller}
        seen.clear(), attention(prompt, torch.randn(40, 1))  # outside the block: whole
        assert [n for _, n, _, _ in seen] == [40]

        q, k, v = torch.randn(8, 40, 16), torch.randn(2, 56, 16), torch.randn(2, 56, 16)
        mask = torch.triu(torch.full((40, 56), -torch.inf), diagonal=17)
        fused = OP_IMPLS["sdpa"]
        with torch_op.torch_on_one_thread():
            together = fused(q, k, v, mask, scale=0.25)
        torch.testing.assert_close(together, fused.__wrapped__(q, k, v, mask, scale=0.25), rtol=0, atol=1e-6)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 16), (1, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_is_the_norm(shape, dtype):
    """The prompt's norm in C against torch's ops in float64 (the weight as stored, bf16 or fp32)."""
    x, w = torch.randn(*shape) * 3, torch.randn(shape[-1]).to(dtype)
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(torch_op.rms_norm_rows(x, w, 1e-6), expected.float(), rtol=1e-6, atol=1e-6)
    assert torch_op.rms_norm_rows(x.double(), w, 1e-6) is None  # (not fp32: torch's ops take it)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_rows_is_the_rotation(interleaved):
    """Each head of each row rotated by its row's angles: pairs (i, i + d/2), or (2i, 2i + 1), against the complex
    product in float64; the input left as it was."""
    rows, heads, d = 5, 3, 8
    x, angles = torch.randn(rows, heads, d), torch.rand(rows, d // 2) * 6
    freqs = torch.cat((angles, angles), -1)
    cos, sin = freqs.cos(), freqs.sin()
    before = x.clone()
    got = torch_op.rope_rows(x, cos, sin, interleaved)
    pairs = (x.double().reshape(rows, heads, d // 2, 2) if interleaved
             else x.double().reshape(rows, heads, 2, d // 2).transpose(-1, -2))
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.polar(
        torch.ones_like(angles.double()), angles.double())[:, None])
    expected = turned.reshape(rows, heads, d) if interleaved else turned.transpose(-1, -2).reshape(rows, heads, d)
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before)
    assert torch_op.rope_rows(x[None], cos, sin, interleaved) is None  # (another layout: torch's ops take it)
