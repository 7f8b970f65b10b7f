"""A loaded MoE model → a GGUF file llama.cpp runs: the CPU engine npumoe is measured against.

llama.cpp's own converter (``convert_hf_to_gguf.py``) is not in its Python packages, so this writes the
few architectures ``npumoe bench cpu`` uses with the ``gguf`` package: metadata from the model spec,
tensors under llama.cpp's names (``blk.N.attn_q.weight`` …, experts stacked as ``ffn_*_exps``), matrices
in F16 and norms in F32, written one tensor at a time (a layer's stacked experts are the largest thing
held). The tokenizer is a placeholder vocabulary of the right size: the benchmark feeds token ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from npumoe.core.base.errors import InputError
from npumoe.core.ir.spec import MoESpec

ARCHITECTURES = {"qwen3_moe": "qwen3moe"}
LAYER_NAMES = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
               "attn.q.weight": "attn_q.weight", "attn.k.weight": "attn_k.weight", "attn.v.weight": "attn_v.weight",
               "attn.o.weight": "attn_output.weight", "attn.q_norm.weight": "attn_q_norm.weight",
               "attn.k_norm.weight": "attn_k_norm.weight", "moe.router.weight": "ffn_gate_inp.weight"}
TOP_NAMES = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
SPECIAL = ("<unk>", "<s>", "</s>")


def write_gguf(model, model_type: str, path: str | Path) -> Path:
    """``model`` (npumoe.load) as an F16 GGUF at ``path``, for llama.cpp's ``model_type`` architecture."""
    import gguf

    if model_type not in ARCHITECTURES:
        raise InputError(f"GGUF export covers {', '.join(ARCHITECTURES)}, not {model_type!r}.")
    spec, path = model.spec, Path(path)
    _check_llama_cpp_computes_the_same(spec)
    writer = gguf.GGUFWriter(path, ARCHITECTURES[model_type])
    _metadata(writer, spec)
    tensors = list(_tensor_names(model))
    for name, get in tensors:  # the header lists every tensor before any data
        shape, dtype = get(shape_only=True)
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, get in tensors:
        writer.write_tensor_data(get())
    writer.close()
    return path


def _check_llama_cpp_computes_the_same(spec) -> None:
    """llama.cpp's qwen3moe graph hard-codes what a Qwen3-30B-A3B-style config says; anything else would
    run there as another model."""
    problems = []
    for i, layer in enumerate(spec.layers):
        a, ffn = layer.attention, layer.ffn
        if a.qkv_bias or a.o_bias or a.sliding_window or a.qk_norm != "head":
            problems.append(f"layer {i}'s attention (biases, a sliding window or no per-head q/k norm)")
        if not isinstance(ffn, MoESpec) or ffn.shared is not None or not ffn.router.normalize:
            problems.append(f"layer {i}'s FFN (dense, a shared expert, or top-k weights not renormalised)")
    if spec.tie_embeddings or spec.lm_head_bias:
        problems.append("the LM head (tied or biased)")
    if problems:
        raise InputError(f"llama.cpp's qwen3moe graph cannot run {problems[0]}; export a checkpoint shaped like "
                         "Qwen3-30B-A3B.")


def _metadata(writer, spec) -> None:
    import gguf

    moe = next(layer.ffn for layer in spec.layers if isinstance(layer.ffn, MoESpec))
    attn = spec.layers[0].attention
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.max_position)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(moe.expert.intermediate)
    writer.add_head_count(attn.num_heads)
    writer.add_head_count_kv(attn.num_kv_heads)
    writer.add_key_length(attn.head_dim)
    writer.add_value_length(attn.head_dim)
    writer.add_rope_freq_base(attn.rope.theta)
    writer.add_layer_norm_rms_eps(spec.norm.eps)
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.router.top_k)
    writer.add_expert_feed_forward_length(moe.expert.intermediate)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens = [*SPECIAL, *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"t{i}" for i in range(len(tokens), spec.vocab_size)]
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, *[gguf.TokenType.BYTE] * 256]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens[: spec.vocab_size])
    writer.add_token_scores([0.0] * spec.vocab_size)
    writer.add_token_types((kinds + [gguf.TokenType.NORMAL] * spec.vocab_size)[: spec.vocab_size])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _tensor_names(model) -> Iterator[tuple[str, callable]]:
    """(GGUF name, getter) in file order; ``getter(shape_only=True)`` gives (shape, dtype) without reading."""
    weights = model.weights

    def plain(name: str):
        def get(shape_only: bool = False):
            dtype = np.float32 if len(weights.source(name).shape) == 1 else np.float16
            if shape_only:
                return tuple(weights.source(name).shape), dtype
            return weights[name].detach().float().numpy().astype(dtype)
        return get

    def stacked(layer: int, proj: str, experts: int):
        names = [f"layers.{layer}.moe.experts.{e}.{proj}.weight" for e in range(experts)]

        def get(shape_only: bool = False):
            if shape_only:
                return (experts, *weights.source(names[0]).shape), np.float16
            return np.stack([weights[n].detach().float().numpy().astype(np.float16) for n in names])
        return get

    yield TOP_NAMES["embed.weight"], plain("embed.weight")
    for i, layer in enumerate(model.spec.layers):
        for ours, theirs in LAYER_NAMES.items():
            if f"layers.{i}.{ours}" in weights:
                yield f"blk.{i}.{theirs}", plain(f"layers.{i}.{ours}")
        if isinstance(layer.ffn, MoESpec):
            for proj in ("gate", "up", "down"):
                yield f"blk.{i}.ffn_{proj}_exps.weight", stacked(i, proj, layer.ffn.num_experts)
    yield TOP_NAMES["norm.weight"], plain("norm.weight")
    yield TOP_NAMES["lm_head.weight"], plain("lm_head.weight")
