"""The converter interface: a feature that changes the model before the passes.

A converter is made once per job from its own config section and answers the
generic code's questions about itself, split by who asks: the build, the passes
and the trainer ask the ``Converter`` (the model transform), checkpoints and
exports its ``checkpoint`` (a ``CheckpointPolicy``), the planner its ``costs``
(``CostHints``). None of them ever names a converter. Override what applies;
every default leaves the model as it is.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from composer.config import JobConfig, config_from, register_section

Tensors = dict[str, Callable[[], torch.Tensor]]  # state-dict key -> the whole tensor, when called
Reference = Callable[[list[nn.Module]], contextlib.AbstractContextManager]  # parts -> a context


@dataclass(frozen=True)
class JobFacts:
    """What a converter may read of the job beyond its own section: the model
    family and its arguments, the layout, the device, and the whole config
    (read it, never write it)."""

    cfg: JobConfig
    spec: Any
    args: Any
    dims: Any
    device: torch.device


class CheckpointPolicy:
    """Which state-dict keys a converter adds, which a checkpoint step holds, and
    what a Hugging Face export is. Every default: the model's own keys, all saved,
    exported as they are."""

    def added(self, key: str) -> bool:
        """Whether the state-dict key ``key`` is one this converter adds (not part
        of the base model's weights, so not read from them)."""
        return False

    def saved(self) -> Callable[[str], bool] | None:
        """Which state-dict keys a checkpoint step holds (None: all of them)."""
        return None

    def export_key(self) -> str | None:
        """The config key that asks for a Hugging Face export at the end, if it is set."""
        return None

    def export_tensors(self, model: nn.Module, tensors: Tensors) -> Tensors:
        """What the exported weights are, given what they would be without it."""
        return tensors

    def export_extra(self, parts: list[nn.Module], folder: Path, step: int, adapter: Any,
                     dtype: torch.dtype, write: bool, files: list) -> Path | None:
        """What this converter writes at the end beside the Hugging Face export, under
        the checkpoint ``folder`` (every rank calls it; ``write``: this one writes; ``files``:
        the tokenizer's, to copy in); the path written, or None."""
        return None


class CostHints:
    """What the planner asks a converter about the converted model's bytes and
    FLOPs. Every default: as the training dtype says."""

    def gathered_itemsize(self, module: nn.Module, name: str) -> float | None:
        """Bytes per element in which FSDP2 all-gathers (and holds gathered) the
        parameter ``name`` of ``module`` of the converted model, where this
        converter changes them (None: the compute dtype's)."""
        return None

    def stored_itemsize(self, module: nn.Module, name: str) -> float | None:
        """Bytes per element in which the parameter ``name`` of ``module`` of the
        converted model is kept at rest, where this converter changes them (None:
        the storage dtype's)."""
        return None

    def matmul_dtype(self, module: nn.Module, name: str, gemm: str) -> str | None:
        """The dtype in which the GEMM ``gemm`` ("forward", "input_grad" or
        "weight_grad") of the parameter ``name`` of ``module`` (a linear of the
        converted model, or stacked experts) multiplies, where this converter changes
        it (None: the compute dtype). The planner times it at that dtype's peak."""
        return None

    def cast_bytes(self, module: nn.Module, name: str, gemm: str, itemsize: int) -> float:
        """Bytes this converter moves per element of each operand of that GEMM to cast
        it (from ``itemsize``-byte values), scaling's reductions included: time at
        the memory bandwidth (0: no cast)."""
        return 0.0

    def step_reduced_bytes(self, module: nn.Module, name: str) -> int:
        """Bytes the parameter ``name`` of ``module`` adds to one all-reduce over the
        FSDP shards after each optimizer step, where this converter issues one (0: none)."""
        return 0

    def unpacked_bytes(self, module: nn.Module, name: str, itemsize: int) -> float:
        """Bytes per element that the parameter ``name`` of ``module``, stored in a form
        of this converter's own, briefly takes when a matmul uses it (its unpacking's
        intermediates and result, ``itemsize`` the compute dtype's; 0: used as it is)."""
        return 0.0


class Converter:
    """The model transform. ``config``: the converter's own config section (an
    instance of its ``section`` dataclass, None without one); ``job``: the rest
    of what it may read. ``checkpoint`` and ``costs`` answer the checkpoint's and
    the planner's questions (the defaults change nothing)."""

    section: ClassVar[tuple[str, type] | None] = None  # (name, dataclass): its [name] keys
    # What preference tuning asks: where training leaves the converted model frozen
    # (adapters beside it), a function of the model parts giving a context in which
    # they compute that frozen model; None where training changes the model itself.
    reference: ClassVar[Reference | None] = None
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    costs: CostHints = CostHints()

    def __init__(self, config: Any, job: JobFacts):
        self.config, self.job = config, job
        self.cfg, self.spec, self.args = job.cfg, job.spec, job.args
        self.dims, self.device = job.dims, job.device

    def check(self, meta: nn.Module) -> None:
        """Raise ValueError naming the key, the value and what is allowed, for
        settings this converter cannot take (``meta``: the unconverted meta model)."""

    def convert(self, model: nn.Module) -> None:
        """Change ``model`` (on the meta device, before any pass) in place."""

    def init_added(self, model: nn.Module) -> None:
        """Draw what it added to ``model``, right after the model's own
        ``init_weights()`` (so the base weights are those of the model without it)."""

    def tp_styles(self, model: nn.Module, plan: dict, sequence_parallel: bool) -> dict:
        """The tensor-parallel plan (resolved styles) for the converted ``model``."""
        return plan

    def built(self, parts: list[nn.Module]) -> None:
        """Called once the model parts are parallelized and hold their weights."""

    def fsdp_view(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which FSDP2 wraps ``model``: what it shows FSDP2 of the
        weights it stores in a form of its own, so that FSDP2 gathers that form."""
        return contextlib.nullcontext()

    def weights_loaded(self, parts: list[nn.Module]) -> None:
        """Called once the parts hold their starting weights (drawn, or loaded from
        checkpoint.initial_load_path), before any step and any resume."""

    def after_step(self, parts: list[nn.Module]) -> None:
        """Called after every optimizer step."""


def saved_keys(converters: list[Converter]) -> Callable[[str], bool] | None:
    """The keys a checkpoint step holds, as the converters say (None: all)."""
    filters = [f for c in converters if (f := c.checkpoint.saved()) is not None]
    return (lambda key: all(f(key) for f in filters)) if filters else None


def added_keys(converters: list[Converter]) -> Callable[[str], bool]:
    """Whether a key is one a converter added (not part of the base weights)."""
    return lambda key: any(c.checkpoint.added(key) for c in converters)


def export_key(cfg: JobConfig, converters: list[Converter]) -> str | None:
    """The key that asks for a Hugging Face export at the end, if any does."""
    if cfg.checkpoint.last_save_in_hf:
        return "checkpoint.last_save_in_hf"
    return next((key for c in converters if (key := c.checkpoint.export_key())), None)


CONVERTERS: dict[str, type[Converter]] = {}


def register_converter(name: str, cls: type[Converter]) -> None:
    """Make ``cls`` available as ``model.converters = [name]``, and its config
    section (``cls.section``) settable. Converters run in the order they were
    registered (float8 before LoRA: a float8 base gets adapters)."""
    if cls.section is not None:
        register_section(*cls.section)
    CONVERTERS[name] = cls


def make_converters(names: list[str], cfg: JobConfig, spec: Any, args: Any, dims: Any,
                    device: torch.device) -> list[Converter]:
    """The job's converters in registration order, each given its own section;
    ValueError for an unknown name."""
    for name in names:
        if name not in CONVERTERS:
            raise ValueError(f"model.converters: unknown entry {name!r}; allowed: "
                             f"{', '.join(CONVERTERS)}")
    job = JobFacts(cfg, spec, args, dims, device)
    return [cls(getattr(cfg, cls.section[0]) if cls.section else None, job)
            for name, cls in CONVERTERS.items() if name in names]


def build_converters(names: list[str], spec: Any, args: Any, dims: Any,
                     device: torch.device | str = "cpu", **settings: dict) -> list[Converter]:
    """The converters ``names`` (``"float8"``, ``"lora"``, ``"qlora"``, or one you
    registered) for the model ``spec`` builds from ``args`` on the layout ``dims``,
    each with its own section's ``settings`` (``lora={"rank": 4}``: the keys of its
    TOML table, checked as those are), and each checked against the model, as the
    trainer checks them (ValueError naming the key, the value and what is allowed).
    The model is built in torch's default dtype.

    Your build then does what the trainer's does: ``convert(model)`` on every fresh
    meta model (before any pipeline cut), ``parallelize(..., converters=...)``,
    ``materialize(..., converters=...)``, ``weights_loaded(parts)`` once the weights
    are drawn or loaded (QLoRA quantizes them then) and ``after_step(parts)`` after
    every optimizer step (float8's all-gather scales).

    >>> import torch
    >>> from composer import ModelSpec, ParallelDims, build_converters, materialize
    >>> spec = ModelSpec("mlp", {"tiny": 8}, build=lambda d: torch.nn.Sequential(
    ...     torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d)), blocks=list)
    >>> dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    >>> lora = build_converters(["lora"], spec, 8, dims, lora={"rank": 2, "target_modules": ["2"]})
    >>> def build():
    ...     model = spec.build_meta(8)
    ...     for converter in lora:
    ...         converter.convert(model)
    ...     return model
    >>> model = build()
    >>> materialize(model, build, torch.device("cpu"), seed=0, converters=lora)
    >>> [name for name, p in model.named_parameters() if p.requires_grad]
    ['2.lora_a', '2.lora_b']
    >>> int(model[2].lora_b.count_nonzero())  # a fresh adapter adds nothing
    0
    """
    dtype = str(torch.get_default_dtype()).removeprefix("torch.")
    cfg = config_from({"model": {"name": spec.name, "converters": list(names)},
                       "training": {"dtype": dtype}, **settings})
    converters = make_converters(list(names), cfg, spec, args, dims, torch.device(device))
    meta = spec.build_meta(args)
    for converter in converters:
        converter.check(meta)
    return converters
