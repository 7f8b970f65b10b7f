"""config.json checked before anything is allocated: one place for every family.

The adapters read configs trustingly (a family file should say what a key means, not police it),
so a config that cannot describe a model is refused here, with the key and the fix: a JSON list
instead of an object, a string where a size belongs, no layers, top-k beyond the expert count or
a non-positive norm epsilon would otherwise end in a traceback or run and print garbage.
"""

from __future__ import annotations

import math

from npumoe.core.base.errors import UnsupportedModelError, WeightError
from npumoe.core.ir.spec import ModelSpec, MoESpec

AT_LEAST_ONE = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts_per_tok",
                "max_position_embeddings", "decoder_sparse_step", "n_group", "topk_group")
AT_LEAST_ZERO = ("num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
                 "shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "sliding_window")
POSITIVE_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")
NUMBERS = ("routed_scaling_factor", "partial_rotary_factor", "router_jitter_noise", "swiglu_limit", "clip_qkv")
TYPED = {"model_type": str, "hidden_act": str, "rope_scaling": dict, "rope_parameters": dict,
         "quantization_config": dict, "layer_types": list, "mlp_only_layers": list}
# rope_scaling / rope_parameters: what each rope type reads, and the numbers any of them may hold
ROPE_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                 "longrope": ("short_factor",)}
ROPE_POSITIVE = ("factor", "rope_theta", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                 "attention_factor")
ROPE_NUMBERS = ("mscale", "mscale_all_dim", "long_mscale", "short_mscale")
ROPE_FACTOR_LISTS = ("short_factor", "long_factor")


def check_config(cfg: object, where: str = "config.json") -> dict:
    """The raw values every family reads: types and ranges, named as the file spells them."""
    if not isinstance(cfg, dict):
        raise UnsupportedModelError(f"{where} holds a JSON {type(cfg).__name__}, not an object; a Hugging Face "
                                    "config.json is one {...} object of settings.")
    for keys, least in ((AT_LEAST_ONE, 1), (AT_LEAST_ZERO, 0)):
        for key in _present(cfg, keys):
            if not _is_int(cfg[key]) or cfg[key] < least:
                raise _bad(where, key, cfg[key], f"a whole number ≥ {least}")
    for key in _present(cfg, (*POSITIVE_NUMBERS, *NUMBERS)):
        value = cfg[key]
        if not _is_number(value) or (key in POSITIVE_NUMBERS and value <= 0):
            raise _bad(where, key, value, "a positive number" if key in POSITIVE_NUMBERS else "a number")
    for key, kind in TYPED.items():
        if cfg.get(key) is not None and not isinstance(cfg[key], kind):
            raise _bad(where, key, cfg[key], f"a JSON {_JSON_NAMES[kind]}")
    eos = cfg.get("eos_token_id")
    if eos is not None and not (_is_int(eos) or isinstance(eos, list) and all(map(_is_int, eos))):
        raise _bad(where, "eos_token_id", eos, "a token id or a list of them")
    _check_rope(cfg, where)
    return cfg


# what sizes a model: each, times hidden_size, counts weights its checkpoint must store (a norm a layer, a row an
# expert or token, a matrix an intermediate size, a row block a head)
SIZES = ("num_hidden_layers", "num_experts", "num_local_experts", "n_routed_experts", "vocab_size", "intermediate_size",
         "moe_intermediate_size", "shared_expert_intermediate_size", "num_attention_heads", "num_key_value_heads",
         "head_dim")
WEIGHTS_PER_BYTE = 8  # at most: npumoe's 1-bit LUT format


def check_sizes(cfg: dict, stored_bytes: int, where: str = "config.json") -> None:
    """Refuse, before a spec is built, sizes no checkpoint of ``stored_bytes`` could hold: an edited
    num_hidden_layers of 10^8 would build 10^8 layer records (gigabytes) before the weights were found missing."""
    most = stored_bytes * WEIGHTS_PER_BYTE
    hidden = cfg["hidden_size"] if _present(cfg, ("hidden_size",)) else 1
    for key in _present(cfg, ("hidden_size", *SIZES)):
        if cfg[key] * (1 if key == "hidden_size" else hidden) > most:
            raise WeightError(f"{where}'s {key} is {cfg[key]}, more than the {stored_bytes / 1e6:,.1f} MB of weights "
                              "beside it could hold; the config and the weights do not match.")


