"""One job as the planner sees it: the resolved config, the model's shape (or, where
its spec gives none, what a trace of it measured: ``composer.planner.trace``) and its
converted meta model, the degrees and the pipeline, checked by the same code as
training (``composer.job.plan``), before any process group exists."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, Callable

import torch
from torch import nn

from composer.config import ConfigError, JobConfig
from composer.converters import Converter, make_converters
from composer.job.plan import DTYPES, config_errors, plan_layout, resolve_model
from composer.mesh import ParallelDims
from composer.parallel.stages import PipelinePlan, stage_ids
from composer.parallel.tensor import names_match, plan_of
from composer.planner.trace import Profile, measure
from composer.spec import ModelSpec, TransformerShape


@dataclass(frozen=True)
class Param:
    """One parameter of the converted model, as the state and traffic rules read it."""

    fqn: str
    owner: str                     # the module holding it
    shape: tuple[int, ...]
    trainable: bool
    block: int | None              # the index of its block; None: the root
    expert: bool                   # a stacked MoE expert weight
    owner_weight: tuple[int, ...] | None  # the shape of its module's ``weight``
    head: bool = False             # a root parameter after the blocks (final norm, output)


@dataclass
class Model:
    """What every layout of one config shares: the spec, its arguments and shape,
    the meta model before and after the converters, and what the planner reads
    of the converted one (computed once, for every layout a search tries)."""

    spec: ModelSpec
    args: Any
    shape: TransformerShape | Profile  # the spec's, or the traced profile's sizes
    meta: nn.Module       # as built (the converters' checks read this one)
    converted: nn.Module  # after the converters (what the ranks hold)
    trace: Callable[[], Profile] | None = None  # the traced step, on demand

    @cached_property
    def traced(self) -> Profile | None:
        """The model's traced step: the profile of a model without a shape; for one with
        a shape, a trace made on first use (None where it cannot run: the time model then
        estimates the ops and their traffic from the shape)."""
        if self.profile is not None or self.trace is None:
            return self.profile
        try:
            return self.trace()
        except ValueError:
            return None

    @property
    def profile(self) -> Profile | None:
        """What the trace measured, for a model whose spec gives no shape."""
        return self.shape if isinstance(self.shape, Profile) else None

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs a token: the spec's formula, or those the trace counted (at the
        job's sequence length)."""
        if self.profile is not None:
            return self.profile.flops_per_token
        return self.spec.training.flops_per_token(self.args, seq_len)

    @cached_property
    def block_names(self) -> list[str]:
        return self.spec.block_names(self.converted)

    @cached_property
    def params(self) -> list[Param]:
        model, spec = self.converted, self.spec
        moe_modules = spec.parallel.moe_modules
        experts = {f"{n}.experts" for n in (moe_modules(model) if moe_modules else {})}
        modules = dict(model.named_modules())
        blocks = {name: i for i, name in enumerate(self.block_names)}
        out, seen_block = [], False
        for fqn, p in model.named_parameters():
            owner = fqn.rpartition(".")[0]
            block = next((i for name, i in blocks.items() if fqn.startswith(name + ".")), None)
            seen_block |= block is not None
            weight = getattr(modules[owner], "weight", None)
            out.append(Param(fqn, owner, tuple(p.shape), p.requires_grad, block, owner in experts,
                             None if weight is None else tuple(weight.shape),
                             head=block is None and seen_block))
        return out

    @cached_property
    def norm_weights_train(self) -> bool:
        """Whether the norms' weights (the decoder's one-dimensional parameters) train."""
        return any(p.trainable for p in self.params if len(p.shape) == 1)

    @cached_property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.converted.buffers())

    @cached_property
    def module_names(self) -> list[str]:
        return [name for name, _ in self.converted.named_modules()]

    def tp_styles(self, sequence_parallel: bool, loss_parallel: bool) -> dict[str, str]:
        """Module FQN -> the named TP style the spec's plan gives it."""
        key = (sequence_parallel, loss_parallel)
        cache = self.__dict__.setdefault("_tp_styles", {})
        if key not in cache:
            cache[key] = self._match_plan(*key)
        return cache[key]

    def _match_plan(self, sequence_parallel: bool, loss_parallel: bool) -> dict[str, str]:
        if self.spec.tp_plan is None:
            return {}
        plan = plan_of(self.spec.tp_plan, self.converted, sequence_parallel, loss_parallel)
        return {name: style if isinstance(style, str) else "replicated"
                for name in self.module_names for pattern, style in plan.items()
                if names_match(name, pattern)}


def compute_dtype(cfg: JobConfig) -> torch.dtype:
    """Activations' and gathered weights' dtype: the mixed-precision parameter dtype."""
    t = cfg.training
    return DTYPES[t.dtype if t.mixed_precision_param == "auto" else t.mixed_precision_param]


def load_model(cfg: JobConfig, device: torch.device = torch.device("cpu")) -> Model:
    """The job's model; traced where its spec gives no shape (ConfigError, one line,
    where the trace cannot run it)."""
    spec, args = resolve_model(cfg)
    meta = spec.build_meta(args)
    converted = copy.deepcopy(meta)
    with config_errors():
        for converter in make_converters(cfg.model.converters, cfg, spec, args,
                                         ParallelDims(1, 1, 1, 1, 1, 1, world_size=1), device):
            converter.convert(converted)
    model = Model(spec, args, None, meta, converted)
    model.trace = partial(_trace_once, cfg, model)
    model.shape = spec.training.shape(args) if spec.training.shape else _traced(cfg, model)
    return model


