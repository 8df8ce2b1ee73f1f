"""Step time from FLOPs, bytes and the cluster: each matmul on the device's roofline by
its shape and dtype (``composer.planner.roofline``), attention at its stated fraction of
the compute dtype's peak (on the CPU also its scores' passes and a cost per query row),
element-wise ops, a converter's casts and the optimizer step at
the device's memory bandwidth (CPU ranks beyond the cores share them), a host cost per
launched op, each collective's ring bytes over the link its group crosses (NVLink inside
a node, InfiniBand across, by the mesh's order: tp innermost) plus a latency per
collective, what overlaps with compute hidden, and the pipeline's bubble from the
schedule's own simulation (``composer.tools.pipeline_report``).

What overlaps on a GPU: FSDP2's all-gathers (prefetched) and gradient
reductions, DDP's bucketed all-reduces and the pipeline's sends run beside
the compute, except the first gather of a forward and the last reduction of a
backward; tensor, context and expert parallel's collectives sit between the
ops that need them and are exposed. On the CPU one set of cores does both,
so nothing is hidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from composer.planner import activations as act
from composer.planner.cluster import Cluster, link_gbps_latency, spans_nodes
from composer.planner.comm import group_ranks
from composer.planner.layout import Layout
from composer.planner.roofline import compute_dtype_name, efficiency, matmul_seconds, peak_of
from composer.planner.schedule import build as build_timeline
from composer.planner.state import rank_state, state_bytes

# Where the model's step cannot be traced: host-launched ops per block per microbatch
# (forward + backward: matmuls, norms, rotary, attention, SwiGLU, the autograd nodes of
# each), and per parameter tensor in the optimizer step, counted on the debug model.
OPS_PER_BLOCK = 160
OPS_PER_TENSOR = 6
HIDDEN_KINDS = ("send", "recv")  # pipeline traffic runs beside the compute
ELEMENTWISE_PASSES = 4  # an activation's bytes: written, read back, its gradient written and read


@dataclass
class StepTime:
    compute_s: float
    comm_s: float          # every collective, one after another
    exposed_comm_s: float  # what the compute does not hide
    bubble: float          # the pipeline schedule's idle fraction
    step_s: float
    tokens_per_second: float  # per device
    mfu: float | None     # model FLOPs over the compute dtype's peak
    comm_share: float      # exposed communication over the step
    by_dim: dict[str, float]  # communication seconds per mesh dim
    efficiency: float      # the matmuls' achieved fraction of their dtypes' peaks
    terms: dict[str, float]  # compute's parts: matmul (casts included), attention,
    # elementwise, optimizer, host (CPU ranks' share of the cores applied)


def recompute_factor(layout: Layout) -> float:
    """Training FLOPs with activation checkpointing over those without: full AC
    runs every block's forward again (forward = 1/3 of a step's matmuls);
    selective-op recomputes element-wise ops only."""
    ac = layout.cfg.activation_checkpoint
    if ac.mode == "full":
        return 4 / 3
    if ac.mode == "selective_layer":
        return 1 + 1 / (3 * ac.every)
    return 1.0


def model_flops_per_rank(layout: Layout) -> float:
    """Training FLOPs of one step on one rank, without recomputation."""
    per_token = layout.model.flops_per_token(layout.cfg.data.seq_len)
    return per_token * layout.global_tokens / layout.dims.world_size


def _ops(layout: Layout) -> int:
    """Ops a rank launches in a step: the traced step's (its blocks' averaged over the
    pipeline's ranks), or OPS_PER_BLOCK a block, and the optimizer's per tensor."""
    micro = layout.accum * layout.microbatches
    tensors = len(layout.model.params) / layout.dims.pp
    traced = layout.model.traced
    if traced is None:
        per_micro = OPS_PER_BLOCK * layout.shape.n_layers / layout.dims.pp
    else:
        blocks = sum(traced.blocks[i].launches for i in range(layout.shape.n_layers))
        per_micro = blocks / layout.dims.pp + traced.first.launches + traced.last.launches
    return int(per_micro * micro + OPS_PER_TENSOR * tensors)


def comm_seconds(layout: Layout, table: dict, cluster: Cluster) -> tuple[dict, float, float]:
    """(seconds per dim, all of it, what overlaps on this cluster). A collective
    pays the link's latency once per ring step (n - 1 of them; a send once)."""
    groups = group_ranks(layout)
    by_dim: dict[str, float] = {}
    hidden = 0.0
    for phase, dims in table.items():
        for dim, kinds in dims.items():
            ranks = groups.get(dim) or groups["dp_cp"]
            rate, latency = link_gbps_latency(cluster, spans_nodes(ranks, cluster.devices_per_node))
            for kind, c in kinds.items():
                steps = 1 if kind in HIDDEN_KINDS else len(ranks) - 1
                seconds = c["ring_bytes"] / rate + c["count"] * steps * latency
                by_dim[dim] = by_dim.get(dim, 0.0) + seconds
                if cluster.device == "cuda" and _overlaps(layout, dim, kind):
                    hidden += seconds
    return by_dim, sum(by_dim.values()), hidden


def _overlaps(layout: Layout, dim: str, kind: str) -> bool:
    if kind in HIDDEN_KINDS:
        return True
    data_parallel = dim not in ("tp", "cp", "ep", "pp")
    return data_parallel and kind in ("all_gather", "reduce_scatter", "all_reduce")


@lru_cache(maxsize=256)
def _bubble(schedule: str, pp: int, microbatches: int, per_rank: int) -> float:
    return float(build_timeline(schedule, pp, microbatches, per_rank).bubble())


