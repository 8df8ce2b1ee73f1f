"""LoRA: trainable low-rank adapters on chosen linears of a frozen model
(``model.converters = ["lora"]``, section ``lora``).

A target linear keeps its weight W, frozen, and gains two trainable matrices
``lora_a`` [rank, in] and ``lora_b`` [out, rank]:

    y = x W^T + (alpha / rank) * dropout(x) A^T B^T

A is drawn like a linear's weight and B starts at zero, so a fresh adapter
adds exactly nothing: step 0 is the base model's. The adapters are parameters
of the linear itself (its class gains a LoRA subclass), so the base keeps its
FQNs (checkpoint and Hugging Face names still apply) and the adapters are
``<linear>.lora_a`` / ``<linear>.lora_b``. Every other parameter is frozen.

Tensor parallel: the adapter of a column-wise linear shards B's rows (its
output features) and replicates A; that of a row-wise linear shards A's
columns (input features) and replicates B, so its partial sums join the
base's before the one reduction the base does anyway. No activation moves
beyond the base's; only the gradient of the replicated matrix (rank x in or
out x rank) is summed over tp once per step.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from composer import torch_compat
from composer.checkpoint.hf import adapter_of
from composer.checkpoint.peft import check_peft, export_peft, load_peft
from composer.config import bounded, choice
from composer.converters.base import CheckpointPolicy, Converter, Tensors
from composer.parallel.materialize import full_tensor
from composer.parallel.tensor import matching
from composer.parallel.tied import tied_groups

log = logging.getLogger(__name__)

ADAPTERS = ("lora_a", "lora_b")


@dataclass
class Lora:
    """LoRA and QLoRA adapters (``model.converters = ["lora"]`` or ``["qlora"]``)."""

    rank: int = bounded(8, 1, help="the adapters' rank r: lora_a maps a linear's input to r "
                                   "features, lora_b those to its output")
    alpha: float = bounded(16.0, 0.0, help="the adapters' output is scaled by alpha / rank")
    dropout: float = bounded(0.0, 0.0, 0.9, help="dropout on the adapters' input")
    target_modules: list = field(default_factory=list, metadata={
        "help": "linears that get adapters, by their last name; empty: the model's own "
                "choice (llama3, qwen3: wq, wk, wv, wo)"})
    export: str = choice("", ("", "peft"), "peft: at the end, write the adapters as a PEFT "
                         "folder (<checkpoint.folder>/step-N-peft), what peft and vLLM load "
                         "beside the base model")
    initial_adapter: str = field(default="", metadata={
        "help": "a PEFT LoRA folder to start the adapters from (its rank and alpha are the "
                "run's); a resumed step's adapters replace it"})
    merge_on_export: bool = field(default=False, metadata={
        "help": "at the end, fold the adapters into the base and export Hugging Face "
                "safetensors (<checkpoint.folder>/step-N-hf)"})
    quantize_output: bool = field(default=False, metadata={
        "help": "qlora: store the output head in NF4 too (the blocks' linears always are)"})


def is_adapter(name: str) -> bool:
    """Whether the parameter (or state-dict key) ``name`` is a LoRA adapter matrix."""
    return name.rsplit(".", 1)[-1] in ADAPTERS


def has_adapter(module: nn.Module) -> bool:
    return isinstance(module, LoRAMixin)


class LoRAMixin:
    """The adapter path, mixed in front of a linear's own class (plain or float8)."""

    lora_scale: float
    lora_dropout: float
    lora_off = False  # True inside ``adapters_off``: the linear is its base alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.lora_off:
            return out
        if self.lora_dropout > 0 and self.training:
            x = F.dropout(x, self.lora_dropout)
        return out + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.lora_scale

    @torch.no_grad()
    def init_adapter(self) -> None:
        """A as ``nn.Linear`` draws its weight, B zero."""
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, lora_rank={self.lora_a.shape[0]}, "
                f"lora_scale={self.lora_scale}")


@functools.cache
def _lora_class(cls: type) -> type:
    return type(f"LoRA{cls.__name__}", (LoRAMixin, cls), {})


