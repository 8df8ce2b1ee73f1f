"""Tensor parallel, sequence parallel and loss parallel, from a model's plan.

The plan maps module FQNs (``*`` matches any one name, e.g. ``layers.*.attention.wq``)
to styles: names a model's plan gives as data (``STYLES``), resolved here, or
DTensor ParallelStyles a user's own spec hands directly. Column-wise linears
shard their output features, row-wise ones their input features and end in a
reduction; with sequence parallel the norms work on a 1/tp slice of the
sequence, which turns each all-reduce into a reduce-scatter plus an
all-gather. With loss parallel the logits stay sharded on the vocabulary and
the cross-entropy is computed without gathering them
(``torch.distributed.tensor.parallel.loss_parallel``).
"""
from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from composer import torch_compat
from composer.parallel.expert import local_parameters
from composer.parallel.stream import Gathered, OnStream, ReplicateInput, Sliced
from composer.parallel.tied import retie, tied_groups
from composer.spec import PassThrough, names_match

log = logging.getLogger(__name__)


def matching(model: nn.Module, pattern: str) -> list[nn.Module]:
    """The modules a plan key names (not a pipeline stage's stand-ins for the units it
    lacks)."""
    return [m for name, m in model.named_modules()
            if names_match(name, pattern) and not isinstance(m, PassThrough)]


STYLES = {
    "colwise": "a linear that shards its output features (input replicated)",
    "rowwise": "a linear that shards its input features and writes the residual stream "
               "(all-reduce; reduce-scatter with sequence parallel)",
    "embedding": "an embedding sharded on the vocabulary, writing the residual stream",
    "output": "the output projection, column-wise on the vocabulary, reading the residual "
              "stream (its logits stay sharded with loss parallel)",
    "norm": "a module on the residual stream itself (sequence-sharded with sequence parallel)",
    "replicate_input": "a module whose first input (positional or by name) is the residual "
                       "stream, made whole for it",
    "gathered": "a module run unsharded on the whole sequence, keeping its slice of the "
                "output (with sequence parallel; nothing otherwise)",
    "sliced": "a module whose input is whole already (an input embedding the plan does not "
              "cut), run unsharded, keeping its slice of the output (with sequence parallel; "
              "nothing otherwise)",
    "head_norm": "a norm whose one weight serves every head, run on a rank's heads (dim 2 of "
                 "[batch, seq, heads, head_dim]): its gradient is summed over tp",
    "colwise_gathered": "a column-wise linear inside a block whose output is gathered whole "
                        "(the modules after it run unsharded)",
    "rowwise_split_input": "a row-wise linear reading a whole input, which it splits, and writing "
                           "the residual stream",
    "packed_colwise": "a column-wise linear whose output features are two equal parts packed one "
                      "after the other (a fused [gate; up]): each rank holds its slice of both",
    "experts": "stacked experts called as experts(tokens sorted by expert, tokens per expert), "
               "each rank running its slice of every expert's hidden features (the module's "
               "tp_cut: parameter -> (dim, packed parts)) on the whole input, the outputs "
               "summed over tp",
}


# The dim of its module's weight that each named style shards: the output features (0) or
# the input features (-1). A column-wise module's bias is sharded with its output features.
SHARDED_DIM = {"colwise": 0, "colwise_gathered": 0, "packed_colwise": 0, "output": 0,
               "embedding": 0, "rowwise": -1, "rowwise_split_input": -1}


def sharded_dim(style: str | None, shape: tuple[int, ...],
                weight: tuple[int, ...] | None) -> int | None:
    """The dim of a parameter (of ``shape``) that tensor parallel shards, in a module the
    plan styles ``style`` whose weight has shape ``weight``; None where it stays whole
    (a row-wise module's bias, a weight of its own such as LoRA's factors)."""
    dim = SHARDED_DIM.get(style)
    if dim is None or weight is None or not shape or (dim == -1 and len(shape) < len(weight)):
        return None
    return dim if shape[dim] == weight[dim] else None


