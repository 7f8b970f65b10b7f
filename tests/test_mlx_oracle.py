"""mlx-lm as a third independent oracle (after transformers and the reference interpreter): npumoe's mlx target,
built and run by the engine, against mlx-lm's own model classes on the same tiny checkpoint, prefill logits at
fp32 tolerance and greedy tokens from mlx-lm's own decode loop (``generate_step``, its KV cache).

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


def mlx_target(checkpoint, work):
    """npumoe's engine on the mlx target: every expert group planned onto MLX, built, loaded from the artifacts."""
    model = npumoe.load(checkpoint)
    calibration = np.random.default_rng(2).integers(0, model.spec.vocab_size, 64).tolist()
    plan = npumoe.plan(model, npumoe.calibrate(model, [calibration], chunk=CHUNK), target="mlx", residency="npu")
    build(model, plan, "mlx", work / "artifacts", max_context=MAX_CONTEXT, progress=False)
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
