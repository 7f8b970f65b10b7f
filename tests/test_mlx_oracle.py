"""mlx-lm as a third independent oracle (after transformers and the reference interpreter): npumoe's mlx target,
built and run by the engine, against mlx-lm's own model classes on the same tiny checkpoint, prefill logits at
fp32 tolerance and greedy tokens from mlx-lm's own decode loop (``generate_step``, its KV cache); then again on
bf16 checkpoints, both engines computing in bf16, at bf16's rounding (``BF16_ULPS``).

The installed mlx-lm has every family npumoe reads: qwen3_moe, qwen2_moe, mixtral, olmoe, phimoe, deepseek_v3
and gpt_oss. It reads their checkpoints as the Hub's carry them, so each is given what transformers 5 writes
differently: the legacy ``rope_theta`` / ``rope_scaling`` / ``num_experts`` keys (through ``model_config``),
and for gpt-oss its experts as separate projections (mlx-lm's ``sanitize`` takes only the MXFP4 blocks of
OpenAI's release). Two configurations where mlx-lm itself departs from transformers are left out:
  * gpt-oss's YaRN with ``truncate: false`` (its release config): mlx-lm's YarnRoPE always rounds the
    correction range, so these checkpoints use ``truncate: true``;
  * DeepSeek-V3 routing where every choice scores below zero: mlx-lm fills the dropped groups' scores with 0,
    transformers (and npumoe) with −inf, so the correction bias here keeps scores positive, as trained ones do.
"""

import json

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="the mlx target needs MLX (pip install 'npumoe[mlx]')",
                         exc_type=ImportError)
mlx_lm_utils = pytest.importorskip("mlx_lm.utils", reason="the oracle is mlx-lm (pip install 'npumoe[mlx]', "
                                   "Python 3.11+)", exc_type=ImportError)

from hf_compare import LOGIT_TOL, build_checkpoint, transformers  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import npumoe  # noqa: E402
from npumoe.core.compiler.artifacts import build  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=96)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=40, moe_intermediate_size=24, head_dim=16, num_experts=6,
                                         norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=40, moe_intermediate_size=24, num_experts=6,
                                         shared_expert_intermediate_size=32)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=6)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=24, num_experts=8)),
    "phimoe": ("PhimoeConfig", dict(intermediate_size=24, num_local_experts=6, attention_bias=True,
                                    lm_head_bias=True)),  # Phi-3.5-MoE's biases, which mlx-lm's phimoe always has
    "deepseek_v3": ("DeepseekV3Config", dict(
        intermediate_size=40, moe_intermediate_size=16, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=1)),
    "gpt_oss": ("GptOssConfig", dict(
        intermediate_size=24, head_dim=16, num_local_experts=6, sliding_window=5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": 64})),
}
PROMPT, NEW_TOKENS, CHUNK, MAX_CONTEXT = 13, 12, 8, 64  # a prompt that is not a whole number of chunks


def positive_correction_bias(model):
    """DeepSeek-V3's e_score_correction_bias (a buffer the jitter skips), small enough to keep scores positive."""
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf) * 0.1)


def mlx_lm_model(checkpoint, hf_model, work):
    """mlx-lm's model of the checkpoint, from its own classes and loader (see the module's docstring)."""
    config = json.loads((checkpoint / "config.json").read_text())
    rope = config.get("rope_parameters", {})
    legacy = {"rope_theta": rope.get("rope_theta"), "num_experts": config.get("num_local_experts")}
    if rope.get("rope_type", "default") != "default":
        legacy["rope_scaling"] = rope
    if config["model_type"] == "gpt_oss":
        checkpoint = work / "mlx-lm"
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text(json.dumps(config))
        save_file(separate_projections(hf_model.state_dict()), str(checkpoint / "model.safetensors"))
    model, _ = mlx_lm_utils.load_model(checkpoint, model_config={k: v for k, v in legacy.items() if v is not None})
    return model


