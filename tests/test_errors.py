"""Bad input: a typed error with one clear sentence; on the CLI that sentence and exit code 2."""

import json

import numpy as np
import pytest
import torch
from cli_check import cli_error
from hf_compare import build_checkpoint, transformers
from safetensors.torch import load_file, save_file

import npumoe
from npumoe.errors import InputError, ModelDirError, UnsupportedModelError, WeightError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=50, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
    )
    build_checkpoint(cfg, path)
    return path


def copy_checkpoint(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_directory(tmp_path, capsys):
    with pytest.raises(ModelDirError, match="does not exist"):
        npumoe.load(tmp_path / "nope")
    assert "does not exist" in cli_error(capsys, "inspect", str(tmp_path / "nope"))


def test_missing_config(tmp_path, capsys):
    with pytest.raises(ModelDirError, match="no config.json"):
        npumoe.load(tmp_path)
    assert "config.json" in cli_error(capsys, "generate", "--model", str(tmp_path))


def test_unknown_model_type_lists_supported(tiny, tmp_path, capsys):
    path = copy_checkpoint(tiny, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(UnsupportedModelError, match="'llama' is not supported; supported: .*qwen3_moe"):
        npumoe.load(path)
    assert "qwen3_moe" in cli_error(capsys, "inspect", str(path))


def test_quantized_checkpoint_is_refused(tiny, tmp_path, capsys):
    path = copy_checkpoint(tiny, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(UnsupportedModelError, match=r"quantized \(awq\).*dequantized copy"):
        npumoe.load(path)
    assert "quantized" in cli_error(capsys, "inspect", str(path))


def test_missing_tensor_is_named(tiny, tmp_path):
    path = copy_checkpoint(tiny, tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"missing tensor 'layers\.1\.attn\.k\.weight'"):
        npumoe.load(path)


def test_misshaped_tensor_names_both_shapes(tiny, tmp_path):
    path = copy_checkpoint(tiny, tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.mlp.experts.2.up_proj.weight"] = torch.zeros(8, 32)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"'layers\.0\.moe\.experts\.2\.up\.weight'.*\[8, 32\].*\[16, 32\]"):
        npumoe.load(path)


def test_pickle_checkpoint_is_refused_unread(tiny, tmp_path, capsys):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_bytes((tiny / "config.json").read_bytes())
    (path / "pytorch_model.bin").write_bytes(b"not even a pickle: it must never be opened")
    with pytest.raises(WeightError, match="never unpickles"):
        npumoe.load(path)
    assert "safetensors" in cli_error(capsys, "generate", "--model", str(path), "--ids", "1")


def test_empty_prompt(tiny, capsys):
    eng = npumoe.Engine(npumoe.load(tiny))
    with pytest.raises(InputError, match="empty"):
        eng.forward(np.array([], dtype=np.int64))
    with pytest.raises(InputError, match="empty"):
        eng.generate([], max_new_tokens=2)
    assert "empty" in cli_error(capsys, "generate", "--model", str(tiny), "--prompt", "")


def test_token_outside_vocabulary(tiny, capsys):
    eng = npumoe.Engine(npumoe.load(tiny))
    with pytest.raises(InputError, match=r"token id 50 is outside the vocabulary \[0, 50\)"):
        eng.forward([1, 2, 50])
    with pytest.raises(InputError, match="outside the vocabulary"):
        eng.forward([-1])
    assert "outside the vocabulary" in cli_error(capsys, "generate", "--model", str(tiny), "--ids", "3,99")


def test_prompt_longer_than_cache(tiny):
    eng = npumoe.Engine(npumoe.load(tiny), chunk=4, max_context=8)
    with pytest.raises(InputError, match="KV cache"):
        eng.forward(list(range(9)))
    with pytest.raises(InputError, match="KV cache"):
        eng.generate(list(range(6)), max_new_tokens=4)
