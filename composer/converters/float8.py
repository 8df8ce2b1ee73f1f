"""Float8 training through torchao: ``model.converters = ["float8"]``.

Eligible ``nn.Linear`` layers become torchao ``Float8Linear`` on the meta
model, before any parallelize pass. The output projection stays in high
precision (its logits feed the loss), as do layers named in
``float8.filter_fqns``, layers smaller than ``float8.min_features`` and layers
whose sizes the float8 matmul cannot take (multiples of 16). Without CUDA the
float8 matmuls are emulated (``float8.emulate = "auto"``): the casts, scales and
rounding are real, the matmul runs in high precision.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from composer.config import bounded, choice
from composer.converters.base import Converter, CostHints
from composer.parallel.tensor import matching

log = logging.getLogger(__name__)


@dataclass
class Float8:
    """Float8 matmuls through torchao (``model.converters = ["float8"]``)."""

    recipe: str = choice("tensorwise", ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
                         "torchao's scaling recipe: tensorwise (one scale a tensor), rowwise "
                         "(one scale a row), rowwise_with_gw_hp (rowwise, the weight gradient "
                         "in high precision)")
    emulate: str = choice("auto", ("auto", "true", "false"),
                          "auto: emulate float8 matmuls in high precision unless on CUDA")
    filter_fqns: list = field(default_factory=list, metadata={
        "help": "linears whose name contains one of these stay in high precision "
                "(the output projection always does)"})
    min_features: int = bounded(0, 0, help="linears with fewer in or out features stay in "
                                           "high precision (float8 gains nothing there)")
    fsdp_float8_all_gather: bool = field(default=False, metadata={
        "help": "FSDP2 all-gathers weights in float8 (tensorwise only)"})


def eligible(module: nn.Module, fqn: str, cfg: Float8, kept: tuple[str, ...] = ("output",)) -> bool:
    """Whether the float8 converter swaps the linear ``module`` named ``fqn``;
    ``kept``: the model's modules that always stay in high precision."""
    if not isinstance(module, nn.Linear):
        return False
    if any(part in fqn for part in (*kept, *cfg.filter_fqns)):
        return False
    sizes = (module.in_features, module.out_features)
    return all(n % 16 == 0 and n >= cfg.min_features for n in sizes)


def float8_config(cfg: Float8, device: torch.device):
    from torchao.float8 import Float8LinearConfig
    emulate = cfg.emulate == "true" or (cfg.emulate == "auto" and device.type != "cuda")
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe), emulate=emulate,
                               enable_fsdp_float8_all_gather=cfg.fsdp_float8_all_gather)