def separate_projections(state: dict) -> dict:
    """gpt-oss's stacked experts (gate and up interleaved in [E, in, 2·I], as transformers computes them) as
    mlx-lm's per-projection [E, out, in] matrices and their biases."""
    out = {}
    for name, t in state.items():
        t = t.detach()
        if name.endswith("experts.gate_up_proj"):
            out[name.replace("gate_up_proj", "gate_proj.weight")] = t[..., ::2].transpose(1, 2).contiguous()
            out[name.replace("gate_up_proj", "up_proj.weight")] = t[..., 1::2].transpose(1, 2).contiguous()
        elif name.endswith("experts.gate_up_proj_bias"):
            out[name.replace("gate_up_proj_bias", "gate_proj.bias")] = t[..., ::2].contiguous()
            out[name.replace("gate_up_proj_bias", "up_proj.bias")] = t[..., 1::2].contiguous()
        elif name.endswith("experts.down_proj"):
            out[f"{name}.weight"] = t.transpose(1, 2).contiguous()
        elif name.endswith("experts.down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = t
        else:
            out[name] = t.contiguous()
    return out


def mlx_target(checkpoint, work, dtype="float32"):
    """npumoe's engine on the mlx target: every expert group planned onto MLX, built, loaded from the artifacts;
    weights held and graphs computed in ``dtype``."""
    model = npumoe.load(checkpoint, dtype=dtype)
    calibration = np.random.default_rng(2).integers(0, model.spec.vocab_size, 64).tolist()
    plan = npumoe.plan(model, npumoe.calibrate(model, [calibration], chunk=CHUNK), target="mlx", residency="npu")
    build(model, plan, "mlx", work / "artifacts", max_context=MAX_CONTEXT, progress=False, activations=dtype)
    return npumoe.Engine(model, backend="mlx", artifacts=work / "artifacts")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_mlx_target_matches_mlx_lm(family, tmp_path):
    config_class, arch = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **arch})
    hf = build_checkpoint(config, tmp_path / "hf", prepare=positive_correction_bias)
    oracle = mlx_lm_model(tmp_path / "hf", hf, tmp_path)
    engine = mlx_target(tmp_path / "hf", tmp_path)
    ids = np.random.default_rng(1).integers(0, COMMON["vocab_size"], PROMPT)

    want = np.array(oracle(mx.array(ids)[None])[0].astype(mx.float32))
    np.testing.assert_allclose(engine.forward(ids), want, atol=LOGIT_TOL, rtol=0)
    assert engine.metrics["npu_launches"] > 0  # the graphs ran on MLX, not on the reference interpreter

    greedy = [int(token) for token, _ in generate_step(mx.array(ids), oracle, max_tokens=NEW_TOKENS)]
    if COMMON["eos_token_id"] in greedy:  # where the engine stops; generate_step goes on
        greedy = greedy[:greedy.index(COMMON["eos_token_id"]) + 1]
    assert engine.generate(ids, NEW_TOKENS).tolist() == greedy


BF16_ULPS = 4  # |Δlogit| ≤ 4 · 2⁻⁸ · max|logit|: a bf16 value carries 8 significant bits, so each rounding moves a
# logit by up to 2⁻⁸ of its magnitude, and the two engines round at different points (npumoe keeps its residual
# stream, norms and router in fp32 on the host; mlx-lm all of them in bf16). Measured here: 1.5-2.1 ulps.
ROUTING_FLIPS = {"phimoe": 1}  # positions allowed past it: sparsemixer's threshold on bf16 router scores (mlx-lm)
# picks another expert for one of the 13 tokens than on fp32 ones (npumoe); measured 15.8 ulps there, ≤ 2.7 elsewhere


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_mlx_target_matches_mlx_lm_in_bf16(family, tmp_path, monkeypatch):
    """The same check on a bf16 checkpoint, both engines computing in bf16, at bf16's tolerance (BF16_ULPS). MLX's
    CPU gather_mm takes fp32 only, so mlx-lm's experts run it on their bf16 operands widened to fp32 (exactly) and
    the product rounded back to bf16: a bf16 GEMM with fp32 sums, as Metal's computes it."""
    gather_mm = mx.gather_mm
    monkeypatch.setattr(mx, "gather_mm", lambda a, b, *args, **kw: gather_mm(
        a.astype(mx.float32), b.astype(mx.float32), *args, **kw).astype(a.dtype))
    config_class, arch = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **arch})
    hf = build_checkpoint(config, tmp_path / "fp32", prepare=positive_correction_bias).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    oracle = mlx_lm_model(tmp_path / "hf", hf, tmp_path)
    engine = mlx_target(tmp_path / "hf", tmp_path, dtype="bfloat16")
    assert engine.model.weights.dtype == torch.bfloat16
    ids = np.random.default_rng(1).integers(0, COMMON["vocab_size"], PROMPT)

    want = np.array(oracle(mx.array(ids)[None])[0].astype(mx.float32))
    tolerance = BF16_ULPS * 2 ** -8 * np.abs(want).max()
    beyond = int((np.abs(engine.forward(ids) - want).max(axis=1) > tolerance).sum())
    assert beyond <= ROUTING_FLIPS.get(family, 0), (family, beyond)

    steps = list(generate_step(mx.array(ids), oracle, max_tokens=NEW_TOKENS))
    greedy = [int(token) for token, _ in steps]
    if COMMON["eos_token_id"] in greedy:  # where the engine stops; generate_step goes on
        greedy = greedy[:greedy.index(COMMON["eos_token_id"]) + 1]
    margins = [float(abs(mx.diff(mx.topk(logprobs, 2))[0])) for _, logprobs in steps[:len(greedy)]]
    decided = next((i for i, m in enumerate(margins) if m < 2 * tolerance), len(greedy))  # before a near tie
    assert decided >= 1  # (here 1 to 12 of the tokens: random tiny models have near ties)
    assert engine.generate(ids, NEW_TOKENS).tolist()[:decided] == greedy[:decided]