def _check_rope(cfg: dict, where: str) -> None:
    """The rope settings, merged as the adapters merge them (rope_scaling over rope_parameters): every key its
    type reads is there, and every number is one (a linear rope without its factor was a KeyError)."""
    params = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}

    def section(key: str) -> str:
        return f"{'rope_scaling' if key in (cfg.get('rope_scaling') or {}) else 'rope_parameters'}.{key}"

    named_by = "rope_type" if params.get("rope_type") else "type"
    kind = params.get(named_by)
    for key in ROPE_REQUIRED.get(kind, ()) if isinstance(kind, str) else ():
        if params.get(key) is None:
            raise UnsupportedModelError(f"{where}: {section(named_by)} is {kind!r}, which needs {key!r}, but it has "
                                        "none; add it (the model card or the original config.json has it).")
    present = {k: v for k, v in params.items() if v is not None}
    for key in (k for k in ROPE_POSITIVE + ROPE_NUMBERS if k in present):
        if not _is_number(present[key]) or (key in ROPE_POSITIVE and present[key] <= 0):
            raise _bad(where, section(key), present[key], "a positive number" if key in ROPE_POSITIVE else "a number")
    for key in (k for k in ROPE_FACTOR_LISTS if k in present):
        factors = present[key]
        if not (isinstance(factors, list) and factors and all(_is_number(f) and f > 0 for f in factors)):
            raise _bad(where, section(key), factors, "a list of positive numbers")
    if "partial_rotary_factor" in present and not (_is_number(present["partial_rotary_factor"])
                                                   and 0 < present["partial_rotary_factor"] <= 1):
        raise _bad(where, section("partial_rotary_factor"), present["partial_rotary_factor"], "a number in (0, 1]")
    if "original_max_position_embeddings" in present and not (_is_int(present["original_max_position_embeddings"])
                                                              and present["original_max_position_embeddings"] >= 1):
        raise _bad(where, section("original_max_position_embeddings"), present["original_max_position_embeddings"],
                   "a whole number ≥ 1")


def check_spec(spec: ModelSpec, where: str = "config.json") -> ModelSpec:
    """What only the resolved spec shows, whichever spelling a family used: top-k against the expert
    count, query heads against key/value heads, expert groups against the experts."""
    for ls in spec.layers:
        att = ls.attention
        if att.num_heads % att.num_kv_heads:
            raise UnsupportedModelError(f"{where}: num_attention_heads ({att.num_heads}) is not a multiple of "
                                        f"num_key_value_heads ({att.num_kv_heads}); fix one of them.")
        rotated = att.rope.rotary_dim or (att.qk_rope_head_dim if att.kind == "mla" else att.head_dim)
        short = att.rope.p.get("short_factor") if att.rope.kind == "longrope" else None
        if short is not None and len(short) != rotated // 2:
            raise UnsupportedModelError(f"{where}: rope short_factor has {len(short)} values, but the {rotated} "
                                        f"rotated dims of a head take one per pair, {rotated // 2}; correct it.")
        if isinstance(ls.ffn, MoESpec):
            _check_routing(ls.ffn, where)
    return spec


def _check_routing(moe: MoESpec, where: str) -> None:
    experts, r = moe.num_experts, moe.router
    if not 1 <= r.top_k <= experts:
        raise UnsupportedModelError(f"{where}: num_experts_per_tok is {r.top_k}, but each MoE layer has {experts} "
                                    f"experts; set it between 1 and {experts}.")
    if experts % r.n_group or r.topk_group > r.n_group:
        raise UnsupportedModelError(f"{where}: n_group ({r.n_group}) must divide the {experts} experts and "
                                    f"topk_group ({r.topk_group}) must not exceed it; fix them.")


def _present(cfg: dict, keys) -> list[str]:
    """Keys set to a value (configs write null for 'not used', e.g. q_lora_rank)."""
    return [k for k in keys if cfg.get(k) is not None]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_JSON_NAMES = {str: "string", dict: "object", list: "list"}


def _bad(where: str, key: str, value, expected: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}: {key} is {value!r}, but it must be {expected}; correct it (the "
                                 "model card or the original config.json has the right value).")