def _measure(cfg: JobConfig, model: Model) -> Profile:
    t = cfg.training
    return measure(model.spec, model.args, model.converted, model.tp_styles(True, True),
                   (compute_dtype(cfg), DTYPES[t.dtype]), t.local_batch_size, cfg.data.seq_len)


_TRACES: dict[tuple, Profile] = {}


def _trace_once(cfg: JobConfig, model: Model) -> Profile:
    """``_measure``, once a process for each model (its arguments, its converted modules
    and parameters), dtypes and micro-batch: a search, or a test, plans many layouts and
    configs of one model."""
    t = cfg.training
    key = (repr(model.args), repr(model.converted), compute_dtype(cfg), t.dtype,
           t.local_batch_size, cfg.data.seq_len,
           tuple((n, p.shape, p.dtype, p.requires_grad) for n, p in
                 model.converted.named_parameters()))
    if key not in _TRACES:
        _TRACES[key] = _measure(cfg, model)
    return _TRACES[key]


def _traced(cfg: JobConfig, model: Model) -> Profile:
    try:
        return _trace_once(cfg, model)
    except ValueError as e:
        raise ConfigError(f"model.name={cfg.model.name!r}: its spec gives no shape and the "
                          f"planner cannot trace it on fake tensors ({e}); give its "
                          f"ModelSpec.training.shape") from None


@dataclass
class Layout:
    """A job on ``dims``: everything the memory, traffic and time model read."""

    cfg: JobConfig
    model: Model
    dims: ParallelDims
    converters: list[Converter]
    pipeline: PipelinePlan | None
    accum: int
    device: str  # "cpu" or "cuda": which attention kernel and mask the ranks use

    @property
    def shape(self) -> TransformerShape | Profile:
        return self.model.shape

    @property
    def storage_bytes(self) -> int:
        return DTYPES[self.cfg.training.dtype].itemsize

    def _mixed(self, choice: str) -> int:
        return self.storage_bytes if choice == "auto" else DTYPES[choice].itemsize

    @property
    def compute_bytes(self) -> int:
        return compute_dtype(self.cfg).itemsize

    @property
    def reduce_bytes(self) -> int:
        return self._mixed(self.cfg.training.mixed_precision_reduce)

    @property
    def fsdp(self) -> bool:
        return self.dims.dp_enabled and self.cfg.parallelism.zero_stage >= 2

    @property
    def sequence_parallel(self) -> bool:
        return self.dims.tp > 1 and self.cfg.parallelism.sequence_parallel in (True, "auto")

    @property
    def loss_parallel(self) -> bool:
        return self.dims.tp > 1 and self.cfg.parallelism.loss_parallel

    @property
    def microbatches(self) -> int:
        return self.pipeline.microbatches if self.pipeline else 1

    @property
    def sequences(self) -> int:
        """Sequences one forward runs on (a pipeline microbatch)."""
        return self.cfg.training.local_batch_size // self.microbatches

    @property
    def tokens(self) -> int:
        """Tokens of this rank's slice of one forward (context parallel cuts the sequence)."""
        return self.sequences * self.cfg.data.seq_len // self.dims.cp

    @property
    def global_tokens(self) -> int:
        """Tokens one optimizer step trains on."""
        t = self.cfg.training
        return t.local_batch_size * self.dims.dp * self.accum * self.cfg.data.seq_len

    @property
    def tp_styles(self) -> dict[str, str]:
        """Module FQN -> its named TP style (TP runs only)."""
        if self.dims.tp == 1:
            return {}
        return self.model.tp_styles(self.sequence_parallel, self.loss_parallel)

    def checkpointed(self, index: int) -> bool:
        """Whether the rank's ``index``-th block runs its forward again in backward."""
        ac = self.cfg.activation_checkpoint
        if ac.mode in ("full", "selective_op"):
            return True
        return ac.mode == "selective_layer" and index % ac.every == ac.every - 1

    def stages(self) -> list[list[int]]:
        """Each pp rank's stage ids ([[0]] without pipeline parallel)."""
        if self.pipeline is None:
            return [[0]]
        per_rank = len(self.pipeline.ids)
        return [stage_ids(r, self.dims.pp, per_rank, self.pipeline.schedule)
                for r in range(self.dims.pp)]

    def stage_units(self, stage: int) -> list[str] | None:
        """The module FQNs stage ``stage`` owns (None: the whole model)."""
        return None if self.pipeline is None else self.pipeline.stage_units[stage]


def layout_of(cfg: JobConfig, model: Model, world_size: int, device: str) -> Layout:
    """Check ``cfg`` on ``world_size`` ranks as training would; ConfigError if invalid.
    ValueError for a traced model measured at another compute dtype or sequence length."""
    traced = model.profile
    if traced is not None and (traced.compute_dtype, traced.seq_len) != (
            compute_dtype(cfg), cfg.data.seq_len):
        raise ValueError(f"the model was traced at {traced.compute_dtype} and seq_len "
                         f"{traced.seq_len}, this job runs {compute_dtype(cfg)} and "
                         f"{cfg.data.seq_len}: load it for this job (load_model)")
    dims, converters, pipeline, accum = plan_layout(
        cfg, model.spec, model.args, model.meta, world_size, 0, torch.device("cpu"))
    return Layout(cfg, model, dims, converters, pipeline, accum, device)

