"""Process-wide patches of torch, each for the length of a context: each has a test in
``tests/unit/test_torch_compat.py`` that fails once torch no longer needs it."""
from __future__ import annotations

import contextlib
import importlib

import torch

from composer.torch_compat.names import (
    _FLEX_DEVICE_CHECK,
    _FLEX_MODULE,
    _NO_MODES,
    _SHARDING_META,
    resolved,
)


@contextlib.contextmanager
def sharding_meta_apart():
    """A context in which DTensor's sharding propagation runs apart from the active
    dispatch modes. It runs each new op once on fake tensors of the global shape to learn
    its output's; in a real run it makes a fake mode of its own for that, but under a dry
    run's fake mode it would run inside the memory tracker, which would count those
    global-shape tensors (the clip's gradient norms: every gradient unsharded)."""
    module, name = _SHARDING_META[0], _SHARDING_META[1].split(".")
    cls = getattr(importlib.import_module(module), name[0])
    original = getattr(cls, name[1])

    def apart(self, op_schema):
        with resolved(*_NO_MODES)():
            return original(self, op_schema)
    setattr(cls, name[1], apart)
    try:
        yield
    finally:
        setattr(cls, name[1], original)


@contextlib.contextmanager
def flex_backward_on_cpu():
    """A context in which FlexAttention takes CPU inputs that require grad. torch 2.13's
    eager flex_attention runs forward and backward on CPU exactly, but one device check
    refuses CPU inputs that require grad; that check (and only it) is lifted here, the
    others it makes still run."""
    module = importlib.import_module(_FLEX_MODULE)
    check = resolved(*_FLEX_DEVICE_CHECK)

    def validate_device(query, key, value):
        if query.device.type != "cpu":
            check(query, key, value)

    module._validate_device = validate_device
    try:
        yield
    finally:
        module._validate_device = check


def flex_refuses_cpu_backward() -> bool:
    """Whether this torch's FlexAttention still refuses CPU inputs that require grad (once
    it does not, ``flex_backward_on_cpu`` has nothing left to lift)."""
    query = torch.zeros(1, 1, 1, 1, requires_grad=True)
    try:
        resolved(*_FLEX_DEVICE_CHECK)(query, query, query)
    except NotImplementedError:
        return True
    return False
