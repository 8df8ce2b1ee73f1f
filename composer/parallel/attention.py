"""The attention backend: SDPA or FlexAttention, set on a model's mask module and
attention cores (``ModelSpec.parallel.attention_mask``, ``attention_cores``), which
take it as their ``flex`` attribute; the model itself knows no config."""
from __future__ import annotations

import logging

import torch
from torch import nn

from composer.spec import held

log = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "flex")


def _cores(model: nn.Module, hooks) -> list[nn.Module] | None:
    """The model's attention cores and mask module; None where the spec names none, or
    where its ``attention_cores`` says a mask cannot reach every place the model mixes
    positions (an SSM layer; attention that computes its weights itself)."""
    if hooks.attention_cores is None or hooks.attention_mask is None:
        return None
    try:
        fqns = hooks.attention_cores(model)
    except ValueError:
        return None
    return [*(model.get_submodule(fqn) for fqn in held(model, fqns)),
            model.get_submodule(hooks.attention_mask)]


def _flex_modules(model: nn.Module, spec) -> list[nn.Module] | None:
    """The mask module and cores a backend is set on; None where any of them (or the
    spec) has no ``flex`` to set: a model whose attention takes no BlockMask."""
    modules = _cores(model, spec.parallel)
    return modules if modules is not None and all(hasattr(m, "flex") for m in modules) else None


def check_attention(choice: str, model: nn.Module, spec) -> None:
    """ValueError for a ``model.attention`` that is unknown, or ``flex`` on a model whose
    attention cannot take it (``model`` may be on the meta device: checked at start)."""
    if choice not in BACKENDS:
        raise ValueError(f"model.attention={choice!r}; allowed: {', '.join(BACKENDS)}")
    if choice == "flex" and _flex_modules(model, spec) is None:
        raise ValueError(f"model.attention='flex': model {spec.name!r} has attention that "
                         f"takes no FlexAttention block mask; allowed: auto, sdpa")


def choose_attention(choice: str, device: torch.device, model: nn.Module, spec) -> str:
    """``model.attention`` resolved: ``auto`` is FlexAttention on CUDA where the model's
    attention takes it (its fused kernel skips the blocks a mask hides), else SDPA;
    ValueError for ``flex`` on a model whose attention cannot take it."""
    check_attention(choice, model, spec)
    can_flex = _flex_modules(model, spec) is not None
    backend = choice if choice != "auto" else (
        "flex" if device.type == "cuda" and can_flex else "sdpa")
    log.info("attention: %s (model.attention=%s on %s)", backend, choice, device.type)
    return backend


def apply_attention(model: nn.Module, spec, backend: str, compiled: bool = False) -> None:
    """Set ``backend`` ("sdpa" or "flex") on the model's mask module and attention
    cores, as their ``flex`` (under flex, masks are BlockMasks and cores call
    FlexAttention) and, where blocks are ``compiled`` under SDPA, as the mask module's
    ``dense`` (one graph cannot loop over the documents' data-dependent spans)."""
    for module in _cores(model, spec.parallel) or []:
        if hasattr(module, "flex"):
            module.flex = backend == "flex"
        if hasattr(module, "dense"):
            module.dense = compiled and backend != "flex"
