"""The model state one rank holds: its parameters, gradients and optimizer state
at rest, and what FSDP gathers for each block, from the converted meta model
and the passes' rules (TP's styles cut the feature dims, EP the experts, FSDP2
dim 0 padded to a multiple of its shards, a pipeline rank keeps its stages)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from composer.planner.layout import Layout

# TP styles that cut a parameter's output-feature dim (0), or its input-feature dim (-1)
OUT_CUT = ("colwise", "output", "embedding")
IN_CUT = ("rowwise",)
ADAM_MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq, in the parameters' dtype


@dataclass
class Part:
    """Elements of a group of parameters (a block, or the rest: embeddings, norm,
    output): whole after TP/EP (what FSDP gathers), at rest on this rank, and the
    trainable ones of both."""

    gathered: int = 0
    rest: int = 0
    trainable_gathered: int = 0
    trainable_rest: int = 0

    def add(self, gathered: int, rest: int, trainable: bool) -> None:
        self.gathered += gathered
        self.rest += rest
        if trainable:
            self.trainable_gathered += gathered
            self.trainable_rest += rest


@dataclass
class State:
    """A pipeline rank's parameters: the root part, one part per block (in
    forward order) and, under expert parallel, each block's experts (FSDP2 units
    of their own, sharded over ``efsdp``)."""

    root: Part = field(default_factory=Part)
    blocks: list[Part] = field(default_factory=list)
    experts: list[Part] = field(default_factory=list)

    @property
    def parts(self) -> list[Part]:
        return [self.root, *self.blocks, *self.experts]

    def total(self, attr: str) -> int:
        return sum(getattr(p, attr) for p in self.parts)


def _tp_numel(layout: Layout, module: nn.Module, style: str | None, shape: tuple) -> int:
    numel = math.prod(shape)
    tp = layout.dims.tp
    weight = getattr(module, "weight", None)
    if style in OUT_CUT and weight is not None and shape[0] == weight.shape[0]:
        return numel // tp
    if style in IN_CUT and weight is not None and shape[-1] == weight.shape[-1]:
        return numel // tp
    return numel


def _shards(layout: Layout, expert: bool) -> int:
    if not layout.fsdp:
        return 1
    n = layout.dims.dp_shard * layout.dims.cp
    return n // layout.dims.ep if expert else n


def _owned(fqn: str, units: list[str] | None) -> bool:
    return units is None or any(fqn == u or fqn.startswith(u + ".") for u in units)


def rank_state(layout: Layout, stage_ids: list[int]) -> State:
    """The parameters of the pipeline rank that runs ``stage_ids``."""
    model, spec = layout.model.converted, layout.model.spec
    units = None if layout.pipeline is None else [
        u for s in stage_ids for u in layout.stage_units(s)]
    block_names = spec.block_names(model)
    experts = {f"{name}.experts" for name in (spec.moe_modules(model) if spec.moe_modules else {})}
    modules = dict(model.named_modules())
    owned = [name for name in block_names if _owned(name, units)]
    state = State(blocks=[Part() for _ in owned], experts=[Part() for _ in owned])
    index = {name: i for i, name in enumerate(n for n in block_names if _owned(n, units))}
    for fqn, param in model.named_parameters():
        if not _owned(fqn, units):
            continue
        owner = fqn.rpartition(".")[0]
        numel = _tp_numel(layout, modules[owner], layout.tp_styles.get(owner), tuple(param.shape))
        expert = owner in experts
        if expert:
            numel //= layout.dims.ep
        shards = _shards(layout, expert)
        rows = param.shape[0] if param.dim() else 1
        rest = math.ceil(rows / shards) * (numel // rows) if shards > 1 else numel
        block = next((b for b in index if fqn.startswith(b + ".")), None)
        if block is None:
            part = state.root
        else:  # expert parallel's experts are FSDP units apart from their block
            part = (state.experts if expert and layout.dims.ep > 1 else state.blocks)[index[block]]
        part.add(numel, rest, param.requires_grad)
    return state


@dataclass
class StateBytes:
    params: int
    grads: int
    optimizer: int


def state_bytes(layout: Layout, state: State) -> StateBytes:
    """Bytes at rest: parameters and their gradients in the storage dtype,
    AdamW's two moments per trainable element (ZeRO-1 shards them over the
    data-parallel replicas)."""
    e = layout.storage_bytes
    trainable = state.total("trainable_rest")
    zero1 = layout.cfg.parallelism.zero_stage == 1 and layout.dims.dp_enabled
    moments = ADAM_MOMENTS * trainable * e
    return StateBytes(params=state.total("rest") * e, grads=trainable * e,
                      optimizer=moments // layout.dims.replicas if zero1 else moments)