def check_float8(cfg: Float8, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ValueError for settings torchao would reject later with a traceback."""
    if cfg.fsdp_float8_all_gather and cfg.recipe != "tensorwise":
        raise ValueError(f"float8.fsdp_float8_all_gather=true with float8.recipe={cfg.recipe!r}: "
                          f"float8 all-gather needs recipe 'tensorwise'")
    if dtype == torch.float64:
        raise ValueError("model.converters=['float8'] with training.dtype='float64': float8 "
                          "casts from float32 or bfloat16")
    if cfg.emulate == "false" and device.type != "cuda":
        raise ValueError("float8.emulate='false' on CPU: float8 matmuls need CUDA (sm89+); "
                          "allowed on CPU: 'auto' or 'true'")


def convert_float8(model: nn.Module, cfg: Float8, device: torch.device,
                   kept: tuple[str, ...] = ("output",)) -> list[str]:
    """Swap the eligible linears of ``model`` (on any device, meta included) in
    place; returns their names."""
    from torchao.float8 import convert_to_float8_training
    swapped = []

    def keep(module: nn.Module, fqn: str) -> bool:
        if eligible(module, fqn, cfg, kept):
            swapped.append(fqn)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=keep, config=float8_config(cfg, device))
    log.info("float8 (%s%s): %d linears swapped", cfg.recipe,
             ", emulated" if float8_config(cfg, device).emulate else "", len(swapped))
    return swapped


def float8_tp_plan(model: nn.Module, plan: dict, sequence_parallel: bool) -> dict:
    """The tensor-parallel plan with float8-aware styles on the float8 linears:
    their inputs and output gradients are cast to float8 before TP's
    collectives, which then move half the bytes of bfloat16.

    Emulated float8 with sequence parallel keeps the plain styles: the CPU
    cannot concatenate float8 tensors, which the all-gathers of SP need."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    swaps = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    out = {}
    for key, style in plan.items():
        modules = matching(model, key)
        swap = swaps.get(type(style))
        # exactly Float8Linear: a subclass (e.g. with an adapter reading the input
        # in high precision) may not take float8 inputs
        usable = all(type(m) is Float8Linear
                     and not (m.config.emulate and sequence_parallel) for m in modules)
        if swap and modules and usable:
            style = swap(input_layouts=style.input_layouts[0],
                         output_layouts=style.output_layouts[0],
                         use_local_output=style.use_local_output)
        out[key] = style
    return out


def _casts(module: nn.Module, name: str) -> bool:
    from torchao.float8.float8_linear import Float8Linear
    return isinstance(module, Float8Linear) and name == "weight"


class Float8Costs(CostHints):
    """Float8 matmuls, and weights gathered in float8 where FSDP2 does so."""

    def __init__(self, cfg: Float8):
        self.cfg = cfg

    def matmul_dtype(self, module: nn.Module, name: str, gemm: str) -> str | None:
        """float8 for a float8 linear's weight GEMMs (not its LoRA factors), but the
        weight gradient's under ``rowwise_with_gw_hp`` and every one when emulated."""
        if self.cfg.emulate == "true" or not _casts(module, name):
            return None
        if self.cfg.recipe == "rowwise_with_gw_hp" and gemm == "weight_grad":
            return None
        return "float8"

    def cast_bytes(self, module: nn.Module, name: str, gemm: str, itemsize: int) -> float:
        """torchao casts each operand of each of the three GEMMs (it saves the
        high-precision input and weight for backward): its amax reads the operand, the
        cast reads it again and writes one byte an element (emulated too)."""
        if not _casts(module, name):
            return 0.0
        if self.cfg.recipe == "rowwise_with_gw_hp" and gemm == "weight_grad":
            return 0.0
        return 2 * itemsize + 1

    def step_reduced_bytes(self, module: nn.Module, name: str) -> int:
        """With FSDP's float8 all-gather: each weight's float32 amax, all-reduced in one
        collective after the optimizer step (``Float8Converter.after_step``)."""
        return 4 if self.cfg.fsdp_float8_all_gather and _casts(module, name) else 0

    def gathered_itemsize(self, module: nn.Module, name: str) -> float | None:
        from torchao.float8.float8_linear import Float8Linear
        return 1 if (self.cfg.fsdp_float8_all_gather and isinstance(module, Float8Linear)
                     and name == "weight") else None


class Float8Converter(Converter):
    """``model.converters = ["float8"]``: float8 linears; with FSDP's float8
    all-gather, one all-reduce of every weight's scale after each optimizer step
    (instead of one per weight inside the next forward's all-gathers)."""

    section = ("float8", Float8)

    def __init__(self, config: Float8, job):
        super().__init__(config, job)
        self.costs = Float8Costs(config)

    def check(self, meta: nn.Module) -> None:
        check_float8(self.config, getattr(torch, self.cfg.training.dtype), self.device)

    def convert(self, model: nn.Module) -> None:
        convert_float8(model, self.config, self.device, self.spec.adapters.logits_modules)

    def tp_styles(self, model: nn.Module, plan: dict, sequence_parallel: bool) -> dict:
        return float8_tp_plan(model, plan, sequence_parallel)

    def after_step(self, parts: list[nn.Module]) -> None:
        if self.dims.dp_shard > 1 and self.config.fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
            for part in parts:
                precompute_float8_dynamic_scale_for_fsdp(part)
