"""Block-FP8 (DeepSeek-V3) and MXFP4 (gpt-oss) checkpoints read as stored: FP8 widened per tensor,
MXFP4's routed experts as 5-bit LUT codes (the rest, and experts whose scales float16 cannot
hold, widened per expert).

The truth is transformers' own dequantisation of those formats: a second checkpoint holds its
widened weights in plain form, and npumoe must read the compressed one to exactly those values
(and so to the same logits, or with packed experts to transformers' within the LUT-GEMV's bound)."""

import json

import numpy as np
import pytest
import torch
from cli_check import cli_error
from hf_compare import build_checkpoint, transformers
from safetensors.torch import load_file, save_file

import npumoe
from npumoe.cli import main
from npumoe.core.base.errors import WeightError
from npumoe.luts import layout, spec
from npumoe.luts import mxfp4 as mx
from npumoe.models.checkpoints.lut import quantized_names

fp8_oracle = pytest.importorskip("transformers.integrations.finegrained_fp8")._dequantize_fp8_weight
mxfp4_oracle = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors

BLOCK = [16, 16]
# one row of layer 1's gate_up for expert 2 gets a scale below float16: row 5 is odd, so an "up" row
WIDE_STACK, WIDE_EXPERT, WIDE_ROW = "model.layers.1.mlp.experts.gate_up_proj", 2, 5
WIDE = "layers.1.moe.experts.2.up.weight"


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
    state, config = (load_file(str(root / "src" / "model.safetensors")),
                     json.loads((root / "src" / "config.json").read_text()))
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
    state, config = (load_file(str(root / "src" / "model.safetensors")),
                     json.loads((root / "src" / "config.json").read_text()))
    gen = torch.Generator().manual_seed(1)
    packed, plain = {}, {}
    for key, t in state.items():
        if key.endswith(("gate_up_proj", "down_proj")) and t.dim() == 3:  # [E, in, out]
            e, k, n = t.shape
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(118, 130, (e, n, k // 32), dtype=torch.uint8, generator=gen)
            if key == WIDE_STACK:  # 2^(103 − 128) is below float16: this row's matrix stays widened
                scales[WIDE_EXPERT, WIDE_ROW, 0] = 103
            packed |= {f"{key}_blocks": blocks, f"{key}_scales": scales}
            plain[key] = mxfp4_oracle(blocks, scales, dtype=torch.bfloat16)
        else:
            packed[key] = plain[key] = t
    quant = {"quant_method": "mxfp4",
             "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                        "model.embed_tokens", "lm_head"]}
    return write(root / "mxfp4", packed, {**config, "quantization_config": quant}), write(root / "plain", plain, config)


def test_mxfp4_experts_are_packed_and_every_weight_is_transformers_value(mxfp4):
    ours, truth = npumoe.load(mxfp4[0], dtype="float32"), npumoe.load(mxfp4[1], dtype="float32")
    packed = ours.weights.packed
    assert set(packed.candidates) == set(quantized_names(ours.spec)) and WIDE not in packed
    assert set(packed) == set(packed.candidates) - {WIDE} and packed.formats == [(5, 32)]
    assert ours.weights.source(WIDE).dtype == torch.bfloat16  # the widened path, exact in bf16
    for name in packed:  # the packed codes, through the numpy spec and through the kernels
        assert torch.equal(torch.from_numpy(spec.dequantize(layout.from_tiles(packed[name].tiled()))),
                           truth.weights[name]), name
    assert_same_weights(ours, truth)  # packed ones via the kernels' dequantisation, the rest as read


def test_mxfp4_widened_path_gives_the_same_logits(mxfp4):
    ours, truth = npumoe.load(mxfp4[0], dtype="float32"), npumoe.load(mxfp4[1], dtype="float32")
    ours.weights.packed = {}  # every expert through its widened source, as before packing existed
    ids = np.arange(3, 14)
    # (equal weights; the GEMMs may still round differently by the weights' memory alignment)
    np.testing.assert_allclose(npumoe.Engine(ours, chunk=8).forward(ids), npumoe.Engine(truth, chunk=8).forward(ids),
                               rtol=0, atol=1e-5)


def test_mxfp4_packed_experts_run_like_transformers(mxfp4):
    """Packed experts through npumoe::lut_linear (int8 activation tables for a few rows, the exact
    LUT-dequant GEMM from 13 rows at 5 bits) against transformers on the same dequantised weights."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(mxfp4[1], attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, 64, 40)
    with torch.no_grad():
        truth = hf(torch.tensor(ids)[None]).logits[0].numpy()
    for chunk in (4, 40):  # decode-sized chunks: GEMV rows; one prefill chunk: GEMM for the busy experts
        ours = npumoe.Engine(npumoe.load(mxfp4[0], dtype="float32"), chunk=chunk).forward(ids)
        assert float(np.mean((ours - truth) ** 2) / np.mean(truth**2)) <= 2e-3, chunk
        assert (ours.argmax(-1) == truth.argmax(-1)).mean() >= 0.9, chunk


def test_mxfp4_codes_map_exactly_and_scales_outside_fp16_are_refused():
    """Every E2M1 code and the fp16 power-of-two range's ends (2^-24, 2^15) against transformers'
    dequantisation; a scale one past either end has no exact 5-bit form."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).repeat(1, 40, 1, 1)  # all pairs
    scales = torch.arange(104, 144, dtype=torch.uint8).reshape(1, 40, 1).repeat(1, 1, 16)
    packed = mx.from_mxfp4(blocks[0].numpy(), scales[0].numpy())
    assert packed.meta.bits == 5 and packed.meta.symmetric and packed.meta.group == 32
    truth = mxfp4_oracle(blocks, scales, dtype=torch.float32)[0].T  # [out, in]
    assert torch.equal(torch.from_numpy(spec.dequantize(packed)), truth)
    for outside in (103, 144):
        scales[0, 7, 3] = outside
        assert not mx.exact_in_fp16(scales[0].numpy())
        with pytest.raises(WeightError, match="outside float16"):
            mx.from_mxfp4(blocks[0].numpy(), scales[0].numpy())


def test_mxfp4_reads_only_the_expert_asked_for(mxfp4, monkeypatch):
    from npumoe.models.checkpoints import stored_formats

    widened, packed = [], []
    original, pack = stored_formats.mxfp4_dequantize, mx.from_mxfp4
    monkeypatch.setattr(stored_formats, "mxfp4_dequantize", lambda b, s: widened.append(b.shape[0]) or original(b, s))
    monkeypatch.setattr(mx, "from_mxfp4", lambda b, s: packed.append(b.shape) or pack(b, s))
    weights = npumoe.load(mxfp4[0]).weights
    assert not packed and not widened  # nothing converted at load
    weights["layers.0.moe.experts.3.up.weight"]
    assert widened == [] and packed == [(32, 2, 16)]  # the up rows of one expert's gate_up, 64 inputs
    weights[WIDE]
    assert widened == [1]  # the kept-widened matrix: its expert alone


def test_an_mxfp4_layout_other_than_whole_rows_is_refused(tmp_path):
    from npumoe.core.base.errors import UnsupportedModelError
    from npumoe.models.checkpoints.mxfp4 import stacked_rows

    class ColumnsAdapter:  # takes the stack untransposed: each matrix a column of the row numbers
        def canonical(self, key, t):
            yield "layers.0.moe.experts.0.down.weight", t[0]

    with pytest.raises(UnsupportedModelError, match="other than whole output rows of one expert"):
        list(stacked_rows(ColumnsAdapter(), "stack", 2, 8, tmp_path))


def test_inspect_counts_the_packed_and_the_widened_experts(mxfp4, capsys):
    main(["inspect", str(mxfp4[0])])
    assert ("23 of 24 routed-expert matrices packed for the LUT kernels (5-bit group 32; from MXFP4 codes); 1 kept "
            "widened because their scales are outside fp16") in " ".join(capsys.readouterr().out.split())


def test_mxfp4_blocks_and_scales_that_disagree(mxfp4, tmp_path, capsys):
    state = load_file(str(mxfp4[0] / "model.safetensors"))
    key = next(k for k in state if k.endswith("_scales"))
    state[key] = state[key][:, :-1].contiguous()
    path = write(tmp_path / "m", state, json.loads((mxfp4[0] / "config.json").read_text()))
    with pytest.raises(WeightError, match="MXFP4 tensor .*_blocks .* needs .*_scales of shape"):
        npumoe.load(path)
    assert "MXFP4" in cli_error(capsys, "inspect", str(path))
