"""Every valid layout of a world that fits, ranked by predicted tokens/s.

A layout is the config with its degrees (tp within a node, pp up to half the
blocks, cp while each rank keeps 4096 tokens of a sequence or more, ep,
dp_replicate), ZeRO stage, activation checkpointing mode and local batch
replaced; the global batch (sequences per optimizer step) stays the
config's, the rest of the data-parallel share goes into gradient
accumulation. Each one is checked by training's own validation
(``plan_layout``); what it refuses is skipped.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from composer.config import ConfigError, JobConfig
from composer.parallel.stages import SINGLE_STAGE
from composer.planner.cluster import Cluster
from composer.planner.layout import Model, layout_of
from composer.planner.predict import Prediction, label, predict

AC_MODES = ("none", "selective_op", "full")
MIN_CP_CHUNK = 4096  # context parallel is tried where each rank keeps this many tokens or more


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def global_sequences(cfg: JobConfig, world_size: int) -> int:
    """Sequences per optimizer step: the config's global batch, or its local batch
    on every rank of the config's own data-parallel degree."""
    t, p = cfg.training, cfg.parallelism
    if t.global_batch_size > 0:
        return t.global_batch_size
    model_parallel = (p.tensor_parallel_degree * p.pipeline_parallel_degree
                      * p.context_parallel_degree)
    return t.local_batch_size * max(world_size // model_parallel, 1)


@dataclass(frozen=True)
class Degrees:
    tp: int
    pp: int
    cp: int
    ep: int
    replicate: int


def _degrees(cfg: JobConfig, model: Model, world: int, per_node: int) -> list[Degrees]:
    s = model.shape
    out = []
    max_cp = max(cfg.data.seq_len // MIN_CP_CHUNK, 1)
    for tp in (t for t in divisors(world) if t <= per_node):
        for pp in (p for p in divisors(world // tp) if p <= s.n_layers // 2 or p == 1):
            for cp in (c for c in divisors(world // (tp * pp)) if c <= max_cp):
                dp = world // (tp * pp * cp)
                eps = [e for e in divisors(dp * cp) if s.n_experts % e == 0] if s.n_experts else [1]
                replicas = {1} | ({dp // (per_node // (tp * cp))} if per_node % (tp * cp) == 0
                                  and dp % max(per_node // (tp * cp), 1) == 0 else set())
                for ep, rep in itertools.product(eps, sorted(replicas)):
                    if rep and dp % rep == 0:
                        out.append(Degrees(tp, pp, cp, ep, rep))
    return out


def _config(cfg: JobConfig, d: Degrees, zero: int, ac: str, local: int,
            sequences: int) -> JobConfig:
    c = copy.deepcopy(cfg)
    p, t = c.parallelism, c.training
    p.tensor_parallel_degree, p.pipeline_parallel_degree = d.tp, d.pp
    p.context_parallel_degree, p.expert_parallel_degree = d.cp, d.ep
    p.data_parallel_replicate_degree, p.data_parallel_shard_degree = d.replicate, -1
    p.zero_stage, p.pipeline_parallel_microbatches = zero, 0
    c.activation_checkpoint.mode = ac
    t.local_batch_size, t.global_batch_size = local, sequences
    return c


class _Search:
    """The layouts tried so far: those that fit, and the closest that does not."""

    def __init__(self, model: Model, world: int, cluster: Cluster):
        self.model, self.world, self.cluster = model, world, cluster
        self.fitting: list[Prediction] = []
        self.closest: Prediction | None = None
        self.tried = 0

    def fits(self, c: JobConfig) -> bool | None:
        """Whether ``c`` fits (None: training's validation refuses it)."""
        try:
            layout = layout_of(c, self.model, self.world, self.cluster.device)
        except ConfigError:
            return None
        self.tried += 1
        p = predict(layout, self.cluster)
        if p.fits:
            self.fitting.append(p)
        elif self.closest is None or p.peak.peak.total < self.closest.peak.peak.total:
            self.closest = p
        return p.fits

    def degrees(self, cfg: JobConfig, d: Degrees, sequences: int) -> None:
        """Per ZeRO stage and AC mode, the largest local batch that fits: memory
        grows with it and falls with each costlier AC mode, and a larger batch
        (fewer accumulation steps, a smaller pipeline bubble) is never slower
        in this model. So a stage whose smallest batch does not fit under full
        AC is skipped, the largest batch that fits is found by bisection, and no
        costlier AC mode is tried once the largest batch fits."""
        dp = self.world // (d.tp * d.pp * d.cp)
        if sequences % dp:
            return
        stages = d.pp * (1 if cfg.parallelism.pipeline_parallel_schedule in SINGLE_STAGE else 2)
        batches = [b for b in divisors(sequences // dp) if d.pp == 1 or b % stages == 0]
        for zero in (0, 1, 2, 3):
            if not batches or not self.fits(_config(cfg, d, zero, "full", batches[0], sequences)):
                continue
            for ac in AC_MODES:
                if self._largest(cfg, d, zero, ac, batches, sequences) == len(batches) - 1:
                    break

    def _largest(self, cfg, d: Degrees, zero: int, ac: str, batches: list[int],
                 sequences: int) -> int:
        """The index of the largest local batch that fits (-1: none)."""
        low, high = 0, len(batches) - 1
        while low <= high:
            mid = (low + high) // 2
            if self.fits(_config(cfg, d, zero, ac, batches[mid], sequences)):
                low = mid + 1
            else:
                high = mid - 1
        return high


def search(cfg: JobConfig, model: Model, world: int,
           cluster: Cluster) -> tuple[list[Prediction], int]:
    """(the layouts that fit, fastest first; how many valid ones were tried).
    Raises ValueError when none fits, saying how far the best one is."""
    sequences = global_sequences(cfg, world)
    s = _Search(model, world, cluster)
    for degrees in _degrees(cfg, model, world, cluster.devices_per_node):
        s.degrees(cfg, degrees, sequences)
    fitting, tried, closest = s.fitting, s.tried, s.closest
    if not fitting:
        if closest is None:
            raise ValueError(f"no valid layout of {world} ranks for {sequences} sequences per step")
        need = closest.peak.gib()["peak"]
        raise ValueError(f"no layout of {world} ranks fits {cluster.name}: the closest "
                         f"({label(closest.layout)}) needs {need:.1f} GiB per rank of "
                         f"{closest.capacity_gib:.1f} usable ({need / closest.capacity_gib:.2f}x); "
                         f"add nodes, or use LoRA or a shorter sequence")
    fitting.sort(key=lambda p: -p.time.tokens_per_second)
    return fitting, tried


def why_slower(p: Prediction, best: Prediction) -> str:
    """What costs this layout its step time against the best one: the largest of
    more compute (recomputation, op overhead), more exposed communication (and
    the dim that carries most), a larger pipeline bubble."""
    a, b = p.time, best.time
    ratio = a.step_s * best.layout.global_tokens / (b.step_s * p.layout.global_tokens)
    worst = max(a.by_dim, key=lambda d: a.by_dim[d] - b.by_dim.get(d, 0), default=None)
    causes = {"compute (recomputation, op overhead)": a.compute_s - b.compute_s,
              f"exposed communication (most on {worst})": a.exposed_comm_s - b.exposed_comm_s,
              "pipeline bubble": a.step_s * a.bubble - b.step_s * b.bubble}
    cause = max(causes, key=causes.get)
    return f"{ratio:.2f}x the step time per token; most from {cause}, +{causes[cause]:.3g} s"
