"""Matmul time by shape: every GEMM of a step against the device's roofline.

A GEMM of ``m x k`` by ``k x n`` does ``2 m k n`` FLOPs and moves at least its two
operands and its output through device memory once; it takes the longer of the two
times, FLOPs at ``peak x efficiency(m, k, n)`` and bytes at the memory bandwidth. The
efficiency falls for thin matmuls (a small smallest dimension fills a kernel's tiles,
or a CPU's vector registers, in part) and for small ones (a fixed cost per call, a tail
of unfilled waves), each by a saturating factor with a profile's half point:

    efficiency = matmul_efficiency x d / (d + matmul_half_dim) x F / (F + matmul_half_gflop)

with ``d`` the smallest of ``m, k, n`` and ``F`` the GEMM's GFLOPs (a tile filled in
part does work in proportion to its filled width; a fixed time per call costs as much
as ``matmul_half_gflop`` of work would). A thin GEMM's operands then usually bound it first:
it streams them at the memory bandwidth. The host's cost of launching the op is not in
it (time.py counts it once for every op).

The GEMMs of a step come from the converted model itself: each 2-D parameter of an
``nn.Linear`` (its weight, a LoRA factor) multiplies the rank's tokens of one
microbatch (the sequence slice context parallel leaves it, gathered where sequence
parallel had cut it), as the rank holds it (tensor parallel cuts the features its
plan's style shards); each slice of a stacked MoE expert weight multiplies the tokens
routed to that expert (balanced routing: ``top_k x ep / n_experts`` of the tokens, as
the memory model assumes). A linear runs three GEMMs, forward, input gradient and
weight gradient (the last only where the parameter trains), and its forward once more
in a block that activation checkpointing recomputes.

Converters choose a GEMM's dtype and its casts through their cost hints
(``CostHints.matmul_dtype`` and ``cast_bytes``): the cast of each operand is
memory-bound time; a dtype the cluster gives no peak for runs at the compute dtype's
(float8 emulated, or on a GPU without float8 units).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from composer.parallel.tensor import sharded_dim
from composer.planner.cluster import Cluster
from composer.planner.layout import Layout

GEMMS = ("forward", "input_grad", "weight_grad")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float8": 1}
DTYPE_NAMES = {8: "float64", 4: "float32", 2: "bfloat16"}


def efficiency(cluster: Cluster, m: float, k: float, n: float) -> float:
    """The fraction of peak a GEMM of these dimensions reaches when compute bound."""
    d, gflop = min(m, k, n), 2 * m * k * n / 1e9
    return (cluster.matmul_efficiency * d / (d + cluster.matmul_half_dim)
            * gflop / (gflop + cluster.matmul_half_gflop))


def gemm_seconds(cluster: Cluster, m: float, k: float, n: float, peak_tflops: float,
                 in_bytes: int, out_bytes: int) -> float:
    """One GEMM's roofline time: compute at the shape's efficiency, or its operands
    (``in_bytes`` an element) and output (``out_bytes``) at the memory bandwidth."""
    compute = 2 * m * k * n / (peak_tflops * 1e12 * efficiency(cluster, m, k, n))
    memory = ((m * k + k * n) * in_bytes + m * n * out_bytes) / (cluster.memory_gbps * 1e9)
    return max(compute, memory)


@dataclass(frozen=True)
class Gemm:
    """One GEMM a step runs ``count`` times on a rank: ``m x k`` by ``k x n``."""

    m: float
    k: float
    n: float
    count: float
    dtype: str           # the dtype it multiplies in
    cast_bytes: float    # bytes its operands' casts into ``dtype`` move, each time

    @property
    def flops(self) -> float:
        return 2 * self.m * self.k * self.n * self.count


def compute_dtype_name(layout: Layout) -> str:
    return DTYPE_NAMES[layout.compute_bytes]


def peak_of(cluster: Cluster, dtype: str, fallback: str) -> float:
    """The cluster's peak for ``dtype``, or the ``fallback`` dtype's (ValueError
    where it has neither)."""
    peaks = cluster.peak_tflops
    if dtype in peaks:
        return peaks[dtype]
    if fallback not in peaks:
        raise ValueError(f"cluster {cluster.name}: no peak_tflops for {fallback}; it has "
                         f"{', '.join(peaks)}")
    return peaks[fallback]


def matmul_seconds(layout: Layout, cluster: Cluster) -> tuple[float, float, float]:
    """(the step's GEMM seconds on one rank, those at each GEMM's peak, the casts'
    seconds): the second over the first is the matmuls' achieved fraction of peak."""
    base = compute_dtype_name(layout)
    seconds = ideal = cast = 0.0
    for g in step_gemms(layout):
        peak = peak_of(cluster, g.dtype, base)
        in_bytes = DTYPE_BYTES[g.dtype] if g.dtype in cluster.peak_tflops else layout.compute_bytes
        seconds += g.count * gemm_seconds(cluster, g.m, g.k, g.n, peak, in_bytes,
                                          layout.compute_bytes)
        ideal += g.flops / (peak * 1e12)
        cast += g.count * g.cast_bytes / (cluster.memory_gbps * 1e9)
    return seconds, ideal, cast


