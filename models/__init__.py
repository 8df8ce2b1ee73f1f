"""Registry of model families: name -> ModelSpec."""
from __future__ import annotations

from composer.spec import ModelSpec
from composer.models import llama, moe, qwen3

MODELS: dict[str, ModelSpec] = {"llama3": llama.spec, "moe": moe.spec, "qwen3": qwen3.spec, "qwen3_moe": qwen3.moe_spec}


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[name]
