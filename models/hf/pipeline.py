"""Where a transformers model is cut into pipeline stages: between the modules its own
pipeline plan names (its config's ``base_model_pp_plan`` and its causal-LM class's
``_pp_plan``: the embedding, the decoder layers, the final norm, the head, and any dropout
between them), each decoder layer a unit of its own. A stage holds composer's
``PassThrough`` in place of each unit it lacks (transformers' forward calls every unit,
its decoder layers from an nn.ModuleList), so names and checkpoint keys stay transformers'.

Every stage runs transformers' forward, a later stage on the hidden states it receives
(as ``inputs_embeds``). That is right only where the base model's forward does nothing to
the hidden states beyond calling its units; ``pipeline_units`` checks it on a copy of the
meta model whose units (the embedding and head aside) are all pass-throughs: each must be
handed the ``inputs_embeds`` as they came, and the forward must return them so. A model
that scales its embeddings there (Granite's ``embedding_multiplier``), adds position
embeddings there, or whose decoder layers return tuples fails it and is refused.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from composer.spec import PassThrough

PREFIX = "lm."
INPUT, OUTPUT = ["input_ids"], ["logits"]  # what the embedding reads, what the head writes


def plan(lm: nn.Module) -> dict[str, tuple[list[str], list[str]]]:
    """transformers' pipeline plan of ``lm``: each unit's name (in ``lm``) -> (its inputs,
    its outputs), in forward order (the base model's plan as its config lists it, then the
    causal-LM class's head), one unit per decoder layer of an nn.ModuleList."""
    modules = dict(lm.named_modules())
    base = _base_prefix(lm)
    units = {}
    for name, (inputs, outputs) in sorted((lm.pp_plan or {}).items(),
                                          key=lambda item: not item[0].startswith(base)):
        if name not in modules:
            continue
        module = modules[name]
        names = ([f"{name}.{i}" for i in range(len(module))]
                 if isinstance(module, nn.ModuleList) else [name])
        units.update({n: (list(inputs), list(outputs)) for n in names})
    return units


def _base_prefix(lm: nn.Module) -> str:
    # none where transformers finds no base model under its prefix (Mllama's text model)
    return next((f"{name}." for name, m in lm.named_children() if m is lm.base_model), "")


def head_units(lm: nn.Module) -> list[str]:
    """The units of ``lm`` that write the logits (the causal-LM class's head)."""
    return [name for name, (_, outputs) in plan(lm).items() if outputs == OUTPUT]


def pipeline_units(model: nn.Module) -> list[str]:
    """The FQNs a pipeline cut of ``model`` (an ``HFCausalLM``) may fall between;
    ValueError, naming why, where transformers' forward cannot be cut there."""
    units = plan(model.lm)
    if not units:
        raise ValueError(f"transformers' {type(model.lm).__name__} declares no pipeline plan "
                         f"(base_model_pp_plan, _pp_plan)")
    base = _base_prefix(model.lm)
    _check_chain(model.lm, [n for n, (i, _) in units.items() if n.startswith(base) and i != INPUT])
    return [PREFIX + name for name in units]


def _check_chain(lm: nn.Module, chain: list[str]) -> None:
    """The base model's forward with each of its units in ``chain`` a pass-through hands each
    the ``inputs_embeds`` as they came, once and in order, and returns them so."""
    probe = copy.deepcopy(lm)
    seen: list[tuple[str, torch.Tensor]] = []
    for name in chain:
        unit = PassThrough()
        unit.register_forward_hook(lambda module, args, out, name=name: seen.append((name, out)))
        parent, _, attr = name.rpartition(".")
        setattr(probe.get_submodule(parent), attr, unit)
    like = next(lm.parameters())
    x = torch.zeros(1, 2, lm.config.get_text_config().hidden_size, dtype=like.dtype,
                    device=like.device)
    base = type(lm.base_model).__name__
    try:
        out = probe.base_model(inputs_embeds=x, use_cache=False).last_hidden_state
    except Exception as e:  # transformers' own code, with units it was not written for
        raise ValueError(f"transformers' {base} fails with pass-through units "
                         f"({type(e).__name__}: {e})") from None
    if [name for name, _ in seen] != chain:
        raise ValueError(f"transformers' {base} does not call its pipeline units once each, "
                         f"in order")
    changed = next((name for name, h in seen if h is not x), None)
    if changed is not None or out is not x:
        where = f"before {PREFIX}{changed}" if changed else "after its last unit"
        raise ValueError(f"transformers' {base} changes the hidden states outside its pipeline "
                         f"units ({where}), which every later stage would do again")
