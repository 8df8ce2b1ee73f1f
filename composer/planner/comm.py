"""The collectives of one training step, in the shape of ``metrics.comm_stats``:
``{phase: {mesh dim: {kind: {count, bytes, ring_bytes}}}}`` for the first
rank (the rank whose row ``metrics.jsonl`` holds), with the bytes of each
collective's full tensor and what a ring moves through one rank.

Who issues what (each pass as composer applies it):
- FSDP2 (ZeRO-2/3) all-gathers every unit (a block, the root, expert-parallel
  experts) in the forward, ZeRO-3 each block again in the backward, and
  reduce-scatters the trainable gradients every microbatch (a pipeline's stages
  once per schedule run); HSDP all-reduces the shards over ``dp_replicate`` once per
  step. FSDP2's replicate (ZeRO-0) all-reduces each unit's gradients and classic
  DDP (ZeRO-1) 100 MB buckets, both on the last microbatch only; ZeRO-1 then
  broadcasts each parameter from its owner after the step.
- Tensor parallel: each block's two row-wise outputs are all-reduced (with
  sequence parallel: reduce-scattered, and the two column-wise inputs
  all-gathered), the embedding's output likewise, the output projection's
  input gradient, the logits gathered without loss parallel, three [tokens]
  all-reduces in the loss with it, and the partial gradients (the
  sequence-parallel norms', LoRA's replicated factors') reduced before clipping,
  or under FSDP2 before each reduce-scatter. A module run whole on the gathered
  sequence (MoE layers) gathers its input and its output's gradient only.
- Context parallel: the all-gather method gathers each layer's k and v (their
  gradients reduce-scattered), the all-to-all method exchanges q, k, v and the
  output both ways.
- Expert parallel: per MoE layer the token counts, the tokens and the
  experts' outputs (balanced routing assumed), both ways but the counts.
- Pipeline: a stage sends its output of each microbatch and receives its
  gradient; the next stage the reverse.
- Activation checkpointing runs a block's forward collectives (TP, CP, EP)
  again in its backward, up to its last saved tensor (not the MLP's output
  reduce-scatter); selective-op AC keeps the reduce-scatters' outputs.
- Every step: the global token count and the loss over ``dp_cp``; the
  gradient norm: one all-reduce of the per-tensor norms per group of gradients
  of one layout, over each dim that shards them.
"""
from __future__ import annotations

import math
from collections import defaultdict

from composer.mesh import DIMS, FLATTENED
from composer.observe.comm import RING_FACTOR
from composer.planner.activations import INDEX_BYTES, dtypes
from composer.planner.layout import Layout
from composer.planner.state import IN_CUT, OUT_CUT, State, rank_state, tp_cut

ZERO1_BUCKET = 100 * 2**20  # composer's DDP bucket_cap_mb for ZeRO-1
EXPERTS = "efsdp x ep"  # the experts' joint group (dp_shard_cp unflattened)


