"""Styles for modules on the residual stream, which sequence parallel cuts on the
sequence: a module made whole for the stream's slice (``ReplicateInput``), run whole
keeping its slice (``Gathered``), one whose input is whole already keeping its slice of
the output (``Sliced``, where the stream starts), and one working on each position alone
(``OnStream``: a norm, a residual gate). Their names in a plan are ``tensor.STYLES``."""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from composer import torch_compat


class ReplicateInput(torch_compat.StyleApplyHook, ParallelStyle):
    """The module's first input, the residual stream in ``layout``, as a replicated DTensor,
    whether it comes positionally or by the name of its forward's first parameter
    (transformers' decoder layers call their attention with keywords)."""

    def __init__(self, layout: Placement):
        self.layout = layout

    def _whole(self, x, mesh: DeviceMesh) -> DTensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.layout,), run_check=False)
        return x.redistribute(placements=(Replicate(),))

    def apply_style(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        name = next(iter(inspect.signature(module.forward).parameters))

        def whole_first_input(_, args, kwargs):
            if args:
                return (self._whole(args[0], mesh), *args[1:]), kwargs
            return args, {**kwargs, name: self._whole(kwargs[name], mesh)}

        module.register_forward_pre_hook(whole_first_input, with_kwargs=True)
        return module


def _keep_slice(module: nn.Module, mesh: DeviceMesh) -> None:
    """The module's output, whole on every rank, cut to this rank's slice of the sequence:
    of a tuple, the first and each other tensor with its batch and sequence dims (a hyper
    connection's mixing weights beside its stream; not an MoE's per-token router logits)."""
    def mine(x: torch.Tensor) -> torch.Tensor:
        whole = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return whole.redistribute(placements=(Shard(1),)).to_local()

    def slice_of_output(_, args, kwargs, out):
        if not isinstance(out, tuple):
            return mine(out)
        lead = out[0].shape[:2]
        return (mine(out[0]), *(mine(x) if isinstance(x, torch.Tensor) and x.dim() > 1
                                and x.shape[:2] == lead else x for x in out[1:]))

    module.register_forward_hook(slice_of_output, with_kwargs=True)


class Gathered(ReplicateInput):
    """A module run whole on the gathered sequence (its first input, positional or by name,
    the residual stream's slice), keeping its slice of the output (``_keep_slice``); its
    other inputs pass as they are."""

    def __init__(self):
        super().__init__(Shard(1))

    def apply_style(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        super().apply_style(module, mesh)
        _keep_slice(module, mesh)
        return module

    def _whole(self, x, mesh: DeviceMesh) -> torch.Tensor:
        return super()._whole(x, mesh).to_local()


class Sliced(torch_compat.StyleApplyHook, ParallelStyle):
    """A module whose input is whole on every rank already (the token ids an uncut input
    embedding reads), run as it is, keeping its slice of the output: where the residual
    stream starts, sequence-sharded."""

    def apply_style(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        _keep_slice(module, mesh)
        return module


class OnStream(torch_compat.StyleApplyHook, ParallelStyle):
    """A module that works on each position alone (a norm; a residual gate given the
    branch and the stream): its parameters replicated, each tensor it is given
    positionally (this rank's slice of the sequence, cut on ``dim``) as a DTensor so cut,
    its output local. Every input is, where torch's SequenceParallel takes the first."""

    def __init__(self, dim: int = 1):
        self.placements = (Shard(dim),)

    def _cut(self, x, mesh: DeviceMesh):
        if isinstance(x, DTensor):
            return x if x.placements == self.placements else x.redistribute(
                placements=self.placements)
        if isinstance(x, torch.Tensor):
            return DTensor.from_local(x, mesh, self.placements, run_check=False)
        return x

    def apply_style(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def replicate(name, owner, mesh):  # norms' weights start equal on every rank
            for p_name, p in list(owner.named_parameters(recurse=False)):
                owner.register_parameter(p_name, nn.Parameter(
                    DTensor.from_local(p, mesh, [Replicate()], run_check=False), p.requires_grad))

        def local(out):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(
            module, mesh, replicate,
            lambda m, inputs, mesh: tuple(self._cut(x, mesh) for x in inputs),
            lambda m, out, mesh: tuple(map(local, out)) if isinstance(out, tuple) else local(out))
