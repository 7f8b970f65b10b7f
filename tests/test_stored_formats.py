"""Block-FP8 (DeepSeek-V3) and MXFP4 (gpt-oss) checkpoints read as stored, widened per tensor.

The truth is transformers' own dequantisation of those formats: a second checkpoint holds its
widened weights in plain form, and npumoe must read the compressed one to exactly those values
(and so to the same logits)."""

import json

import numpy as np
import pytest
import torch
from cli_check import cli_error
from hf_compare import build_checkpoint, transformers
from safetensors.torch import load_file, save_file

import npumoe
from npumoe.errors import WeightError

fp8_oracle = pytest.importorskip("transformers.integrations.finegrained_fp8")._dequantize_fp8_weight
mxfp4_oracle = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors

BLOCK = [16, 16]


def write(path, state, cfg):
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def assert_same_weights(a, b):
    assert sorted(a.weights) == sorted(b.weights)
    for name in a.weights:
        assert torch.equal(a.weights[name].float(), b.weights[name].float()), name


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(FP8 checkpoint, the same weights widened by transformers, in plain fp32)."""
    root = tmp_path_factory.mktemp("fp8")
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=128)
    build_checkpoint(cfg, root / "src")
    state, config = load_file(str(root / "src" / "model.safetensors")), json.loads((root / "src" / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    packed, plain = {}, {}
    for key, t in state.items():
        if t.dim() == 2 and "proj" in key and key.endswith(".weight"):
            w8 = (t / t.abs().max() * 400).to(torch.float8_e4m3fn)  # the full e4m3 range
            scale = torch.rand(-(-t.shape[0] // 16), -(-t.shape[1] // 16), generator=gen) * 1e-3 + 1e-4
            packed |= {key: w8, f"{key}_scale_inv": scale}
            plain[key] = fp8_oracle(w8, scale, BLOCK, torch.float32)
        else:
            packed[key] = plain[key] = t
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK, "activation_scheme": "dynamic"}
    return write(root / "fp8", packed, {**config, "quantization_config": quant}), write(root / "plain", plain, config)


def test_fp8_reads_transformers_values(fp8):
    ours, truth = npumoe.load(fp8[0], dtype="float32"), npumoe.load(fp8[1], dtype="float32")
    assert_same_weights(ours, truth)
    ids = np.arange(3, 14)
    # (equal weights; the GEMMs may still round differently by the weights' memory alignment)
    np.testing.assert_allclose(npumoe.Engine(ours, chunk=8).forward(ids), npumoe.Engine(truth, chunk=8).forward(ids),
                               rtol=0, atol=1e-5)


def test_fp8_weight_without_its_scale_is_named(fp8, tmp_path, capsys):
    state = load_file(str(fp8[0] / "model.safetensors"))
    key = next(k for k in state if k.endswith("_scale_inv"))
    del state[key]
    path = write(tmp_path / "m", state, json.loads((fp8[0] / "config.json").read_text()))
    with pytest.raises(WeightError, match=f"FP8 weight {key[:-len('_scale_inv')]} has no {key}"):
        npumoe.load(path)
    assert "_scale_inv" in cli_error(capsys, "inspect", str(path))


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(MXFP4 checkpoint as gpt-oss ships its experts, the same experts widened by transformers)."""
    root = tmp_path_factory.mktemp("mxfp4")
    cfg = transformers.GptOssConfig(
        vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=128)
    build_checkpoint(cfg, root / "src", layout="stacked")
    state, config = load_file(str(root / "src" / "model.safetensors")), json.loads((root / "src" / "config.json").read_text())
    gen = torch.Generator().manual_seed(1)
    packed, plain = {}, {}
    for key, t in state.items():
        if key.endswith(("gate_up_proj", "down_proj")) and t.dim() == 3:  # [E, in, out]
            e, k, n = t.shape
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(118, 130, (e, n, k // 32), dtype=torch.uint8, generator=gen)
            packed |= {f"{key}_blocks": blocks, f"{key}_scales": scales}
            plain[key] = mxfp4_oracle(blocks, scales, dtype=torch.bfloat16)
        else:
            packed[key] = plain[key] = t
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]}
    return write(root / "mxfp4", packed, {**config, "quantization_config": quant}), write(root / "plain", plain, config)


def test_mxfp4_reads_transformers_values(mxfp4):
    ours, truth = npumoe.load(mxfp4[0], dtype="float32"), npumoe.load(mxfp4[1], dtype="float32")
    assert ours.weights.source("layers.1.moe.experts.2.down.weight").dtype == torch.bfloat16  # exact in bf16
    assert_same_weights(ours, truth)
    ids = np.arange(3, 14)
    # (equal weights; the GEMMs may still round differently by the weights' memory alignment)
    np.testing.assert_allclose(npumoe.Engine(ours, chunk=8).forward(ids), npumoe.Engine(truth, chunk=8).forward(ids),
                               rtol=0, atol=1e-5)


def test_mxfp4_widens_only_the_expert_asked_for(mxfp4, monkeypatch):
    from npumoe.models import stored_formats

    widened = []
    original = stored_formats.mxfp4_dequantize
    monkeypatch.setattr(stored_formats, "mxfp4_dequantize",
                        lambda b, s: widened.append(b.shape[0]) or original(b, s))
    npumoe.load(mxfp4[0]).weights["layers.0.moe.experts.3.up.weight"]
    assert widened == [1]


def test_mxfp4_blocks_and_scales_that_disagree(mxfp4, tmp_path, capsys):
    state = load_file(str(mxfp4[0] / "model.safetensors"))
    key = next(k for k in state if k.endswith("_scales"))
    state[key] = state[key][:, :-1].contiguous()
    path = write(tmp_path / "m", state, json.loads((mxfp4[0] / "config.json").read_text()))
    with pytest.raises(WeightError, match="MXFP4 tensor .*_blocks .* needs .*_scales of shape"):
        npumoe.load(path)
    assert "MXFP4" in cli_error(capsys, "inspect", str(path))
