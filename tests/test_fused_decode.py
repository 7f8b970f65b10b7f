"""A decode token's fused kernel calls (luts/csrc/decode.c: an attention block, routing, routed experts, a MoE layer, a
whole step) against the graph interpreter running the same graphs op by op (itself checked against transformers in
test_family_*), for every attention form the calls cover: q/k norms per head (Qwen3) and over all heads (OLMoE, with
a tied LM head), q/k/v biases with a shared expert (Qwen2-MoE), plain (Mixtral); fp32, bf16 and packed matrices."""

import functools

import numpy as np
import pytest
import torch
from hf_compare import build_checkpoint, transformers

import npumoe
from npumoe.core.compiler import interpreter
from npumoe.core.runtime import engine as engine_module
from npumoe.core.runtime import moe as moe_module
from npumoe.luts import decode as fused
from npumoe.luts import kernels, torch_op

SMALL = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=96)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, intermediate_size=40, moe_intermediate_size=24,
                                                     head_dim=16, num_experts=6, norm_topk_prob=True),
    "olmoe": lambda: transformers.OlmoeConfig(**SMALL, intermediate_size=24, num_experts=8, tie_word_embeddings=True),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, intermediate_size=40, moe_intermediate_size=24,
                                                     shared_expert_intermediate_size=32, num_experts=6),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, intermediate_size=24, num_local_experts=6),
}


def counted(cls, calls: dict, key: str, patch) -> None:
    """Count the calls of ``cls`` 's blocks in ``calls[key]``."""
    call = cls.__call__
    patch.setattr(cls, "__call__", lambda self, *a: calls.__setitem__(key, calls[key] + 1) or call(self, *a))


def decode(model, mode: str, monkeypatch, steps: int = 12):
    """Logits of ``steps`` greedy decode tokens after a 21-token prompt, the KV cache after them, and how many fused
    calls ran. ``mode``: "step" (every fused path), "blocks" (a fused call per block, no whole-step call),
    "interpreter" (the graphs' steps and route())."""
    calls = {"step": 0, "attention": 0, "moe": 0}
    with monkeypatch.context() as patch:
        counted(fused.DecodeStep, calls, "step", patch)
        counted(fused.AttentionBlock, calls, "attention", patch)
        counted(fused.MoEBlock, calls, "moe", patch)
        if mode != "step":
            patch.setattr(engine_module.Engine, "_decode_step", lambda self: None)
        if mode == "interpreter":
            patch.setattr(engine_module, "attention_block", lambda *args: None)
            patch.setattr(fused.MoEBlock, "of", lambda *args: None)
            patch.setattr(moe_module, "softmax_route", lambda *args: None)
            patch.setattr(interpreter.TorchGraphExecutor, "combine_many", staticmethod(lambda *args: None))
        engine = npumoe.Engine(model, chunk=8)
        engine.generate(np.arange(3, 24) % model.spec.vocab_size, max_new_tokens=1)
        tokens, logits = [7], []
        for _ in range(steps):
            logits.append(engine.decode(tokens[-1]))
            tokens.append(int(logits[-1].argmax()))
        cache = [t[:, :engine.cache.length].clone() for t in (*engine.cache.k, *engine.cache.v)]
    return np.stack(logits), cache, calls


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", ["step", "blocks"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_decode_equals_the_interpreter(family, mode, dtype, tmp_path, monkeypatch):
    """bf16 matrices (widened exactly in both paths) or fp32 ones: the same logits to float rounding, the same
    tokens, the same keys and values in the cache. A step goes through the whole-step call (embedding to logits)
    where every layer is an attention block and a MoE layer (a shared expert, as Qwen2-MoE's, keeps the per-layer
    path), else one call a block."""
    build_checkpoint(FAMILIES[family](), tmp_path)
    model = npumoe.load(tmp_path, dtype=dtype)
    fused, fused_cache, calls = decode(model, mode, monkeypatch)
    interpreted, cache, _ = decode(model, "interpreter", monkeypatch)
    whole = mode == "step" and family != "qwen2_moe"
    layers = 0 if whole else 12 * model.spec.num_layers
    assert calls == {"step": 12 * whole, "attention": layers, "moe": layers}  # (every layer a MoE layer here)
    np.testing.assert_allclose(fused, interpreted, rtol=0, atol=2e-5 * np.abs(interpreted).max())
    assert (fused.argmax(-1) == interpreted.argmax(-1)).all()
    for mine, theirs in zip(fused_cache, cache):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-5 * float(theirs.abs().max()))


