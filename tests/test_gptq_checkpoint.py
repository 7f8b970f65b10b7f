"""Hugging Face GPTQ exports load as stored: routed experts packed for the LUT kernels, every other
quantised linear dequantised. The truth is transformers running the same checkpoint's weights
dequantised by GPTQ's own formula, w = s · (q − z), written here from the codes; and every GPTQ
variant npumoe cannot hold is refused with a message naming it."""

import json
import re

import numpy as np
import pytest
import torch
from gptq_pack import pack_words
from hf_compare import build_checkpoint, edit_config, transformers
from safetensors import safe_open
from safetensors.torch import save_file

import npumoe
from npumoe.cli import main
from npumoe.core.base.errors import InputError, UnsupportedModelError, WeightError
from npumoe.luts import gptq
from npumoe.models.checkpoints import lut as checkpoint
from npumoe.models.checkpoints.quantize import quantize_checkpoint

ARCH = dict(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
# what GPTQ exporters quantise: attention and MLP projections; never the router, gates, norms or embeddings
QUANTISED = re.compile(r".*\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
                       r"mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj)\.weight$")


def gptq_grid(w: np.ndarray, bits: int, group: int, symmetric: bool):
    """Round-to-nearest on GPTQ's grid: codes q [N, K], zero points z [N, G], fp16 scales s [N, G]."""
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    top = 2**bits - 1
    if symmetric:
        s = (2 * np.abs(blocks).max(-1) / top).astype(np.float16)
        z = np.full(s.shape, 2 ** (bits - 1))
    else:
        lo, hi = blocks.min(-1), blocks.max(-1)
        s = ((hi - lo) / top).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float32)), 1, top).astype(np.int64)  # ≥ 1: v1 stores z − 1
    q = np.clip(np.round(blocks / s.astype(np.float32)[..., None]) + z[..., None], 0, top).astype(np.int64)
    return q.reshape(n, k), z, s


def write_gptq(source, out, reference, bits=4, group=32, version="v1", symmetric=False, **quant_changes):
    """The GPTQ export of ``source`` (``out``) and, beside it, the fp32 weights it stands for (``reference``)."""
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        state = {key: f.get_tensor(key) for key in f.keys()}
    stored, dense = {}, dict(state)
    for key in [k for k in state if QUANTISED.match(k)]:
        q, z, s = gptq_grid(state[key].float().numpy(), bits, group, symmetric)
        prefix, k = key[: -len(".weight")], q.shape[1]
        stored |= {f"{prefix}.qweight": pack_words(q, bits).T.copy(),
                   f"{prefix}.qzeros": pack_words((z - gptq.ZERO_OFFSET[version]).T, bits),
                   f"{prefix}.scales": s.T.copy(), f"{prefix}.g_idx": (np.arange(k) // group).astype(np.int32)}
        dense[key] = torch.from_numpy(s.astype(np.float32).repeat(group, 1) * (q - z.repeat(group, 1))).float()
        state.pop(key)
    stored = {k: torch.from_numpy(v) for k, v in stored.items()} | state
    for path, tensors in ((out, stored), (reference, dense)):
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_bytes((source / "config.json").read_bytes())
    quant = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": symmetric,
             "checkpoint_format": {"v1": "gptq", "v2": "gptq_v2"}[version]} | quant_changes
    edit_config(out, quantization_config=quant)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32")
    build_checkpoint(transformers.Qwen2MoeConfig(**ARCH), path)
    return path


@pytest.mark.parametrize("bits, group, version, symmetric",
                         [(4, 32, "v1", False), (4, 64, "v2", True), (2, 32, "v1", False), (8, 64, "v2", False)])
def test_gptq_export_loads_as_stored_and_runs_like_transformers(source, tmp_path, bits, group, version, symmetric):
    write_gptq(source, tmp_path / "gptq", tmp_path / "ref", bits, group, version, symmetric)
    model, reference = npumoe.load(tmp_path / "gptq"), npumoe.load(tmp_path / "ref")
    assert set(model.weights.packed) == set(checkpoint.quantized_names(model.spec))
    assert {n: p.bits for n, p in model.weights.packed.items()} == dict.fromkeys(model.weights.packed, bits)
    for name in reference.weights:  # experts dequantised from their packed form, the rest as loaded
        assert torch.equal(model.weights[name], reference.weights[name]), name

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref", attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, ARCH["vocab_size"], 21)
    with torch.no_grad():
        truth = hf(torch.tensor(ids)[None]).logits[0].numpy()
    ours = npumoe.Engine(model, chunk=8).forward(ids)  # experts through npumoe::lut_linear (int8 tables)
    assert float(np.mean((ours - truth) ** 2) / np.mean(truth**2)) <= 2e-3
    assert (ours.argmax(-1) == truth.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("changes, error, match", [
    (dict(group_size=-1), UnsupportedModelError, "one scale per output row"),
    (dict(group_size=48), UnsupportedModelError, "group 48"),
    (dict(bits=6), UnsupportedModelError, "6 bits"),
    (dict(checkpoint_format="marlin"), UnsupportedModelError, "checkpoint_format 'marlin'"),
    (dict(quant_method="awq"), UnsupportedModelError, "quantized \\(awq\\)"),
])  # fmt: skip
def test_gptq_variants_npumoe_cannot_hold_are_refused(source, tmp_path, changes, error, match):
    write_gptq(source, tmp_path / "gptq", tmp_path / "ref")
    quant = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    edit_config(tmp_path / "gptq", quantization_config=quant | changes)
    with pytest.raises(error, match=match):
        npumoe.load(tmp_path / "gptq")


def test_damaged_gptq_layers_are_named(source, tmp_path):
    write_gptq(source, tmp_path / "gptq", tmp_path / "ref")
    file = tmp_path / "gptq" / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        state = {key: f.get_tensor(key) for key in f.keys()}
    layer = "model.layers.1.mlp.experts.2.up_proj"
    for edit, match in ((lambda s: s.pop(f"{layer}.qzeros"), f"{layer} has a qweight but no qzeros"),
                        (lambda s: s.update({f"{layer}.g_idx": torch.flip(s[f"{layer}.g_idx"], [0])}), "act-order"),
                        (lambda s: s.update({"model.layers.0.self_attn.o_proj.bias": torch.ones(64)}),
                         "non-zero bias")):
        damaged = dict(state)
        edit(damaged)
        save_file(damaged, str(file))
        with pytest.raises((WeightError, UnsupportedModelError), match=match):
            npumoe.load(tmp_path / "gptq")


def test_inspect_names_the_packed_experts(source, tmp_path, capsys):
    write_gptq(source, tmp_path / "gptq", tmp_path / "ref", bits=4, group=32)
    main(["inspect", str(tmp_path / "gptq")])
    assert "24 routed-expert matrices packed for the LUT kernels (4-bit group 32; from a GPTQ export)" in " ".join(
        capsys.readouterr().out.split())


def test_quantize_explains_that_a_gptq_export_needs_none(source, tmp_path):
    write_gptq(source, tmp_path / "gptq", tmp_path / "ref")
    with pytest.raises(InputError, match="GPTQ export"):
        quantize_checkpoint(tmp_path / "gptq", tmp_path / "out", 4, 64)
    assert not (tmp_path / "out").exists()
