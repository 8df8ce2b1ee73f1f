"""Context parallel: the sequence of every batch is cut over the ``cp`` ranks.

The sequence is cut into 2*cp chunks and rank r keeps chunks r and 2*cp-1-r, so
every rank has the same causal work (an early chunk with few keys to see, a late
one with many). Each rank runs the whole model on its 2 chunks; only attention
needs the rest of the sequence, and each attention core is replaced by one of
two methods:

- ``allgather``: all-gather the keys and values over ``cp`` (kv heads only, as
  GQA has them: fewer bytes), and run the model's own core on this rank's
  queries over them, masked by global positions; backward reduce-scatters the
  K/V gradients to their ranks.
- ``alltoall`` (Ulysses): an all-to-all trades heads for sequence, so each rank
  holds 1/cp of the heads over the whole sequence, puts it in order and runs
  the model's own core on it (with the model's own mask), and a second
  all-to-all trades back (heads must divide by cp); backward runs the reverse
  all-to-alls.

Either way the model's core computes the attention, so what it honours beyond the
mask (keyword options such as a scale or soft-capping) holds under context parallel
too. Two options depend on what a rank holds: a sliding ``window`` (all-gather
hands the core each chunk over the keys before it, in order, where a window holds by
index, or folds it into an additive mask for a core that takes only those; the
all-to-all core sees the whole sequence in order) and ``sinks``, one logit
per head (the all-to-all core gets those of the rank's heads).

The rotary embedding takes the global positions from the model's ``positions``
argument. Under all-gather the model's mask module (``ModelSpec.parallel.attention_mask``)
is replaced by one for this rank's queries: under FlexAttention a BlockMask by global
position (and with packed ``documents``, of the whole sequence, by document), else
the documents' spans or none (no mask of queries x keys is held), and for cores that
take only additive masks (``takes_spans`` unset) a dense one; a forward builds it once
for all layers.
Exact: every query sees the same keys as on one rank, summed in the same softmax.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

from composer.models.common.mask import LOWER_RIGHT, Documents, position_block_mask
from composer.spec import held

log = logging.getLogger(__name__)


def local_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions cp rank ``rank`` of ``cp`` holds: of 2 x cp chunks,
    ``rank`` and 2 x cp - 1 - ``rank``, so every rank has the same causal work.
    Under context parallel (``parallelize`` with ``dims.cp`` > 1 and ``seq_len``)
    each rank feeds the model these columns of its batch's inputs and targets
    (``rank``: ``dims.coords(global_rank)["cp"]``); the model's forward gets their
    positions as ``positions``. With ``cp`` = 1: every position.

    >>> from composer import local_positions
    >>> local_positions(8, cp=2, rank=0), local_positions(8, cp=2, rank=1)
    (tensor([0, 1, 6, 7]), tensor([2, 3, 4, 5]))
    """
    chunk = seq_len // (2 * cp)
    first, last = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(last, last + chunk)])


