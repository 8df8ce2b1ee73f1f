"""Registry of model families: name -> ModelSpec."""
from __future__ import annotations

import importlib

from composer.models import llama, moe, qwen3
from composer.spec import ModelSpec

MODELS: dict[str, ModelSpec] = {"llama3": llama.spec, "moe": moe.spec, "qwen3": qwen3.spec,
                                "qwen3_moe": qwen3.moe_spec}


def get_model_spec(name: str) -> ModelSpec:
    """The registered family ``name``, or a user's spec written ``module:attribute``
    (a ModelSpec in an importable module)."""
    if ":" in name:
        module, _, attribute = name.partition(":")
        spec = getattr(importlib.import_module(module), attribute, None)
        if not isinstance(spec, ModelSpec):
            raise KeyError(f"{module}.{attribute} is not a ModelSpec")
        return spec
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}; "
                       f"or a spec of your own as 'module:attribute'")
    return MODELS[name]
