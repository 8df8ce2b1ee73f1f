"""Subclasses of torch's classes that override torch's private methods: a hook after
nn.Module's ``_apply``, a ParallelStyle's ``_apply`` and linear partition, and MemTracker's
parameter tracking and peak update. ``tests/unit/test_torch_compat.py`` fails when one
of the overridden signatures changes."""
from __future__ import annotations

import functools
import importlib

from torch import nn

from composer.torch_compat.names import (
    _MEM_PEAK,
    _MEM_TOTAL,
    _MEM_TRACKED,
    _MEM_TRACKER,
    _MOD_TRACKER,
    _MODULE_APPLY,
    _MULTI_GRAD_HOOK,
    require,
    resolved,
)


class _NoHook:
    def remove(self) -> None:
        pass


@functools.cache
def _frozen_aware_tracker() -> type:
    resolved(*_MEM_TRACKED), resolved(*_MEM_PEAK)
    total = resolved(*_MEM_TOTAL)
    mod_tracker = importlib.import_module(_MOD_TRACKER)
    register = resolved(*_MULTI_GRAD_HOOK)

    class Tracker(resolved(*_MEM_TRACKER)):
        def _update_peak_stats(self, peak_state) -> None:
            for device, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snap[total]:
                    self._peak_mem[device] = snap[total]
                    self._peak_mem_snap[device] = dict(snap)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for p in module.parameters():
                if not p.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def __enter__(self):
            self._multi_grad_hooks = []

            def recorded(*args, **kwargs):
                handle = register(*args, **kwargs)
                self._multi_grad_hooks.append(handle)
                return handle
            mod_tracker.register_multi_grad_hook = recorded
            return super().__enter__()

        def __exit__(self, *args):
            try:
                super().__exit__(*args)
            finally:
                mod_tracker.register_multi_grad_hook = register
                for handle in self._multi_grad_hooks:
                    handle.remove()
                self._multi_grad_hooks.clear()
    return Tracker


def frozen_aware_mem_tracker():
    """A new MemTracker, used as a context around whole steps.

    It hooks the gradient of every parameter it meets (FSDP's gathered ones included),
    which a frozen one (LoRA's base) refuses: those are marked as hooked already. Its
    module tracker hangs a multi-grad hook on every module's inputs and outputs and
    drops the handle; the hook's closure holds the tensors' autograd nodes, and a node
    holds the hook: a cycle through C++ that Python's collector cannot see, which kept
    each step's graph, and through FSDP's hooks on it the device meshes and their gloo
    groups, alive for good. The tracker removes those hooks when it exits (the
    backward they wait for has run by then).

    Only the device's peak is kept: torch's tracker also updates every module's own
    peak on every op, a walk over all the modules that made a step's tracking grow with
    the square of the model's depth (composer reads none of them)."""
    tracker = _frozen_aware_tracker()()
    for name in ("_param_to_grad_hook_handles", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap"):
        require(tracker, name, ".".join(_MEM_TRACKER) + "." + name)
    return tracker


class AfterApplyHook:
    """Mixed in before nn.Module: the subclass's ``after_apply()`` runs after every
    conversion that replaces the module's tensors (``to``, ``to_empty``, ``double``, ...),
    all of which go through one private method of nn.Module."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        resolved(*_MODULE_APPLY)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.after_apply()
        return self


class StyleApplyHook:
    """Mixed in front of torch's ParallelStyle: the subclass's ``apply_style(module, mesh)``
    is what ``parallelize_module`` calls, through the style's own private method."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        styles = [c for c in cls.__mro__ if c.__module__.startswith("torch.")]
        if styles:
            require(styles[0], "_apply", f"{styles[0].__module__}.{styles[0].__qualname__}._apply")

    def _apply(self, module: nn.Module, device_mesh):
        return self.apply_style(module, device_mesh)


class LinearPartitionHook:
    """Mixed in front of torch's ColwiseParallel or RowwiseParallel: the subclass's
    ``partition_linear(name, module, device_mesh, partition)`` shards a linear in place of
    the style's own private partition function, which it receives as ``partition``."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        styles = [c for c in cls.__mro__ if c.__module__.startswith("torch.")]
        if styles:
            require(styles[0], "_partition_linear_fn",
                     f"{styles[0].__module__}.{styles[0].__qualname__}._partition_linear_fn")

    def _partition_linear_fn(self, name, module, device_mesh):
        return self.partition_linear(name, module, device_mesh, super()._partition_linear_fn)