class Traffic:
    """Collectives added one by one, named as the counter names their groups."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.groups = group_ranks(layout)
        self.calls: dict = defaultdict(lambda: [0, 0, 0.0])

    def add(self, phase: str, dim: str, kind: str, count: int, size: float) -> None:
        ranks = self.groups.get(dim, frozenset({0}))
        if count == 0 or len(ranks) == 1:
            return
        name = counter_name(self.groups, dim, self.layout.dims.world_size)
        entry = self.calls[(phase, name, kind)]
        entry[0] += count
        entry[1] += size
        entry[2] += size * RING_FACTOR[kind](len(ranks))

    def table(self) -> dict:
        out: dict = {}
        for (phase, dim, kind), (count, size, ring) in sorted(self.calls.items()):
            out.setdefault(phase, {}).setdefault(dim, {})[kind] = {
                "count": count, "bytes": int(round(size)), "ring_bytes": ring}
        return out


def group_ranks(layout: Layout) -> dict[str, frozenset]:
    """Each mesh dim's (and flattened view's) group holding rank 0."""
    d = layout.dims
    degrees = dict(zip(DIMS, d.degrees))
    stride, strides = 1, {}
    for name in reversed(DIMS):
        strides[name] = stride
        stride *= degrees[name]

    def span(names) -> frozenset:
        ranks = {0}
        for name in names:
            ranks = {r + i * strides[name] for r in ranks for i in range(degrees[name])}
        return frozenset(ranks)

    groups = {name: span([name]) for name in DIMS}
    groups.update({name: span(parts) for name, parts in FLATTENED.items()})
    if d.ep > 1:  # the counter names these only where expert parallel builds them
        shard_cp = sorted(groups["dp_shard_cp"])
        groups["ep"] = frozenset(shard_cp[:d.ep])
        groups["efsdp"] = frozenset(shard_cp[::d.ep])
        groups[EXPERTS] = groups["dp_shard_cp"]
    return groups


def counter_name(groups: dict[str, frozenset], dim: str, world_size: int) -> str:
    """The name the counter gives ``dim``'s group. Each dim and view has a
    process group of its own, except that those spanning the whole world share
    the default group, which the counter names after the last of them in its order."""
    if dim == EXPERTS and len(groups[dim]) < world_size:
        # a reduction over efsdp x ep runs on the flattened view made first of its ranks
        return next(name for name in FLATTENED if groups[name] == groups[dim])
    if len(groups[dim]) < world_size:
        return dim
    order = (*FLATTENED, *DIMS, *(("efsdp", "ep") if "ep" in groups else ()))
    return [name for name in order if len(groups.get(name, ())) == world_size][-1]


def add_data_parallel(t: Traffic, layout: Layout, state: State) -> None:
    zero, dims = layout.cfg.parallelism.zero_stage, layout.dims
    if not dims.dp_enabled:
        return
    e_r, e_s = layout.reduce_bytes, layout.storage_bytes
    micro = layout.accum * layout.microbatches
    blocks = [p for p in state.blocks if p.gathered]
    units = [state.root, *blocks] if state.root.gathered else blocks
    trainable = [u for u in units if u.trainable_gathered]
    if zero >= 2:
        shards = layout.dims.dp_shard * layout.dims.cp
        _fsdp(t, dims.fsdp_dim, shards, units, blocks, layout, micro)
        experts = [u for u in state.experts if u.gathered]
        _fsdp(t, "efsdp", shards // dims.ep, experts, experts, layout, micro)
    elif zero == 0:
        t.add("backward", dims.ddp_dim, "all_reduce", len(trainable),
              sum(u.trainable_gathered * e_r for u in trainable))
    else:
        size = state.total("trainable_gathered") * e_s
        t.add("backward", dims.ddp_dim, "all_reduce", -(-size // ZERO1_BUCKET), size)
        tensors = sum(p.trainable for p in layout.model.params)
        t.add("optimizer", dims.ddp_dim, "broadcast", tensors, size)


def reduce_scatters(layout: Layout) -> int:
    """How often FSDP2 reduce-scatters a step: every microbatch; a pipeline schedule's
    stages hold their gradients unsharded until its last microbatch."""
    return layout.accum if layout.pipeline else layout.accum * layout.microbatches


def _fsdp(t: Traffic, dim: str, shards: int, units: list, resharded: list,
          layout: Layout, micro: int) -> None:
    """FSDP2's all-gathers (every microbatch; ZeRO-3 gathers the units it
    reshards after forward again for backward: all but the root) and gradient
    reductions (reduce-scatters every microbatch, the all-reduce once a step)."""
    e_r = layout.reduce_bytes
    trainable = [u for u in units if u.trainable_gathered]
    # ZeRO-2 keeps the weights gathered across a pipeline's microbatches (torch's
    # stages reshard after the last backward only); otherwise each one gathers
    gathers = 1 if layout.cfg.parallelism.zero_stage == 2 and layout.pipeline else micro
    t.add("forward", dim, "all_gather", gathers * len(units),
          gathers * sum(u.payload_bytes for u in units))
    if layout.cfg.parallelism.zero_stage == 3:
        t.add("backward", dim, "all_gather", micro * len(resharded),
              micro * sum(u.payload_bytes for u in resharded))
    scatters = reduce_scatters(layout)
    t.add("backward", dim, "reduce_scatter", scatters * len(trainable),
          scatters * sum(u.trainable_rest * shards * e_r for u in trainable))
    t.add("backward", "dp_replicate", "all_reduce", len(trainable),
          sum(u.trainable_rest * e_r for u in trainable))


def recomputed(layout: Layout, layers: list[int]) -> int:
    """Blocks whose forward (and its collectives) runs again in backward."""
    return sum(layout.checkpointed(i) for i in range(len(layers)))


def add_tensor_parallel(t: Traffic, layout: Layout, layers: list[int], first: bool,
                        last: bool) -> None:
    if layout.dims.tp == 1:
        return
    s, d = layout.shape, dtypes(layout)
    micro = layout.accum * layout.microbatches
    stream = layout.tokens * s.dim * d.a * micro  # one residual-stream tensor, every microbatch
    blocks, again = len(layers), recomputed(layout, layers)
    whole = _whole_blocks(layout, layers)
    outputs = 2 * blocks + first         # row-wise outputs and the embedding's
    inputs = 2 * blocks + last           # column-wise inputs and the output projection's
    # With a frozen embedding and first norm (LoRA) no gradient flows past the first
    # block's first linears: the embedding's collective and theirs have no backward.
    frozen_start = first and not any(p.trainable for p in layout.model.params
                                     if layout.tp_styles.get(p.owner) == "embedding")
    if layout.sequence_parallel:
        # a whole-run module gathers its input, and its output's gradient, and
        # reduce-scatters neither: its own slice of the result needs no sum
        t.add("forward", "tp", "reduce_scatter", (outputs - whole) * micro,
              (outputs - whole) * stream)
        t.add("forward", "tp", "all_gather", inputs * micro, inputs * stream)
        t.add("backward", "tp", "all_gather", (outputs - frozen_start) * micro,
              (outputs - frozen_start) * stream)
        t.add("backward", "tp", "reduce_scatter", (inputs - frozen_start - whole) * micro,
              (inputs - frozen_start - whole) * stream)
        # recomputation gathers again, and reduce-scatters the attention's output: it
        # stops at the block's last saved tensor, before the MLP's (selective-op AC keeps
        # the reduce-scatters' outputs)
        t.add("backward", "tp", "all_gather", 2 * again * micro, 2 * again * stream)
        if layout.cfg.activation_checkpoint.mode != "selective_op":
            t.add("backward", "tp", "reduce_scatter", again * micro, again * stream)
    else:  # a whole-run module works on the replicated stream: no collective
        t.add("forward", "tp", "all_reduce", (outputs - whole) * micro, (outputs - whole) * stream)
        n = inputs + again - frozen_start - whole  # recomputation as above
        t.add("backward", "tp", "all_reduce", n * micro, n * stream)
    if last and layout.loss_parallel:
        t.add("loss", "tp", "all_reduce", 3 * micro, 3 * layout.tokens * d.c * micro)
    elif last:
        t.add("forward", "tp", "all_gather", micro, layout.tokens * s.vocab_size * d.a * micro)


def _whole_blocks(layout: Layout, layers: list[int]) -> int:
    """The rank's blocks holding a module that tensor parallel runs whole on the gathered
    sequence (the ``gathered`` style: MoE layers)."""
    names = layout.model.block_names
    owners = [name for name, style in layout.tp_styles.items() if style == "gathered"]
    return sum(any(o.startswith(names[layer] + ".") for o in owners) for layer in layers)


def add_context_parallel(t: Traffic, layout: Layout, layers: list[int]) -> None:
    cp = layout.dims.cp
    if cp == 1:
        return
    s, d = layout.shape, dtypes(layout)
    micro = layout.accum * layout.microbatches
    n, again = len(layers) * micro, recomputed(layout, layers) * micro
    heads, kv = s.n_heads // layout.dims.tp, s.n_kv_heads // layout.dims.tp
    if layout.cfg.parallelism.context_parallel_method == "allgather":
        gathered = layout.tokens * cp * kv * s.head_dim * d.a  # one of k, v, whole sequence
        t.add("forward", "cp", "all_gather", 2 * n, 2 * n * gathered)
        t.add("backward", "cp", "all_gather", 2 * again, 2 * again * gathered)
        t.add("backward", "cp", "reduce_scatter", 2 * n, 2 * n * gathered)
    else:
        size = layout.tokens * (2 * heads + 2 * kv) * s.head_dim * d.a
        t.add("forward", "cp", "all_to_all", 4 * n, n * size)
        t.add("backward", "cp", "all_to_all", 4 * (n + again), (n + again) * size)


def add_expert_parallel(t: Traffic, layout: Layout, layers: list[int]) -> None:
    moe = [i for i in layers if layout.shape.is_moe(i)]
    if layout.dims.ep == 1 or not moe:
        return
    s, d = layout.shape, dtypes(layout)
    micro = layout.accum * layout.microbatches
    routed = layout.tokens * s.top_k * s.dim * d.a  # balanced: what a rank sends = receives
    n = len(moe) * micro
    again = sum(1 for i in moe if layout.checkpointed(layers.index(i))) * micro
    t.add("forward", "ep", "all_to_all", 3 * n, n * (2 * routed + s.n_experts * INDEX_BYTES))
    t.add("backward", "ep", "all_to_all", 2 * n + 3 * again,
          2 * n * routed + again * (2 * routed + s.n_experts * INDEX_BYTES))



def add_pipeline(t: Traffic, layout: Layout, stage_ids: list[int]) -> None:
    if layout.pipeline is None:
        return
    s, d = layout.shape, dtypes(layout)
    tp_cut = layout.dims.tp if layout.sequence_parallel else 1
    message = layout.tokens * s.dim * d.a / tp_cut
    m = layout.microbatches * layout.accum
    n_stages = len(layout.pipeline.stage_units)
    sends = sum(m * ((s_ < n_stages - 1) + (s_ > 0)) for s_ in stage_ids)
    t.add("pipeline", "pp", "send", sends, sends * message)
    t.add("pipeline", "pp", "recv", sends, sends * message)


def _partial_grads(layout: Layout) -> tuple[int, int]:
    """(tensors, elements) of the trainable gradients TP leaves as partial sums:
    the norms on a sequence-cut stream, the per-head norms, and weights
    replicated inside a cut linear (LoRA's factors)."""
    partial = ("norm", "head_norm") if layout.sequence_parallel else ("head_norm",)
    cut_styles = (*OUT_CUT, *IN_CUT)
    params = [p for p in layout.model.params if p.trainable and (
        layout.tp_styles.get(p.owner) in partial
        or (layout.tp_styles.get(p.owner) in cut_styles and not tp_cut(layout, p)))]
    return len(params), sum(math.prod(p.shape) for p in params)


def add_step(t: Traffic, layout: Layout) -> None:
    """The token count and the loss; the norms' partial gradients; the gradient norm."""
    t.add("step", "dp_cp", "all_reduce", 2, 2 * 8)
    if layout.pipeline is not None:
        t.add("step", "pp", "all_reduce", 1, 8)
        t.add("optimizer", "pp", "all_reduce", 1, layout.storage_bytes)  # the squared norm
    tensors, elements = _partial_grads(layout)
    if layout.dims.tp > 1 and layout.fsdp:  # FSDP2 makes them whole before reduce-scattering
        n = reduce_scatters(layout)  # (its unsharded gradients: in the compute dtype)
        t.add("backward", "tp", "all_reduce", n * tensors, n * elements * layout.compute_bytes)
    elif layout.dims.tp > 1:  # the clip does
        t.add("optimizer", "tp", "all_reduce", tensors, elements * layout.storage_bytes)
    for dims, tensors in _norm_groups(layout):
        for dim in dims:
            t.add("optimizer", dim, "all_reduce", 1, tensors * layout.storage_bytes)
    if layout.fsdp and layout.dims.dp_shard > 1:  # a converter's (float8's scales)
        size = _step_reduced_bytes(layout)
        t.add("optimizer", layout.dims.fsdp_dim, "all_reduce", int(size > 0), size)


def _step_reduced_bytes(layout: Layout) -> int:
    """The bytes the converters all-reduce over the FSDP shards after the optimizer step."""
    return sum(c.costs.step_reduced_bytes(module, name) for c in layout.converters
               for module in layout.model.converted.modules()
               for name, _ in module.named_parameters(recurse=False))


def _tp_distributed(layout: Layout, style: str | None) -> bool:
    """Whether tensor parallel makes the owner's parameters DTensors: a style that only
    moves the module's inputs and outputs, or does nothing in this setting, does not."""
    if style in (None, "gathered", "sliced", "replicate_input"):
        return False
    return style != "norm" or layout.sequence_parallel


def _norm_groups(layout: Layout) -> list[tuple[tuple[str, ...], int]]:
    """(dims that shard them, tensors) of each group of gradients of one layout:
    the gradient norm all-reduces the group's per-tensor norms over each dim."""
    fsdp = (layout.dims.fsdp_dim,) if layout.fsdp else ()
    groups: dict[tuple, int] = defaultdict(int)
    for p in layout.model.params:
        if not p.trainable:
            continue
        if p.expert and layout.dims.ep > 1:
            # DTensor reduces a norm partial over efsdp x ep in one all-reduce
            kind, dims = "experts", (EXPERTS if layout.fsdp else "ep",)
        else:
            cut = tp_cut(layout, p)
            style = layout.tp_styles.get(p.owner)
            # a cut weight, a tp-replicated DTensor, or a plain one: each its own mesh
            kind = style in OUT_CUT if cut else _tp_distributed(layout, style)
            dims = (*fsdp, *(("tp",) if cut else ()))
        groups[(kind, dims)] += 1
    return [(dims, n) for (_, dims), n in groups.items() if dims]


def traffic(layout: Layout) -> dict:
    """The step's collectives on the first rank (pipeline rank 0's stages)."""
    stage_ids = layout.stages()[0]
    state = rank_state(layout, stage_ids)
    t = Traffic(layout)
    names = layout.model.block_names
    if layout.pipeline is None:
        layers, first, last = list(range(len(names))), True, True
    else:
        units = {u for s in stage_ids for u in layout.stage_units(s)}
        layers = [i for i, n in enumerate(names) if n in units]
        first, last = 0 in stage_ids, len(layout.pipeline.stage_units) - 1 in stage_ids
    add_data_parallel(t, layout, state)
    add_tensor_parallel(t, layout, layers, first, last)
    add_context_parallel(t, layout, layers)
    add_expert_parallel(t, layout, layers)
    add_pipeline(t, layout, stage_ids)
    add_step(t, layout)
    return t.table()