@pytest.fixture(params=kernels.available())
def every_kernel_build(request, monkeypatch):
    """Each kernel build this CPU runs (AVX-512, AVX2, portable here; NEON on Arm) in turn, forgotten after."""
    monkeypatch.setenv("NPUMOE_LUT_KERNEL", request.param)
    torch_op._kernels.cache_clear()
    monkeypatch.setattr(torch_op, "_kernels", functools.cache(torch_op._kernels.__wrapped__))
    return request.param


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_whole_step_on_every_kernel_build(every_kernel_build, dtype, tmp_path, monkeypatch):
    """The whole-step call's fp32 and bf16 GEMVs, attention and routing, compiled for each build, against the
    interpreter (OLMoE's form: q/k norms over all heads, a tied LM head)."""
    build_checkpoint(FAMILIES["olmoe"](), tmp_path)
    model = npumoe.load(tmp_path, dtype=dtype)
    fused, _, calls = decode(model, "step", monkeypatch)
    interpreted, _, _ = decode(model, "interpreter", monkeypatch)
    assert calls == {"step": 12, "attention": 0, "moe": 0}
    np.testing.assert_allclose(fused, interpreted, rtol=0, atol=2e-5 * np.abs(interpreted).max())


def test_fused_decode_of_packed_matrices_stays_within_the_luts_rounding(every_kernel_build, tmp_path, monkeypatch):
    """Every linear packed at 4 bits and the LM head at 6 (npumoe quantize's defaults), on every kernel build this CPU
    runs: each GEMV is the interpreter's bit for bit, but a last-place difference in a norm can move one 8-bit table
    entry of the next GEMV's activation by a step, so the logits agree as closely as the interpreter agrees with
    itself on inputs moved by up to 1e-6 (a few such moves, since one may flip no entry at all)."""
    from npumoe.models.checkpoints.quantize import quantize_checkpoint

    widths = dict(SMALL, hidden_size=64)  # every matrix's inputs a multiple of the 32-input group
    config = transformers.Qwen3MoeConfig(**widths, intermediate_size=64, moe_intermediate_size=32, head_dim=16,
                                         num_experts=6, norm_topk_prob=True)
    build_checkpoint(config, tmp_path / "hf")
    quantize_checkpoint(tmp_path / "hf", tmp_path / "q", bits=4, group=32)
    model = npumoe.load(tmp_path / "q")
    assert model.weights.packed["lm_head.weight"].bits == 6
    fused, _, calls = decode(model, "step", monkeypatch)
    interpreted, _, _ = decode(model, "interpreter", monkeypatch)
    assert calls == {"step": 12, "attention": 0, "moe": 0}
    sensitivity = 0.0
    embed = engine_module.Engine._embed
    for move in (1e-7, -1e-7, 1e-6, -1e-6):
        with monkeypatch.context() as patch:
            patch.setattr(engine_module.Engine, "_embed", lambda self, ids, valid: embed(self, ids, valid) * (1 + move))
            nudged, _, _ = decode(model, "interpreter", monkeypatch)
        sensitivity = max(sensitivity, np.abs(nudged - interpreted).max())
    scale = np.abs(interpreted).max()
    assert np.abs(fused - interpreted).max() <= max(4 * sensitivity, 1e-5 * scale)