@dataclass(frozen=True)
class Site:
    """A weight the tokens meet: ``module``'s parameter ``name``, as the rank holds it
    (``k`` in, ``n`` out features), for ``share`` of the tokens, ``copies`` times."""

    module: nn.Module
    name: str
    k: int
    n: int
    trainable: bool
    block: int | None
    share: float = 1.0
    copies: int = 1


def sites(layout: Layout) -> list[Site]:
    """Every linear weight (and LoRA factor) and stacked expert weight of the
    converted model, with the block it lies in (kept on the model for the next layout
    that cuts it alike)."""
    key = (layout.dims.tp, layout.dims.ep, layout.sequence_parallel, layout.loss_parallel)
    cache = layout.model.__dict__.setdefault("_gemm_sites", {})
    if key not in cache:
        cache[key] = _sites(layout)
    return cache[key]


def _sites(layout: Layout) -> list[Site]:
    model = layout.model
    moe = model.spec.parallel.moe_modules
    experts = {f"{n}.experts" for n in (moe(model.converted) if moe else {})}
    block_of = {f"{b}.{sub}": i for i, b in enumerate(model.block_names)
                for sub, _ in model.converted.get_submodule(b).named_modules() if sub}
    out = []
    for fqn, module in model.converted.named_modules():
        if not (isinstance(module, nn.Linear) or fqn in experts):
            continue
        block = block_of.get(fqn)
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 2 and isinstance(module, nn.Linear):
                out.append(_site(layout, fqn, module, name, p, block))
            elif p.dim() == 3 and fqn in experts:
                out.append(_expert_site(layout, fqn, module, name, p, block))
    return out


def _held(layout: Layout, fqn: str, shape: tuple[int, ...], weight) -> tuple[int, ...]:
    """``shape`` as tensor parallel leaves it on a rank."""
    dim = sharded_dim(layout.tp_styles.get(fqn), shape, weight)
    if dim is None:
        return shape
    held = list(shape)
    held[dim] //= layout.dims.tp
    return tuple(held)


def _site(layout, fqn, module, name, p, block) -> Site:
    out, k = _held(layout, fqn, tuple(p.shape), tuple(module.weight.shape))
    return Site(module, name, k, out, p.requires_grad, block)


def _expert_site(layout, fqn, module, name, p, block) -> Site:
    """One expert's slice of a stacked [experts, out, in] weight; the rank holds
    ``experts / ep`` of them, each getting ``top_k x ep / experts`` of its tokens."""
    s, ep = layout.shape, layout.dims.ep
    experts, out, k = _held(layout, fqn, tuple(p.shape), tuple(p.shape))
    return Site(module, name, k, out, p.requires_grad, block, s.top_k * ep / s.n_experts,
                experts // ep)


def recomputes_matmuls(layout: Layout, block: int) -> bool:
    """Whether a block's forward matmuls run again in backward (selective-op AC keeps
    their outputs)."""
    mode = layout.cfg.activation_checkpoint.mode
    return mode == "full" or (mode == "selective_layer" and layout.checkpointed(block))


def step_gemms(layout: Layout) -> list[Gemm]:
    """The GEMMs one step runs on a rank: the blocks' averaged over the pipeline's
    ranks, the rest (the head) whole, as the stage holding it runs it; alike GEMMs (the
    same shape and dtype: every block's) merged into one."""
    micro = layout.accum * layout.microbatches
    merged: dict[tuple, float] = {}
    for site in sites(layout):
        per_rank = 1 / layout.dims.pp if site.block is not None else 1.0
        again = site.block is not None and recomputes_matmuls(layout, site.block)
        for gemm in GEMMS:
            if gemm == "weight_grad" and not site.trainable:
                continue
            runs = micro * per_rank * site.copies * (1 + (again and gemm == "forward"))
            key = _gemm(layout, site, gemm)
            merged[key] = merged.get(key, 0.0) + runs
    return [Gemm(m, k, n, runs, dtype, cast) for (m, k, n, dtype, cast), runs in merged.items()]


def _gemm(layout: Layout, site: Site, gemm: str) -> tuple:
    """(m, k, n, dtype, cast bytes) of one of ``site``'s GEMMs."""
    m = layout.tokens * site.share
    m, k, n = {"forward": (m, site.k, site.n), "input_grad": (m, site.n, site.k),
               "weight_grad": (site.k, m, site.n)}[gemm]
    dtype, cast = _hints(layout, site, gemm)
    return m, k, n, dtype, cast * (m * k + k * n)


def _hints(layout: Layout, site: Site, gemm: str) -> tuple[str, float]:
    """The dtype the converters run ``site``'s ``gemm`` in and the bytes their casts move
    per operand element (kept on the model: the same for every layout)."""
    base, itemsize = compute_dtype_name(layout), layout.compute_bytes
    cache = layout.model.__dict__.setdefault("_gemm_hints", {})
    key = (id(site), gemm, base, itemsize)
    if key not in cache:
        dtype, cast = base, 0.0
        for converter in layout.converters:
            hints = converter.costs
            dtype = hints.matmul_dtype(site.module, site.name, gemm) or dtype
            cast += hints.cast_bytes(site.module, site.name, gemm, itemsize)
        cache[key] = dtype, cast
    return cache[key]