def check_cp(cp: int, method: str, spec, args, seq_len: int, tp: int,
             sequence_parallel: bool) -> None:
    """ValueError (naming the key) for what context parallel cannot take."""
    key = f"parallelism.context_parallel_degree={cp}"
    if method == "alltoall":
        for name, count in spec.parallel.heads(args).items():
            if count % (tp * cp):
                raise ValueError(f"{key} with parallelism.context_parallel_method='alltoall': "
                                 f"the model's {name}={count} must divide by tp x cp = {tp * cp}")
    if spec.parallel.attention_cores is None or spec.parallel.attention_mask is None:
        raise ValueError(f"{key}: model {spec.name!r} names no attention cores and mask "
                         f"(ModelSpec.parallel.attention_cores, attention_mask; its forward "
                         f"then takes positions: docs/your_own_model.md); allowed: 1")
    if spec.parallel.moe_modules is not None and spec.parallel.set_sequence_sum is None:
        raise ValueError(f"{key}: model {spec.name!r} has experts but no way to sum their "
                         f"per-sequence statistics over cp (ModelSpec.parallel.set_sequence_sum); "
                         f"allowed: 1")
    if seq_len % (2 * cp):
        raise ValueError(f"{key}: data.seq_len={seq_len} must divide into 2 x cp = "
                         f"{2 * cp} chunks")
    if sequence_parallel and (seq_len // cp) % tp:
        raise ValueError(f"{key}: a rank's {seq_len // cp} positions (data.seq_len / cp) "
                         f"must divide by parallelism.tensor_parallel_degree={tp} for "
                         f"sequence parallel")


def _additive(allowed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, of ``like``'s dtype and device: SDPA
    keeps such a mask for backward as it is (a boolean one it would copy in every
    layer)."""
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(
        ~allowed, float("-inf"))


class ContextMask(nn.Module):
    """The mask of queries at ``queries`` over keys at ``keys`` (global positions):
    each sees the keys at or before it, and with ``documents`` (of the whole
    sequence) only those of its own document. It takes the place of the model's
    ``ModelSpec.parallel.attention_mask``, so one forward builds one for all its layers.
    ``kind`` is what the cores take: ``"flex"``, a BlockMask; ``"spans"``, None or the
    documents' spans (the chunks then attend the keys before them, no mask held);
    ``"dense"`` (cores that take additive masks only), an additive mask of this rank's
    queries over every key."""

    def __init__(self, queries: torch.Tensor, keys: torch.Tensor, kind: str = "spans"):
        super().__init__()
        self.queries, self.keys, self.kind = queries, keys, kind

    def forward(self, documents: torch.Tensor | None, like: torch.Tensor):
        queries, keys = self.queries.to(like.device), self.keys.to(like.device)
        if self.kind == "flex":
            return position_block_mask(queries, keys, documents)
        if self.kind == "spans":
            return None if documents is None else Documents.of(documents)
        allowed = keys[None, :] <= queries[:, None]
        if documents is not None:
            allowed = (allowed & (documents[:, queries, None] == documents[:, None, keys]))[:, None]
        return _additive(allowed, like)


class _GatherSequence(torch.autograd.Function):
    """[batch, heads, s, dim] of each cp rank -> [batch, heads, cp*s, dim] in rank
    order; backward sums the gradients over cp and hands each rank its slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, n = group, dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.unflatten(0, (n, -1)).permute(1, 2, 0, 3, 4).flatten(2, 3)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = dist.get_world_size(ctx.group)
        parts = grad.unflatten(2, (n, -1)).permute(2, 0, 1, 3, 4).contiguous()
        out = parts.new_empty(parts.shape[1:])
        dist.reduce_scatter_tensor(out, parts.flatten(0, 1), group=ctx.group)
        return out, None


class GatheredAttention(nn.Module):
    """The model's own attention core on this rank's queries (at global positions
    ``queries``) over the whole sequence's keys and values (all-gathered over
    ``cp``, at ``keys``). Given a BlockMask, under it; given an additive mask, under
    it, with a sliding ``window`` folded in by global position. Else (causal, or
    packed ``Documents``) each of the rank's two chunks attends the keys of the
    sequence up to its end, aligned to the lower right (``LOWER_RIGHT``; per document
    with documents): exact, and no mask of queries x keys is built (a core's own
    ``window`` holds by index)."""

    def __init__(self, mesh: DeviceMesh, core: nn.Module, queries: torch.Tensor,
                 keys: torch.Tensor):
        super().__init__()
        self.group, self.core = mesh.get_group(), core
        self.queries, self.keys = queries, keys
        self.in_order = keys.argsort()
        chunk = len(queries) // 2  # the rank's two chunks: where each starts in the sequence
        self.starts = [int(queries[i]) for i in (0, chunk)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask,
                window: int | None = None, **options) -> torch.Tensor:
        k, v = (_GatherSequence.apply(t, self.group) for t in (k, v))
        if isinstance(mask, torch.Tensor) and window is not None:
            queries, keys = self.queries.to(q.device), self.keys.to(q.device)
            mask = mask + _additive(queries[:, None] - keys[None, :] < window, mask)
        elif window is not None:
            options["window"] = window
        if isinstance(mask, (torch.Tensor, BlockMask)):
            return self.core(q, k, v, mask, **options)
        k, v = (t.index_select(2, self.in_order.to(q.device)) for t in (k, v))
        chunk = q.shape[2] // 2
        return torch.cat([
            self.core(part, k[:, :, :start + chunk], v[:, :, :start + chunk],
                      LOWER_RIGHT if mask is None else mask.at(start), **options)
            for part, start in zip(q.split(chunk, dim=2), self.starts)], dim=2)


def sum_over(group):
    """A sum of a (gradient-free) tensor over ``group``, as a new tensor."""
    def sequence_sum(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t
    return sequence_sum


class _AllToAll(torch.autograd.Function):
    """[n, ...] chunks: chunk j goes to rank j, rank j's chunk for us comes back as
    chunk j. Its own inverse, so backward sends the gradients the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # before empty_like, which would copy a view's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


def heads_for_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, H, s, d] (this rank's positions, every head) -> [b, H/n, n*s, d] (every
    rank's positions in rank order, this rank's 1/n of the heads)."""
    n = dist.get_world_size(group)
    chunks = x.unflatten(1, (n, -1)).movedim(1, 0)
    return _AllToAll.apply(chunks, group).permute(1, 2, 0, 3, 4).flatten(2, 3)


def sequence_for_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``heads_for_sequence``."""
    n = dist.get_world_size(group)
    chunks = x.unflatten(2, (n, -1)).permute(2, 0, 1, 3, 4)
    return _AllToAll.apply(chunks, group).movedim(0, 1).flatten(1, 2)


class UlyssesAttention(nn.Module):
    """The model's own attention core, over the whole sequence in order, for 1/cp
    of the heads, between two all-to-alls over ``cp``. The whole sequence is on
    every rank here, so the model's own mask of the whole sequence serves (none
    for plain causal attention: no mask is held at all)."""

    def __init__(self, mesh: DeviceMesh, seq_len: int, core: nn.Module):
        super().__init__()
        self.group, self.core = mesh.get_group(), core
        # rank order (each rank's two chunks in turn) -> sequence order, and back
        gathered = torch.cat([local_positions(seq_len, mesh.size(), r) for r in range(mesh.size())])
        self.in_order = gathered.argsort()
        self.back = self.in_order.argsort()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask,
                sinks: torch.Tensor | None = None, **options) -> torch.Tensor:
        order = self.in_order.to(q.device)
        q, k, v = (heads_for_sequence(t, self.group).index_select(2, order) for t in (q, k, v))
        if sinks is not None:  # this rank's heads are the rank-th of cp equal parts
            n, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            options["sinks"] = sinks.unflatten(0, (n, -1))[rank]
        out = self.core(q, k, v, mask, **options).index_select(2, self.back.to(q.device))
        return sequence_for_heads(out, self.group)


def apply_cp(model: nn.Module, spec, mesh: DeviceMesh, seq_len: int,
             method: str = "allgather", flex: bool = False, dense: bool = False) -> None:
    """Put the ``method``'s attention in place of each attention core of ``model``
    (a whole model or a pipeline stage), hand its forward this rank's ``positions``
    unless the caller gives them (packed documents counting from 0 each), and let
    it sum per-sequence statistics over ``cp`` (``ModelSpec.parallel.set_sequence_sum``).
    ``documents``, when given, are those of the whole sequence. ``flex``: the
    model's attention runs FlexAttention (all-gather's masks are then BlockMasks);
    ``dense``: all-gather's masks are additive ones of the rank's queries (compiled
    blocks: one graph cannot loop over the documents' spans)."""
    core_fqns = held(model, spec.parallel.attention_cores(model))
    # cores that take Documents and LowerRight; others, additive masks only
    spans = all(getattr(model.get_submodule(f), "takes_spans", False) for f in core_fqns)
    if spec.parallel.set_sequence_sum is not None:
        spec.parallel.set_sequence_sum(model, sum_over(mesh.get_group()))
    cp, rank = mesh.size(), mesh.get_local_rank()
    positions = local_positions(seq_len, cp, rank)
    every = torch.cat([local_positions(seq_len, cp, r) for r in range(cp)])
    for fqn in core_fqns:
        core = model.get_submodule(fqn)
        model.set_submodule(fqn, GatheredAttention(mesh, core, positions, every)
                            if method == "allgather" else UlyssesAttention(mesh, seq_len, core))
    if method == "allgather":  # this rank's queries over every rank's keys
        kind = "flex" if flex else "spans" if spans and not dense else "dense"
        model.set_submodule(spec.parallel.attention_mask, ContextMask(positions, every, kind))

    def with_positions(module, args, kwargs):
        device = args[0].device if args else next(iter(kwargs.values())).device
        return args, {"positions": positions.to(device), **kwargs}

    model.register_forward_pre_hook(with_positions, with_kwargs=True)
    log.info("applied context parallel x%d (%s) to %d attention cores (chunks r and %d-r "
             "of a sequence per rank)", mesh.size(), method, len(core_fqns), 2 * mesh.size() - 1)