def test_forms_the_fused_attention_does_not_cover_keep_the_interpreter(tmp_path):
    """A sliding window, attention sinks, clipped q/k/v, a layer norm, fp16 matrices: no fused block (the engine
    then runs the interpreter's graphs)."""
    import dataclasses

    from npumoe.core.runtime.fused import attention_block

    build_checkpoint(FAMILIES["mixtral"](), tmp_path)
    model = npumoe.load(tmp_path, dtype="bfloat16")
    assert attention_block(model.spec, 0, model.weights) is not None
    layer = model.spec.layers[0]
    for attention in (dict(sliding_window=8), dict(sinks=True), dict(clip_qkv=1.0)):
        changed = dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, **attention))
        assert attention_block(dataclasses.replace(model.spec, layers=(changed,)), 0, model.weights) is None
    layer_norm = dataclasses.replace(layer, norm=dataclasses.replace(layer.norm, kind="layer"))
    assert attention_block(dataclasses.replace(model.spec, layers=(layer_norm,)), 0, model.weights) is None
    assert attention_block(model.spec, 0, npumoe.load(tmp_path, dtype="float16").weights) is None


@pytest.mark.parametrize("experts, top_k, normalize, scaling",
                         [(6, 2, True, 1.0), (128, 8, False, 2.5), (60, 1, True, 1.0)])
def test_softmax_routing_in_one_call_equals_route(experts, top_k, normalize, scaling):
    """The fused decode router picks route()'s experts in route()'s order, with its weights and logits to float
    rounding; a router it does not cover (a bias) is left to route()."""
    from npumoe.core.ir.spec import RouterSpec
    from npumoe.core.runtime.router import route

    g = torch.Generator().manual_seed(experts)
    z, w = torch.randn(1, 256, generator=g), torch.randn(experts, 256, generator=g)
    spec = RouterSpec(top_k=top_k, normalize=normalize, routed_scaling=scaling)
    top_i, top_w, logits = fused.softmax_route(z, w, top_k, normalize, scaling)
    want_i, want_w, want_logits = route(z, spec, w)
    assert torch.equal(top_i, want_i)
    torch.testing.assert_close(top_w, want_w, rtol=1e-4, atol=0)  # (a logit off by δ moves its weight by ~δ)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5 * float(want_logits.abs().max()))
    assert fused.softmax_route(z.double(), w, top_k, normalize, scaling) is None


def test_a_non_finite_fused_step_reruns_layer_by_layer_and_names_the_layer(tmp_path):
    """A NaN reaching a decode token inside the whole-step call is not returned: the step runs again layer by layer
    (writing the same cache slots) and stops at the graph that produced it, as it would have without the call."""
    from npumoe.core.base.errors import NumericError

    build_checkpoint(FAMILIES["mixtral"](), tmp_path)
    model = npumoe.load(tmp_path)
    engine = npumoe.Engine(model, chunk=8)
    engine.generate(np.arange(3, 24), max_new_tokens=1)
    assert engine._decode_step() is not None
    model.weights["layers.1.attn.o.weight"][0, 0] = float("nan")  # the matrix the fused call reads
    with pytest.raises(NumericError, match="layer 1's attention"):
        engine.decode(7)


def test_generate_builds_the_whole_step_before_its_first_decode_token(tmp_path, monkeypatch):
    """The whole-step call's records (one per matrix) are built once, before the first decode token is timed, and
    timed as ``decode_setup``; a generation of one token (no decode step) builds nothing."""
    build_checkpoint(FAMILIES["mixtral"](), tmp_path)
    engine = npumoe.Engine(npumoe.load(tmp_path), chunk=8)
    built = []
    of = fused.DecodeStep.of
    monkeypatch.setattr(fused.DecodeStep, "of", lambda *a, **k: built.append(engine.metrics["seconds"].copy())
                        or of(*a, **k))
    engine.generate(np.arange(3, 24), max_new_tokens=1)
    assert built == [] and "decode_setup" not in engine.metrics["seconds"]
    engine.generate(np.arange(3, 24), max_new_tokens=4)
    assert len(built) == 1 and "decode" not in built[0]  # built before any decode token ran
    assert engine.metrics["seconds"]["decode_setup"] > 0
