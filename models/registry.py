"""model_type → adapter. A new family is one file plus one line here."""

from __future__ import annotations

import importlib

from npumoe.core.base.errors import UnsupportedModelError

ADAPTERS = {
    "deepseek_v3": "npumoe.models.deepseek_v3:DeepseekV3Adapter",
    "gpt_oss": "npumoe.models.gpt_oss:GptOssAdapter",
    "mixtral": "npumoe.models.mixtral:MixtralAdapter",
    "olmoe": "npumoe.models.olmoe:OlmoeAdapter",
    "phimoe": "npumoe.models.phimoe:PhimoeAdapter",
    "qwen2_moe": "npumoe.models.qwen2_moe:Qwen2MoeAdapter",
    "qwen3_moe": "npumoe.models.qwen3_moe:Qwen3MoeAdapter",
}


def adapter_for(model_type: str | None):
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(ADAPTERS))}."
        )
    module, cls = ADAPTERS[model_type].split(":")
    return getattr(importlib.import_module(module), cls)()