class PackedColwise(torch_compat.StyleApplyHook, ParallelStyle):
    """A column-wise linear whose output features are ``parts`` equal parts packed one
    after another ([gate; up]): each rank holds its slice of every part, so the module's
    own forward, run on its local shards, splits its output into this rank's slice of each
    part. Its input is replicated; the input's gradient, partial, is summed over tp."""

    def __init__(self, parts: int = 2):
        self.parts = parts

    def apply_style(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        placement = torch_compat.strided_shard(0, self.parts)
        for name, p in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(p.data, mesh, [placement])
            module.register_parameter(name, nn.Parameter(sharded, p.requires_grad))
        module.__class__ = _packed_class(type(module))
        module.tp_mesh = mesh
        return module


class _PackedLinear:
    """Mixed into a packed linear's class by ``PackedColwise``."""

    tp_mesh: DeviceMesh

    def forward(self, x):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.tp_mesh, (Replicate(),), run_check=False)
        x = x.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))
        with local_parameters(self, 1.0):
            return super().forward(x)


_PACKED: dict[type, type] = {}


def _packed_class(cls: type) -> type:
    if cls not in _PACKED:
        _PACKED[cls] = type(f"Packed{cls.__name__}", (_PackedLinear, cls), {})
    return _PACKED[cls]


class _SumForward(torch.autograd.Function):
    """All-reduce (sum) over ``group``; the gradient passes as it is."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumBackward(torch.autograd.Function):
    """The input as it is; its gradient, partial on each rank, summed over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SlicedExperts(torch_compat.StyleApplyHook, ParallelStyle):
    """Stacked experts, each parameter cut as the module's ``tp_cut`` says: every rank
    runs its slice of each expert's hidden features on the whole input, and the partial
    outputs are summed over tp (the input's partial gradients likewise)."""

    def apply_style(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name, (dim, parts) in module.tp_cut.items():
            p = module.get_parameter(name)
            placement = torch_compat.strided_shard(dim, parts) if parts > 1 else Shard(dim)
            sharded = distribute_tensor(p.data, mesh, [placement])
            module.register_parameter(name, nn.Parameter(sharded, p.requires_grad))
        module.__class__ = _sliced_class(type(module))
        module.tp_group = mesh.get_group()
        return module


class _Sliced:
    """Mixed into an experts module's class by ``SlicedExperts``."""

    tp_group: dist.ProcessGroup

    def forward(self, tokens, counts):
        tokens = _SumBackward.apply(tokens, self.tp_group)
        with local_parameters(self, 1.0):
            out = super().forward(tokens, counts)
        return _SumForward.apply(out, self.tp_group)


_SLICED: dict[type, type] = {}


def _sliced_class(cls: type) -> type:
    if cls not in _SLICED:
        _SLICED[cls] = type(f"Sliced{cls.__name__}", (_Sliced, cls), {})
    return _SLICED[cls]


def _named_style(name: str, sp: bool, lp: bool) -> ParallelStyle | None:
    seq = Shard(1) if sp else Replicate()
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel(output_layouts=seq)
    if name == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if name == "output":
        return ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if lp else Replicate(),
                               use_local_output=not lp)
    if name == "norm":  # its output local: a norm may write the residual stream (Gemma's)
        return OnStream() if sp else None
    if name == "replicate_input":
        return ReplicateInput(seq)
    if name == "colwise_gathered":
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if name == "packed_colwise":
        return PackedColwise()
    if name == "experts":
        return SlicedExperts()
    if name == "head_norm":  # a replicated weight on head-sharded input: partial grads, reduced
        return OnStream(dim=2)
    if name == "gathered":
        return Gathered() if sp else None
    if name == "sliced":
        return Sliced() if sp else None
    raise ValueError(f"tensor-parallel style {name!r} is unknown; allowed: {', '.join(STYLES)}")


