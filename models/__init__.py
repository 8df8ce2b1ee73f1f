"""The registry of model families: name -> ModelSpec.

composer's own families register here exactly as a user's do, through
``register_model``. ``model.name`` is a registered name, or ``"module:attribute"``:
a ModelSpec (or a function returning one) in a module on the Python path, which is
imported, so its code runs.

Imports: torch_compat, spec.
"""
from __future__ import annotations

import difflib
import importlib

from composer.models import hf, llama, moe, qwen3
from composer.spec import ModelSpec

MODELS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, name: str | None = None) -> ModelSpec:
    """Make ``spec`` trainable as ``model.name = name`` (default: ``spec.name``);
    returns it. Registering the same name again replaces the spec (a reloaded module).
    (A spec in an importable module also trains unregistered, as ``model.name =
    "module:attribute"``.)

    >>> from torch import nn
    >>> from composer import ModelSpec, register_model
    >>> spec = register_model(ModelSpec("my_mlp", {"tiny": 8}, build=lambda d: nn.Linear(d, d),
    ...                                 blocks=lambda model: [model]))
    >>> spec.name  # python -m composer.train --model.name my_mlp trains it now
    'my_mlp'
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register_model takes a ModelSpec, not {type(spec).__name__}")
    MODELS[name or spec.name] = spec
    return spec


for _spec in (llama.spec, moe.spec, qwen3.spec, qwen3.moe_spec, hf.spec):
    register_model(_spec)


def _from_module(name: str) -> ModelSpec:
    module, _, attribute = name.partition(":")
    found = importlib.import_module(module)  # parse_args imported it already, or says why not
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise KeyError(f"module {module!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if callable(found) and not isinstance(found, (ModelSpec, type)):
        try:
            made = found()
        except Exception as e:  # the user's code: its failure, in one line
            raise KeyError(f"{module}.{attribute}() failed: {type(e).__name__}: {e}") from None
        if isinstance(made, ModelSpec):
            return made
        raise KeyError(f"{module}.{attribute}() returned a {type(made).__name__}, not a ModelSpec")
    if not isinstance(found, ModelSpec):
        raise KeyError(f"{module}.{attribute} is a {type(found).__name__}, not a ModelSpec "
                       f"(nor a function returning one)")
    return found


def get_model_spec(name: str) -> ModelSpec:
    """The registered family ``name``, or the ModelSpec ``module:attribute`` names;
    KeyError with the reason (and the nearest registered name) otherwise."""
    if ":" in name:
        return _from_module(name)
    if name not in MODELS:
        close = difflib.get_close_matches(name, list(MODELS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(f"unknown model {name!r}{hint}; registered: {', '.join(sorted(MODELS))}; "
                       f"or a spec of your own as 'module:attribute'")
    return MODELS[name]
