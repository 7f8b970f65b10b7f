"""The GGUF export that `npumoe bench cpu` hands llama.cpp: gguf's own reader sees our tensors under
llama.cpp's names, and llama.cpp computes the logits npumoe does from it."""

import numpy as np
import pytest
from hf_compare import build_checkpoint, transformers

import npumoe
from npumoe.core.base.errors import InputError
from npumoe.models.gguf_export import write_gguf

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install 'npumoe[bench]')")

CONFIG = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, norm_topk_prob=True, eos_token_id=2, bos_token_id=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3moe")
    build_checkpoint(transformers.Qwen3MoeConfig(**CONFIG), folder / "hf", jitter=0.2)
    model = npumoe.load(folder / "hf", dtype="float32")
    return model, write_gguf(model, "qwen3_moe", folder / "model.gguf")


def test_gguf_holds_every_tensor_under_llama_cpp_names(exported):
    model, path = exported
    reader = gguf.GGUFReader(path)
    fields = {name: field.parts[-1][0] for name, field in reader.fields.items() if len(field.parts[-1]) == 1}
    assert (fields["qwen3moe.block_count"], fields["qwen3moe.expert_count"], fields["qwen3moe.expert_used_count"],
            fields["qwen3moe.attention.head_count_kv"], fields["qwen3moe.attention.key_length"]) == (2, 8, 2, 2, 16)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    w = model.weights
    np.testing.assert_array_equal(tensors["blk.1.attn_q.weight"],
                                  w["layers.1.attn.q.weight"].numpy().astype(np.float16))
    np.testing.assert_array_equal(tensors["blk.0.attn_k_norm.weight"], w["layers.0.attn.k_norm.weight"].numpy())
    gate = tensors["blk.1.ffn_gate_exps.weight"]  # [experts, intermediate, hidden], expert e at index e
    assert gate.shape == (8, 32, 64)
    np.testing.assert_array_equal(gate[5], w["layers.1.moe.experts.5.gate.weight"].numpy().astype(np.float16))
    assert "token_embd.weight" in tensors and "output.weight" in tensors and len(tensors) == 2 + 2 * 12 + 1


def test_llama_cpp_computes_npumoes_logits_from_it(exported):
    llama_cpp = pytest.importorskip("llama_cpp",
                                    reason="llama-cpp-python is not installed (pip install 'npumoe[bench]')")
    from npumoe.core.base.native import native_output_silenced

    model, path = exported
    ids = np.random.default_rng(0).integers(3, 320, 24)
    with native_output_silenced(1, 2):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False)
    llm.eval(ids.tolist())
    theirs, ours = np.asarray(llm.scores[: len(ids)]), npumoe.Engine(model).forward(ids)
    assert np.array_equal(theirs.argmax(-1), ours.argmax(-1))
    assert np.abs(theirs - ours).max() <= 0.01 * np.abs(ours).max()  # F16 weights and KV cache: 0.22 % measured


def test_a_config_llama_cpp_would_run_as_another_model_is_refused(tmp_path):
    build_checkpoint(transformers.Qwen3MoeConfig(**{**CONFIG, "norm_topk_prob": False}), tmp_path)
    with pytest.raises(InputError, match="top-k weights not renormalised"):
        write_gguf(npumoe.load(tmp_path), "qwen3_moe", tmp_path / "model.gguf")