def add_adapter(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Give ``linear`` (on any device, meta included) an adapter, uninitialised
    (``init_adapter`` draws it)."""
    w = linear.weight
    linear.__class__ = _lora_class(type(linear))
    linear.lora_a = nn.Parameter(torch.empty(rank, linear.in_features,
                                             device=w.device, dtype=w.dtype))
    linear.lora_b = nn.Parameter(torch.empty(linear.out_features, rank,
                                             device=w.device, dtype=w.dtype))
    linear.lora_scale = alpha / rank
    linear.lora_dropout = dropout


@contextlib.contextmanager
def adapters_off(parts: list[nn.Module]):
    """A context in which every adapted linear of ``parts`` computes its base alone: the
    frozen model the adapters were added to (DPO's reference), with no second copy."""
    linears = [m for part in parts for m in part.modules() if has_adapter(m)]
    for linear in linears:
        linear.lora_off = True
    try:
        yield
    finally:
        for linear in linears:
            del linear.lora_off


def targets(model: nn.Module, names: list[str]) -> list[str]:
    """FQNs of the linears whose last name is in ``names``."""
    return [fqn for fqn, m in model.named_modules()
            if isinstance(m, nn.Linear) and fqn.rsplit(".", 1)[-1] in names]


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linears (what ``target_modules`` may list)."""
    return sorted({fqn.rsplit(".", 1)[-1] for fqn, m in model.named_modules()
                   if isinstance(m, nn.Linear)})


def convert_lora(model: nn.Module, cfg: Lora, default_targets: tuple[str, ...] = ()) -> list[str]:
    """Freeze ``model`` and add adapters to its target linears (``cfg.target_modules``,
    or ``default_targets`` when that is empty); returns their FQNs."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = targets(model, cfg.target_modules or list(default_targets))
    for fqn in names:
        add_adapter(model.get_submodule(fqn), cfg.rank, cfg.alpha, cfg.dropout)
    return names


def init_adapters(model: nn.Module) -> None:
    """Draw every adapter of ``model``, in module order."""
    for module in model.modules():
        if has_adapter(module):
            module.init_adapter()


def init_with_adapters(model: nn.Module) -> None:
    """``materialize``'s ``init`` for a model given adapters by hand: its own
    weights, then the adapters."""
    model.init_weights()
    init_adapters(model)


def log_trainable(parts: list[nn.Module], cfg: Lora) -> None:
    """One line: how many linears got adapters and how much of the model trains."""
    params = [p for part in parts for p in part.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    linears = sum(has_adapter(m) for part in parts for m in part.modules())
    log.info("lora: rank %d, alpha %g on %d linears: %s of %s parameters trainable (%.2f%%)",
             cfg.rank, cfg.alpha, linears, f"{trainable:,}", f"{total:,}", 100 * trainable / total)


class _LoRAPartition(torch_compat.LinearPartitionHook):
    """Mixed in front of a Colwise/RowwiseParallel: the base weight is sharded as
    the style says (``partition``), the adapters as the module docstring says."""

    def partition_linear(self, name, module, device_mesh, partition):
        own = torch_compat.own_parameters(module)
        adapters = {n: own.pop(n) for n in ADAPTERS if n in own}
        partition(name, module, device_mesh)
        colwise = isinstance(self, ColwiseParallel)
        layouts = {"lora_a": Replicate() if colwise else Shard(1),
                   "lora_b": Shard(0) if colwise else Replicate()}
        for n, p in adapters.items():
            sharded = distribute_tensor(p, device_mesh, [layouts[n]],
                                        src_data_rank=self.src_data_rank)
            module.register_parameter(n, nn.Parameter(sharded, requires_grad=p.requires_grad))


@functools.cache
def _lora_style(cls: type) -> type:
    return type(f"LoRA{cls.__name__}", (_LoRAPartition, cls), {})


def lora_tp_plan(model: nn.Module, plan: dict) -> dict:
    """The tensor-parallel plan with LoRA-aware styles on the linears that have adapters."""
    out = {}
    for key, style in plan.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and any(
                has_adapter(m) for m in matching(model, key)):
            lora_style = object.__new__(_lora_style(type(style)))
            lora_style.__dict__.update(vars(style))  # the same settings
            style = lora_style
        out[key] = style
    return out


def _merged(linear: nn.Module, whole: Callable[[torch.Tensor], torch.Tensor] = full_tensor
            ) -> torch.Tensor:
    w, a, b = (whole(t) for t in (linear.weight, linear.lora_a, linear.lora_b))
    dtype = torch.promote_types(w.dtype, torch.float32)
    return (w.to(dtype) + linear.lora_scale * (b.to(dtype) @ a.to(dtype))).to(w.dtype)


def merged_tensors(model: nn.Module, whole: Callable[[torch.Tensor], torch.Tensor] = full_tensor
                   ) -> dict[str, Callable[[], torch.Tensor]]:
    """The state of the base model with every adapter folded into its weight
    (W + alpha/rank * B A), each tensor whole (by ``whole``) when called: under
    FSDP/TP a collective, so every rank calls them in the same order."""
    owners = {f"{fqn}.weight": m for fqn, m in model.named_modules() if has_adapter(m)}
    out = {}
    for name, value in model.state_dict().items():
        if is_adapter(name):
            continue
        owner = owners.get(name)
        out[name] = (functools.partial(_merged, owner, whole) if owner is not None
                     else functools.partial(whole, value))
    return out


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's full state dict with the adapters folded in."""
    return {name: get() for name, get in merged_tensors(model).items()}


class LoRACheckpoint(CheckpointPolicy):
    """Adapter-only checkpoint steps (the base comes from its own weights), and an
    export with the adapters folded in, where ``lora.merge_on_export`` asks."""

    def __init__(self, cfg: Lora, whole: Callable[[torch.Tensor], torch.Tensor] = full_tensor,
                 base: str = ""):
        self.cfg, self.whole, self.base = cfg, whole, base

    def added(self, key: str) -> bool:
        return is_adapter(key)

    def saved(self):
        return is_adapter

    def export_key(self) -> str | None:
        return "lora.merge_on_export" if self.cfg.merge_on_export else None

    def export_tensors(self, model: nn.Module, tensors: Tensors) -> Tensors:
        return merged_tensors(model, whole=self.whole)

    def export_extra(self, parts, folder, step, adapter, dtype, write, files):
        if self.cfg.export != "peft":
            return None
        out = folder / f"step-{step}-peft"
        export_peft(parts, out, adapter, self.cfg, self.base, dtype, write, files)
        return out


class LoRAConverter(Converter):
    """``model.converters = ["lora"]``: adapters on the spec's (or the config's)
    target linears, LoRA-aware TP styles, adapter-only checkpoint steps, and an
    export with the adapters folded into the base."""

    section = ("lora", Lora)
    reference = staticmethod(adapters_off)  # the base: every other parameter is frozen

    def __init__(self, config: Lora, job):
        super().__init__(config, job)
        self.checkpoint = LoRACheckpoint(config, base=self.cfg.model.hf_path)

    def target_modules(self) -> list[str]:
        return self.config.target_modules or list(self.spec.adapters.lora_targets)

    def check(self, meta: nn.Module) -> None:
        lora, c, label = self.config, self.cfg.checkpoint, self.spec.name
        names, chosen = linear_names(meta), self.target_modules()
        if not chosen:
            raise ValueError(f"lora.target_modules=[]: model {label!r} names no default targets "
                             f"(ModelSpec.adapters.lora_targets); choose from: {', '.join(names)}")
        unknown = [t for t in chosen if t not in names]
        if unknown:
            raise ValueError(f"lora.target_modules={chosen}: {unknown[0]!r} is no linear of "
                             f"{label}/{self.cfg.model.flavor}; allowed: {', '.join(names)}")
        shared = {name.rpartition(".")[0] for group in tied_groups(meta) for name in group}
        tied = [t for t in chosen if any(m.rpartition(".")[2] == t for m in shared)]
        if tied:
            raise ValueError(f"lora.target_modules: {tied[0]!r} shares its weight with another "
                             f"module in {self.cfg.model.flavor}; its merged weight could not "
                             f"stay tied")
        if c.last_save_in_hf and not lora.merge_on_export:
            raise ValueError("checkpoint.last_save_in_hf=true with LoRA: training leaves the base "
                             "unchanged; set lora.merge_on_export=true to export base + adapters")
        if lora.export == "peft" and self.cfg.parallelism.pipeline_parallel_degree > 1:
            raise ValueError("lora.export='peft' with parallelism.pipeline_parallel_degree > 1: "
                             "each stage holds its own adapters; allowed: pipeline degree 1")
        if (lora.export or lora.initial_adapter) and self.spec.adapters.hf_adapter is None:
            key = "lora.export='peft'" if lora.export else "lora.initial_adapter"
            raise ValueError(f"{key}: model {label!r} has no Hugging Face adapter "
                             f"(ModelSpec.adapters.hf_adapter) to name its modules")
        if lora.initial_adapter:
            check_peft(lora.initial_adapter, lora)
        if c.initial_load_path and not c.initial_load_model_only:
            raise ValueError("checkpoint.initial_load_model_only=false with LoRA: a LoRA run "
                             "starts from base weights only; allowed: true")

    def convert(self, model: nn.Module) -> None:
        convert_lora(model, self.config, self.spec.adapters.lora_targets)

    def init_added(self, model: nn.Module) -> None:
        init_adapters(model)

    def tp_styles(self, model: nn.Module, plan: dict, sequence_parallel: bool) -> dict:
        return lora_tp_plan(model, plan)

    def built(self, parts: list[nn.Module]) -> None:
        log_trainable(parts, self.config)

    def weights_loaded(self, parts: list[nn.Module]) -> None:
        if self.config.initial_adapter:
            filled = load_peft(parts, self.config.initial_adapter,
                               adapter_of(self.spec, self.args))
            log.info("adapters of %d linears from %s", filled, self.config.initial_adapter)