def plan_of(plan, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """A spec's plan as data: a dict as it is, or what its function returns for this
    setting, a function of (sequence_parallel, loss_parallel) or, where the plan depends on
    the model, of (sequence_parallel, loss_parallel, model) (``model`` on the meta device,
    or a pipeline stage of it)."""
    if not callable(plan):
        return plan
    if len(inspect.signature(plan).parameters) == 3:
        return plan(sequence_parallel, loss_parallel, model)
    return plan(sequence_parallel, loss_parallel)


def resolve_plan(model: nn.Module, plan, sequence_parallel: bool,
                 loss_parallel: bool) -> dict[str, ParallelStyle]:
    """A spec's plan (data, or a function: ``plan_of``) as DTensor styles for ``model``;
    named styles that do nothing in this setting are left out."""
    out = {}
    for key, style in plan_of(plan, model, sequence_parallel, loss_parallel).items():
        if isinstance(style, str):
            style = _named_style(style, sequence_parallel, loss_parallel)
        if style is not None:
            out[key] = style
    return out


def _matches(model: nn.Module, pattern: str) -> bool:
    return bool(matching(model, pattern))


def check_plan(model: nn.Module, plan: dict[str, ParallelStyle], optional: tuple = ()) -> None:
    """Every plan key but the ``optional`` ones must name a module: a typo would
    silently leave it unsharded."""
    missing = [key for key in plan if key not in optional and not _matches(model, key)]
    if missing:
        raise ValueError(f"tensor-parallel plan entries match no module: {', '.join(missing)}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle],
             strict: bool = True, optional: tuple = ()) -> None:
    """Shard ``model`` over ``tp_mesh`` as ``plan`` says; tied weights stay tied.
    ``strict``: every entry but the ``optional`` ones must match; entries that
    match nothing are dropped."""
    if strict:
        check_plan(model, plan, optional)
    plan = {key: style for key, style in plan.items() if _matches(model, key)}
    groups = tied_groups(model)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    parallelize_module(model, tp_mesh, plan)
    # torch 2.13's SequenceParallel makes every parameter it replaces trainable
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    for names in groups:
        layouts = {str(getattr(model.get_parameter(n), "placements", None)) for n in names}
        if len(layouts) > 1:
            raise ValueError(f"tied parameters {', '.join(names)} get different tensor-parallel "
                             f"layouts ({', '.join(sorted(layouts))}); shard them alike")
    retie(model, groups)
    log.info("applied tensor parallel x%d to %d plan entries", tp_mesh.size(), len(plan))


def check_tp(tp: int, spec, args, label: str, seq_len: int, sequence_parallel: bool,
             zero_stage: int) -> None:
    """ValueError (naming the key) unless ``tp`` divides every size it splits
    (``label``: the model and flavor, for the message)."""
    key = f"parallelism.tensor_parallel_degree={tp}"
    if spec.tp_plan is None:
        raise ValueError(f"{key}: model {spec.name!r} has no tensor-parallel plan; allowed: 1")
    for name, size in spec.parallel.tp_divisible(args).items():
        if size % tp:
            raise ValueError(f"{key} does not divide the model's {name}={size} ({label})")
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"{key} does not divide data.seq_len={seq_len}, which sequence "
                         f"parallel splits")
    if zero_stage == 1:
        raise ValueError(f"{key}: parallelism.zero_stage=1 shards plain tensors only; allowed "
                         f"with tensor parallel: zero_stage 0, 2, 3")


def check_tp_styles(tp: int, spec, meta: nn.Module, sequence_parallel: bool,
                    loss_parallel: bool, checkpoint: bool) -> None:
    """ValueError (naming the key, the module pattern and the style) where the spec's plan
    for ``meta`` cannot be made, names a style composer does not know, or packs a bias or,
    with ``checkpoint`` (DCP steps), anything (DCP cannot save a packed weight's layout)."""
    key = f"parallelism.tensor_parallel_degree={tp}"
    try:
        plan = plan_of(spec.tp_plan, meta, sequence_parallel, loss_parallel)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    for pattern, style in plan.items():
        if isinstance(style, str) and style not in STYLES:
            raise ValueError(f"{key}: the tensor-parallel plan gives {pattern!r} the style "
                             f"{style!r}, which composer does not know; allowed: "
                             f"{', '.join(STYLES)}")
        if style == "packed_colwise":
            _check_packed(key, pattern, matching(meta, pattern), checkpoint)
        if style == "experts" and checkpoint and any(
                parts > 1 for m in matching(meta, pattern) for _, parts in m.tp_cut.values()):
            raise ValueError(f"checkpoint.enable=true: {pattern!r} is experts with packed "
                             f"weights, whose layout (a strided shard) torch's DCP cannot save; "
                             f"allowed: false, or parallelism.tensor_parallel_degree=1")


def _check_packed(key: str, pattern: str, modules: list[nn.Module], checkpoint: bool) -> None:
    if any(p.dim() < 2 for m in modules for p in m.parameters(recurse=False)):
        raise ValueError(f"{key}: {pattern!r} is packed_colwise and has a bias; composer packs "
                         f"weights only (FSDP2 would lose a packed bias's layout)")
    if checkpoint:
        raise ValueError(f"checkpoint.enable=true: {pattern!r} is packed_colwise, whose layout "
                         f"(a strided shard) torch's DCP cannot save; allowed: false, or "
                         f"parallelism.tensor_parallel_degree=1")


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Reduce gradients DTensor left as partial sums (weights replicated over tp
    whose inputs were sharded, e.g. sequence-parallel norms) once, here: left
    partial, every optimizer op that reads them would reduce them again."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)
