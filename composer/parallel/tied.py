"""Tied parameters (one Parameter reachable under several names, e.g. input and
output embeddings) survive neither ``to_empty`` nor ``parallelize_module``:
both hand each owning module its own new Parameter. Record the ties first,
restore them after."""
from __future__ import annotations

from torch import nn


def tied_groups(model: nn.Module) -> list[list[str]]:
    """FQNs that name the same Parameter, one list per shared Parameter."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Point every name of a group at the Parameter of its first name."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)
