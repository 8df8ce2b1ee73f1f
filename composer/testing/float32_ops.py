"""Where a float64 forward drops to float32: transformers forces float32 in some ops (a
norm's variance, eager attention's softmax, rotary tables), which bounds how closely any
two float64 runs of such a model can agree. ``Float32Ops`` records each op that takes a
float64 tensor and returns a float32 one, under the class of the module that ran it."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class Float32Ops(TorchFunctionMode):
    """``with Float32Ops() as ops: model(x)``, then ``ops.names()``: ``"<module class>:
    <op>"`` for each op that turned float64 into float32, in the order first seen."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, None] = {}
        self.stack: list[str] = ["(no module)"]
        self.hooks = []

    def __enter__(self):
        from torch.nn.modules import module
        self.hooks = [module.register_module_forward_pre_hook(self._enter),
                      module.register_module_forward_hook(self._leave)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)

    def _enter(self, module, args):
        self.stack.append(type(module).__name__)

    def _leave(self, module, args, out):
        self.stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (any(t.dtype == torch.float64 for t in _tensors((args, kwargs)))
                and any(t.dtype == torch.float32 for t in _tensors(out))):
            name = getattr(func, "__name__", str(func))
            self.seen.setdefault(f"{self.stack[-1]}: {name}", None)
        return out

    def names(self) -> list[str]:
        return list(self.seen)
