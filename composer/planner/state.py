"""The model state one rank holds: its parameters, gradients and optimizer state
at rest, and what FSDP gathers for each block, from the converted meta model
and the passes' rules (TP's styles cut the feature dims, EP the experts, FSDP2
dim 0 padded to a multiple of its shards, a pipeline rank keeps its stages)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from composer.parallel.tensor import SHARDED_DIM, sharded_dim
from composer.planner.layout import Layout, Param

# TP styles that cut a parameter's output-feature dim (0), or its input-feature dim (-1)
OUT_CUT = tuple(style for style, dim in SHARDED_DIM.items() if dim == 0)
IN_CUT = tuple(style for style, dim in SHARDED_DIM.items() if dim == -1)
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
    gathered_bytes: float = 0.0  # whole, in the dtype FSDP2 gathers it in
    payload_bytes: float = 0.0   # what one all-gather moves: the shards, padded
    rest_bytes: float = 0.0      # at rest on this rank, in the dtype it is stored in

    def add(self, gathered: int, rest: int, trainable: bool, itemsize: float, shards: int,
            stored: float) -> None:
        self.gathered += gathered
        self.rest += rest
        self.gathered_bytes += gathered * itemsize
        self.payload_bytes += rest * shards * itemsize
        self.rest_bytes += rest * stored
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


def tp_cut(layout: Layout, p: Param) -> bool:
    """Whether TP cuts ``p``: the feature dim its module's style shards (output
    features for column-wise styles, input features for row-wise ones)."""
    if layout.dims.tp == 1:
        return False
    return sharded_dim(layout.tp_styles.get(p.owner), p.shape, p.owner_weight) is not None


def _shards(layout: Layout, expert: bool) -> int:
    if not layout.fsdp:
        return 1
    n = layout.dims.dp_shard * layout.dims.cp
    return n // layout.dims.ep if expert else n


def _owned(fqn: str, units: list[str] | None) -> bool:
    return units is None or any(fqn == u or fqn.startswith(u + ".") for u in units)


def rank_state(layout: Layout, stage_ids: list[int]) -> State:
    """The parameters of the pipeline rank that runs ``stage_ids`` (kept on the
    model for the next layout that cuts it alike)."""
    d = layout.dims
    units = None if layout.pipeline is None else tuple(
        tuple(layout.stage_units(s)) for s in stage_ids)
    sizes = itemsizes(layout)
    key = (d.tp, d.ep, _shards(layout, False), _shards(layout, True), layout.sequence_parallel,
           layout.loss_parallel, units, layout.compute_bytes, layout.storage_bytes,
           tuple(sorted(sizes.items())))
    cache = layout.model.__dict__.setdefault("_rank_states", {})
    if key not in cache:
        cache[key] = _rank_state(layout, stage_ids, sizes)
    return cache[key]


def itemsizes(layout: Layout) -> dict[str, tuple[float | None, float | None]]:
    """Parameters a converter gathers (float8, NF4) or stores (NF4) in a form of its
    own: FQN -> (bytes per element gathered, at rest), None where it does not
    (asked once per layout)."""
    if not layout.converters:
        return {}
    if "_itemsizes" not in layout.__dict__:
        out = {}
        for owner, module in layout.model.converted.named_modules():
            for name, _ in module.named_parameters(recurse=False):
                sizes = tuple(next((s for c in layout.converters
                                    if (s := ask(c)(module, name))), None)
                              for ask in (lambda c: c.costs.gathered_itemsize,
                                          lambda c: c.costs.stored_itemsize))
                if sizes != (None, None):
                    out[f"{owner}.{name}" if owner else name] = sizes
        layout.__dict__["_itemsizes"] = out
    return layout.__dict__["_itemsizes"]


def unpacked_bytes(layout: Layout, block: int) -> float:
    """The most bytes one parameter of block ``block`` briefly takes when a matmul uses
    it, where a converter stores it in a form of its own (NF4's dequantization), whole
    as FSDP2 gathers it."""
    if not layout.converters:
        return 0.0
    model, most = layout.model, 0.0
    for p in model.params:
        if p.block != block:
            continue
        module, name = model.converted.get_submodule(p.owner), p.fqn.rpartition(".")[2]
        per = max(c.costs.unpacked_bytes(module, name, layout.compute_bytes)
                  for c in layout.converters)
        most = max(most, per * math.prod(p.shape))
    return most


def _rank_state(layout: Layout, stage_ids: list[int],
                sizes: dict[str, tuple[float | None, float | None]]) -> State:
    model = layout.model
    units = None if layout.pipeline is None else [
        u for s in stage_ids for u in layout.stage_units(s)]
    owned = [i for i, name in enumerate(model.block_names) if _owned(name, units)]
    index = {block: i for i, block in enumerate(owned)}
    state = State(blocks=[Part() for _ in owned], experts=[Part() for _ in owned])
    ep = layout.dims.ep
    for p in model.params:
        if not (_owned(p.fqn, units) if p.block is None else p.block in index):
            continue
        numel = math.prod(p.shape) // (layout.dims.tp if tp_cut(layout, p) else 1)
        if p.expert:
            numel //= ep
        shards = _shards(layout, p.expert)
        rows = p.shape[0] if p.shape else 1
        rest = math.ceil(rows / shards) * (numel // rows) if shards > 1 else numel
        if p.block is None:
            part = state.root
        else:  # expert parallel's experts are FSDP units apart from their block
            part = (state.experts if p.expert and ep > 1 else state.blocks)[index[p.block]]
        gathered, stored = sizes.get(p.fqn, (None, None))
        part.add(numel, rest, p.trainable,
                 (gathered if layout.fsdp else None) or layout.compute_bytes,
                 shards, stored or layout.storage_bytes)
    return state


def head_grad_bytes(layout: Layout, stage_ids: list[int]) -> float:
    """The head's gradients (final norm, output) while the blocks' backward runs:
    whole in the compute dtype under FSDP2, which reduces the root's gradients
    when its backward ends, after the embedding's."""
    units = (None if layout.pipeline is None
             else [u for s in stage_ids for u in layout.stage_units(s)])
    numel = sum(math.prod(p.shape) // (layout.dims.tp if tp_cut(layout, p) else 1)
                for p in layout.model.params if p.head and p.trainable and _owned(p.fqn, units))
    if layout.fsdp:
        return numel * layout.compute_bytes
    return numel * layout.storage_bytes


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
    return StateBytes(params=round(state.total("rest_bytes")), grads=trainable * e,
                      optimizer=moments // layout.dims.replicas if zero1 else moments)
