"""Per-rank memory by category (the categories of ``metrics.memory_breakdown``)
at the moment of a step's peak.

A step is followed through the moments where memory can peak, each a sum of
the five categories: the end of the forward (every microbatch's activations
in flight), the start of the backward (plus the loss's gradients), each block's
backward (its weights gathered, its gradients in flight, the block recomputed under
activation checkpointing, the head's activations freed, and under FSDP2 the previous
block's reduce-scatter input, which torch keeps until the next reduce-scatter) and its
reduce-scatter, and the optimizer step. The peak is the largest; its categories are those of that
moment. Weights and gradients are the state at rest (``state.py``) plus what
the data-parallel wrapper gathers: FSDP2's root stays gathered, ZeRO-3 gathers
one block at a time (on CUDA the next one prefetched in backward), ZeRO-2 keeps every
block gathered after the forward, FSDP2's replicate (ZeRO-0) keeps a gathered
copy beside its parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from composer.planner import activations as act
from composer.planner.layout import Layout
from composer.planner.schedule import build as build_timeline
from composer.planner.schedule import peak_in_flight
from composer.planner.state import (
    Part,
    State,
    head_grad_bytes,
    itemsizes,
    rank_state,
    state_bytes,
    unpacked_bytes,
)

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
GIB = 2**30


@dataclass
class Moment:
    name: str
    bytes: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.bytes.values())


@dataclass
class RankMemory:
    """One pipeline rank's peak moment, the activations one microbatch keeps,
    op by op (bytes), and the microbatches in flight at the peak."""

    stages: list[int]
    peak: Moment
    moments: list[Moment]
    per_op: dict[str, float]
    in_flight: int
    skew: float = 0.0  # what the skewest routing adds to the peak's activations (bytes)

    def gib(self) -> dict[str, float]:
        out = {k: self.peak.bytes[k] / GIB for k in CATEGORIES}
        out["peak"] = self.peak.total / GIB
        return out


@lru_cache(maxsize=256)
def _in_flight(schedule: str, pp: int, microbatches: int, per_rank: int) -> dict[int, int]:
    return peak_in_flight(build_timeline(schedule, pp, microbatches, per_rank).programs)


def in_flight(layout: Layout, pp_rank: int) -> int:
    """(stage, microbatch) pairs whose activations a pipeline rank holds at its peak."""
    if layout.pipeline is None:
        return 1
    p = layout.pipeline
    return _in_flight(p.schedule, layout.dims.pp, p.microbatches, len(p.ids))[pp_rank]


def _blocks(layout: Layout, stage_ids: list[int]) -> list[int]:
    """Layer indices of the blocks a pipeline rank owns, in forward order."""
    names = layout.model.block_names
    if layout.pipeline is None:
        return list(range(len(names)))
    units = {u for s in stage_ids for u in layout.stage_units(s)}
    return [i for i, n in enumerate(names) if n in units]


def _ends(layout: Layout, stage_ids: list[int]) -> tuple[bool, bool]:
    """Whether the rank runs the first (embedding) and the last (loss) stage."""
    if layout.pipeline is None:
        return True, True
    return 0 in stage_ids, len(layout.pipeline.stage_units) - 1 in stage_ids


def _kept(layout: Layout, layer: int, index: int) -> dict[str, float]:
    """What block ``layer`` (the rank's ``index``-th) keeps under the AC mode."""
    mode, costs = layout.cfg.activation_checkpoint.mode, act.costs(layout)
    if not layout.checkpointed(index):
        return costs.block(layout, layer)
    if mode == "selective_op":
        return costs.selective_op(layout, layer)
    return {"block input": costs.block_input(layout)}


def per_token(layout: Layout, stage_ids: list[int]) -> dict[str, float]:
    """Activation bytes per local token of one microbatch, summed by op over blocks."""
    first, last = _ends(layout, stage_ids)
    costs = act.costs(layout)
    parts = [_kept(layout, layer, index)
             for index, layer in enumerate(_blocks(layout, stage_ids))]
    if first:
        parts.append(costs.first(layout))
    if last:
        parts.append(costs.last(layout))
    parts.append({"attention mask": act.mask_bytes(layout)})
    out: dict[str, float] = {}
    for part in parts:
        for op, b in part.items():
            if b:
                out[op] = out.get(op, 0) + b
    return out


def _gathered(layout: Layout, part: Part) -> float:
    return part.gathered_bytes


def _forward_weights(layout: Layout, state: State) -> float:
    """Gathered weights beside the shards at the end of a forward."""
    zero = layout.cfg.parallelism.zero_stage
    if not layout.dims.dp_enabled or zero == 1:
        return 0.0
    if zero == 3:
        return _gathered(layout, state.root)
    return sum(_gathered(layout, p) for p in state.parts)  # ZeRO-2, and replicate's copy


def _block_weights(layout: Layout, state: State, index: int) -> float:
    """ZeRO-3 in a block's backward: the root and the block gathered, and on CUDA
    the block before it too (FSDP2 prefetches the next all-gather of the backward
    on its own stream; on the CPU the gathers run one at a time)."""
    blocks = (state.blocks[max(index - 1, 0):index + 1] if layout.device == "cuda"
              else [state.blocks[index]])
    return _gathered(layout, state.root) + sum(_gathered(layout, b) for b in blocks)


def rank_memory(layout: Layout, pp_rank: int) -> RankMemory:
    stage_ids = layout.stages()[pp_rank]
    state = rank_state(layout, stage_ids)
    rest = state_bytes(layout, state)
    tokens = layout.tokens
    flight = in_flight(layout, pp_rank)
    per_op = per_token(layout, stage_ids)
    stages_here = len(stage_ids)
    activations = sum(per_op.values()) * tokens * flight / stages_here
    first, last = _ends(layout, stage_ids)
    head = sum(act.costs(layout).last(layout).values()) * tokens if last else 0.0
    buffers = layout.model.buffer_bytes
    # gradients outlive the step's start under accumulation and pipelining, and always
    # in classic DDP's buckets (ZeRO-1), which hold them from the first step on
    buckets = layout.cfg.parallelism.zero_stage == 1 and layout.dims.dp_enabled
    grads_before = rest.grads if (layout.accum > 1 or layout.pipeline or buckets) else 0.0
    base = {"optimizer": rest.optimizer}
    forward_end = {**base, "params": rest.params + _forward_weights(layout, state),
                   "grads": grads_before, "activations": activations, "other": buffers}
    backward_start = {**forward_end,
                      "other": buffers + (act.logits_grad(layout) * tokens if last else 0)}
    blocks = _blocks(layout, stage_ids)
    context = {"rest": rest, "state": state, "base": base, "tokens": tokens, "buffers": buffers,
               "grads_before": grads_before, "stage_ids": stage_ids}
    backward = _backward_moments(layout, blocks, activations - head, context)
    foreach = rest.grads if _foreach(layout) else 0
    optimizer = {**base, "params": rest.params, "grads": rest.grads, "activations": 0.0,
                 "other": buffers + foreach}
    moments = [Moment("forward end", forward_end), Moment("backward start", backward_start),
               *backward, Moment("optimizer step", optimizer)]
    peak = max(moments, key=lambda m: m.total)
    return RankMemory(stage_ids, peak, moments, per_op, flight,
                      expert_skew(layout, blocks) * tokens * flight / stages_here)


def _backward_moments(layout: Layout, blocks: list[int], activations: float,
                      c: dict) -> list[Moment]:
    """Each block's backward, last block first: its weights gathered (ZeRO-3), its
    forward recomputed (AC), its gradient temporaries, the activations of the
    blocks before it, the gradients of those after it (reduced)."""
    state, tokens, costs = c["state"], c["tokens"], act.costs(layout)
    grads = head_grad_bytes(layout, c["stage_ids"])
    out = []
    kept_reduce = 0.0  # FSDP2 keeps the last reduce-scatter's input until the next one
    for index in reversed(range(len(blocks))):
        layer = blocks[index]
        kept = sum(_kept(layout, layer, index).values()) * tokens
        recompute = (sum(costs.block(layout, layer).values()) * tokens - kept
                     if layout.checkpointed(index) else 0.0)
        weights = (_block_weights(layout, state, index)
                   if layout.fsdp and layout.cfg.parallelism.zero_stage == 3
                   else _forward_weights(layout, state))
        # FSDP2 computes a block's whole gradients before reduce-scattering them
        unsharded = (state.blocks[index].trainable_gathered * layout.compute_bytes
                     if layout.fsdp else 0)
        held = {**c["base"], "params": c["rest"].params + weights,
                "grads": max(c["grads_before"],
                             grads + _first_grad(layout, state.blocks[index], layer))}
        out.append(Moment(f"backward of block {layer}", {
            **held, "activations": activations + recompute,
            "other": (c["buffers"] + unsharded + kept_reduce + unpacked_bytes(layout, layer)
                      + costs.temporaries(layout, layer, layout.checkpointed(index))
                      * tokens)}))
        activations -= kept
        if layout.fsdp:  # then its reduce-scatter copies them into one reduce-dtype buffer,
            # which outlives it: torch frees the one before (its reduce done) at the next
            kept_reduce = state.blocks[index].trainable_gathered * layout.reduce_bytes
            out.append(Moment(f"reduce-scatter of block {layer}", {
                **held, "activations": activations,
                "other": c["buffers"] + unsharded + kept_reduce}))
        grads += state.blocks[index].trainable_rest * layout.storage_bytes
    return out


def expert_skew(layout: Layout, blocks: list[int]) -> float:
    """Bytes per token that the skewest routing adds: nothing caps an expert's
    tokens, so all the top-k choices of an expert-parallel group's ranks may
    land on one rank's experts, ep times the balanced share."""
    if layout.dims.ep == 1:
        return 0.0
    costs = act.costs(layout)
    return (layout.dims.ep - 1) * sum(costs.routed(layout, layer) for i, layer in enumerate(blocks)
                                      if not layout.checkpointed(i))


def _first_grad(layout: Layout, block: Part, layer: int) -> float:
    """The gradient a block's backward computes first and holds while it goes on."""
    numel = act.costs(layout).first_grad_numel(layout, layer)
    return min(numel, block.trainable_gathered) * layout.compute_bytes


def _foreach(layout: Layout) -> bool:
    """The foreach optimizer holds one more gradient-sized temporary in its step;
    the fused one does not. ``auto`` takes foreach only where a trainable
    parameter is a converter's own tensor (one it gathers in a form of its own)."""
    impl = layout.cfg.optimizer.implementation
    if impl != "auto" or not layout.converters:
        return impl == "foreach"
    own = {fqn for fqn, (gathered, _) in itemsizes(layout).items() if gathered is not None}
    return any(p.trainable and p.fqn in own for p in layout.model.params)


def memory(layout: Layout) -> list[RankMemory]:
    """Every pipeline rank's memory (one entry without pipeline parallel)."""
    return [rank_memory(layout, r) for r in range(len(layout.stages()))]


def largest(ranks: list[RankMemory]) -> RankMemory:
    return max(ranks, key=lambda r: r.peak.total)