def elementwise_bytes(layout: Layout) -> float:
    """Bytes a step's memory-bound ops (norms, rotary, SwiGLU, softmax, the residual
    adds, their gradients) move through device memory: what the traced step's ops read
    and write (``Piece.traffic``: tensor parallel divides the part it cuts, the logits'
    only with loss parallel); where it cannot be traced, each activation a forward
    keeps written, read back in backward, and its gradient written and read."""
    traced, n = layout.model.traced, layout.shape.n_layers
    if traced is None:
        costs = act.costs(layout)
        per_token = sum(sum(costs.block(layout, i).values()) for i in range(n)) / layout.dims.pp
        per_token = ELEMENTWISE_PASSES * (per_token + sum(costs.last(layout).values()))
    else:
        def share(split, cut=True):
            return split.share(layout.dims.tp, layout.sequence_parallel, cut)
        per_token = (sum(share(traced.blocks[i].traffic) for i in range(n)) / layout.dims.pp
                     + share(traced.first.traffic)
                     + share(traced.last.traffic, cut=layout.loss_parallel))
    micro = layout.accum * layout.microbatches
    return per_token * layout.tokens * micro * recompute_factor(layout)


def optimizer_bytes(layout: Layout) -> float:
    """Bytes the step after backward moves on a rank (pipeline rank 0): AdamW reads both
    moments, the trainable parameter and its gradient and writes the moments and the
    parameter back, 7 passes over what the rank updates (a moment's bytes: half its
    optimizer state); clipping reads every gradient for the norm, then scales it."""
    rest = state_bytes(layout, rank_state(layout, layout.stages()[0]))
    clip = 3 * rest.grads if layout.cfg.training.max_norm > 0 else 0
    return 7 * rest.optimizer / 2 + clip


def _shared(layout: Layout, cluster: Cluster) -> float:
    """The share of a device's compute a rank gets (CPU ranks beyond the cores share them)."""
    ranks = min(layout.dims.world_size, cluster.devices_per_node)
    return min(1.0, cluster.cores_per_node / ranks) if cluster.cores_per_node else 1.0


def attention_flops_per_rank(layout: Layout) -> float:
    """The attention scores and their weighted sum, 12 x layers x heads x head_dim
    x seq_len a token (forward and backward, the causal half not discounted),
    the part of the step's FLOPs that runs in the attention kernel."""
    s = layout.shape
    per_token = 12 * s.n_layers * s.n_heads * s.head_dim * layout.cfg.data.seq_len
    return per_token * layout.global_tokens / layout.dims.world_size


def attention_seconds(layout: Layout, cluster: Cluster, peak: float) -> float:
    """The attention kernel's time on one rank: its FLOPs at ``attention_efficiency`` of
    the compute dtype's ``peak`` (FLOP/s), plus the query x key scores read and written
    ``attention_score_passes`` times at the memory bandwidth and a cost per query row
    and head (``attention_row_us``), the whole sequence's keys for every query."""
    s = layout.shape
    redo = recompute_factor(layout)
    flops = min(attention_flops_per_rank(layout), model_flops_per_rank(layout)) * redo
    rows = s.n_layers * s.n_heads * layout.global_tokens / layout.dims.world_size * redo
    scores = rows * layout.cfg.data.seq_len * layout.compute_bytes
    return (flops / (peak * cluster.attention_efficiency)
            + scores * cluster.attention_score_passes / (cluster.memory_gbps * 1e9)
            + rows * cluster.attention_row_us * 1e-6)


def matmul_time(layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """(seconds of the step's matmuls and a converter's casts on one rank, the matmuls'
    achieved fraction of peak). A model traced instead of given a shape has no GEMMs
    to enumerate: its traced FLOPs less attention's run at the efficiency of a
    square GEMM of its width over the rank's tokens, in the compute dtype."""
    if layout.model.profile is None:
        seconds, ideal, casts = matmul_seconds(layout, cluster)
        return seconds + casts, ideal / seconds if seconds else 1.0
    s = layout.shape
    eff = efficiency(cluster, layout.tokens, s.dim, s.dim)
    flops = model_flops_per_rank(layout) - attention_flops_per_rank(layout)
    peak = peak_of(cluster, compute_dtype_name(layout), compute_dtype_name(layout)) * 1e12
    return max(flops, 0.0) * recompute_factor(layout) / (peak * eff), eff


def step_time(layout: Layout, table: dict, cluster: Cluster) -> StepTime:
    dtype = compute_dtype_name(layout)
    peak = peak_of(cluster, dtype, dtype) * 1e12
    flops = model_flops_per_rank(layout)
    matmuls, eff = matmul_time(layout, cluster)
    shared = _shared(layout, cluster)
    host = _ops(layout) * cluster.op_overhead_us * 1e-6
    # a CPU rank's host work runs on the cores its kernels share; a GPU's host is its own
    terms = {"matmul": matmuls / shared,
             "attention": attention_seconds(layout, cluster, peak) / shared,
             "elementwise": elementwise_bytes(layout) / (cluster.memory_gbps * 1e9) / shared,
             "optimizer": optimizer_bytes(layout) / (cluster.memory_gbps * 1e9) / shared,
             "host": host / shared if cluster.device == "cpu" else host}
    compute = sum(terms.values())
    by_dim, total, overlappable = comm_seconds(layout, table, cluster)
    exposed = total - min(overlappable, 0.9 * compute)  # the first gather and last reduction show
    bubble = 0.0
    if layout.pipeline is not None:
        p = layout.pipeline
        bubble = _bubble(p.schedule, layout.dims.pp, p.microbatches, len(p.ids))
    step = (compute + exposed) / (1 - bubble)
    tokens = layout.global_tokens / step / layout.dims.world_size
    return StepTime(compute, total, exposed, bubble, step, tokens, flops / step / peak,
                    exposed / step, by_dim, eff, terms)
