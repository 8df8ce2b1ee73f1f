"""One layout's prediction: memory per rank by category, the step's collectives,
step time, tokens/s, MFU, the communication share, whether it fits, and the
rules of thumb it breaks."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from composer.config import ConfigError, JobConfig
from composer.planner.cluster import CLUSTERS, Cluster, load_cluster, spans_nodes
from composer.planner.comm import group_ranks, traffic
from composer.planner.layout import Layout, layout_of, load_model
from composer.planner.memory import GIB, RankMemory, largest, memory
from composer.planner.time import StepTime, step_time

COMM_SHARE_LIMIT = 0.30   # above it the layout is the wrong one
TP_MIN_SLICE = 1024       # hidden features per TP rank below which matmuls get too thin


@dataclass
class Prediction:
    layout: Layout
    cluster: Cluster
    ranks: list[RankMemory]
    comm: dict
    time: StepTime
    warnings: list[str] = field(default_factory=list)

    @property
    def peak(self) -> RankMemory:
        return largest(self.ranks)

    @property
    def capacity_gib(self) -> float:
        """What one rank may use: a device less its reserve; CPU ranks (a cluster
        with shared cores) share the node's memory too."""
        c = self.cluster
        ranks = min(self.layout.dims.world_size, c.devices_per_node) if c.cores_per_node else 1
        return c.memory_gib / ranks - c.reserved_gib

    @property
    def fits(self) -> bool:
        return self.peak.gib()["peak"] <= self.capacity_gib

    def to_json(self) -> dict:
        d, t = self.layout.dims, self.time
        return {"memory_gib": self.peak.gib(), "peak_moment": self.peak.peak.name,
                "expert_skew_gib": self.peak.skew / GIB,
                "memory_gib_per_pp_rank": [r.gib() for r in self.ranks],
                "comm": self.comm, "comm_seconds_by_dim": t.by_dim,
                "step_s": t.step_s, "compute_s": t.compute_s, "exposed_comm_s": t.exposed_comm_s,
                "bubble": t.bubble, "tokens_per_second": t.tokens_per_second, "mfu": t.mfu,
                "comm_share": t.comm_share, "fits": self.fits,
                "capacity_gib": self.capacity_gib, "matmul_efficiency": t.efficiency,
                "cluster": self.cluster.name, "world_size": d.world_size,
                "degrees": describe_degrees(self.layout), "warnings": self.warnings}


def describe_degrees(layout: Layout) -> dict:
    d, c = layout.dims, layout.cfg
    return {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp,
            "tp": d.tp, "ep": d.ep, "zero_stage": c.parallelism.zero_stage,
            "activation_checkpoint": c.activation_checkpoint.mode,
            "local_batch_size": c.training.local_batch_size, "accumulation": layout.accum,
            "microbatches": layout.microbatches}


def label(layout: Layout) -> str:
    d, c = layout.dims, layout.cfg
    shard = "shard" if c.parallelism.zero_stage >= 2 else "dp"  # DDP and ZeRO-1 replicate
    parts = [f"{name}{n}" for name, n in (("pp", d.pp), ("rep", d.dp_replicate),
                                          (shard, d.dp_shard), ("cp", d.cp), ("tp", d.tp),
                                          ("ep", d.ep)) if n > 1]
    parts.append(f"zero{c.parallelism.zero_stage}")
    if c.activation_checkpoint.mode != "none":
        parts.append(f"ac:{c.activation_checkpoint.mode}")
    parts.append(f"mbs{c.training.local_batch_size}"
                 + (f"x{layout.accum}" if layout.accum > 1 else ""))
    return " ".join(parts)


def rules_of_thumb(p: Prediction) -> list[str]:
    """The field's rules of thumb, each with its reason and its cost here."""
    layout, cluster, out = p.layout, p.cluster, []
    d = layout.dims
    groups = group_ranks(layout)
    per_node = cluster.devices_per_node
    tp_crosses = d.tp > 1 and spans_nodes(groups["tp"], per_node)
    if tp_crosses:
        out.append(f"tensor parallel x{d.tp} spans nodes ({per_node} devices per node): every "
                   f"block's collectives cross InfiniBand, {p.time.by_dim.get('tp', 0):.3f} s "
                   f"of each step; keep tp within a node")
    if d.tp > 1 and layout.shape.dim // d.tp < TP_MIN_SLICE:
        out.append(f"tensor parallel x{d.tp} leaves {layout.shape.dim // d.tp} hidden features "
                   f"per rank (dim {layout.shape.dim}): below {TP_MIN_SLICE} the matmuls are too "
                   f"thin to pay for two collectives per block; use a smaller tp")
    if tp_crosses and layout.cfg.parallelism.zero_stage == 3 and layout.fsdp:
        out.append("ZeRO-3 with tensor parallel across nodes: both gather weights and "
                   "activations over InfiniBand every block; keep tp in the node")
    if p.time.comm_share > COMM_SHARE_LIMIT:
        worst = max(p.time.by_dim, key=p.time.by_dim.get)
        out.append(f"communication is {p.time.comm_share:.0%} of the step (above "
                   f"{COMM_SHARE_LIMIT:.0%}: the layout is the wrong one); most of it on "
                   f"{worst} ({p.time.by_dim[worst]:.3f} s); try --search")
    if not p.fits:
        out.append(f"does not fit: {p.peak.gib()['peak']:.2f} GiB per rank at its peak "
                   f"({p.peak.peak.name}) of {p.capacity_gib:.2f} GiB usable")
    return out


def predict(layout: Layout, cluster: Cluster) -> Prediction:
    ranks = memory(layout)
    comm = traffic(layout)
    p = Prediction(layout, cluster, ranks, comm, step_time(layout, comm, cluster))
    p.warnings = rules_of_thumb(p)
    return p


def cluster_for(device: torch.device) -> Cluster:
    """The built-in profile of the device a job validates on: the CPU's, or the
    GPU whose name the device reports (its memory as reported), else H100's."""
    if device.type != "cuda":
        return CLUSTERS["cpu"]
    props = torch.cuda.get_device_properties(device)
    name = props.name.lower()
    base = next((c for key, c in CLUSTERS.items() if key.split("-")[0] in name),
                CLUSTERS["h100-80gb"])
    return dataclasses.replace(base, name=f"{base.name} ({props.name})",
                               memory_gib=props.total_memory / GIB)


def configured_cluster(cfg: JobConfig) -> Cluster | None:
    """The cluster ``planner.cluster`` names (None: empty); ConfigError naming the key,
    the value and the built-in names where it names none."""
    if not cfg.planner.cluster:
        return None
    try:
        return load_cluster(cfg.planner.cluster)
    except ValueError as e:
        raise ConfigError(f"planner.cluster={cfg.planner.cluster!r}: {e}") from None


def validation_report(cfg: JobConfig, world_size: int,
                      device: torch.device) -> tuple[str, list[str]]:
    """What ``composer.train --validate`` adds: the prediction's peak against the
    memory of the cluster ``planner.cluster`` names (else of ``device``), the
    communication share, and the rules of thumb it breaks."""
    cluster = configured_cluster(cfg)
    where = "" if cluster else " (this device; planner.cluster or --cluster names another)"
    p = predict_job(cfg, world_size, cluster or cluster_for(device))
    line = (f"predicted for {world_size} x {p.cluster.name}{where}: {peak_words(p)}, "
            f"communication {p.time.comm_share:.0%} of a {p.time.step_s:.3g} s step, "
            f"{p.time.tokens_per_second:,.0f} tokens/s per device")
    return line, p.warnings


def predict_job(cfg: JobConfig, world_size: int, cluster: Cluster) -> Prediction:
    """The prediction for the job ``cfg`` on ``world_size`` ranks of ``cluster``."""
    return predict(layout_of(cfg, load_model(cfg), world_size, cluster.device), cluster)


def peak_words(p: Prediction) -> str:
    return (f"peak {p.peak.gib()['peak']:.2f} GiB per rank ({p.peak.peak.name}) of "
            f"{p.capacity_gib:.2f} usable")


def planned_peak(cfg: JobConfig, world_size: int, device: torch.device) -> str:
    """The planner's peak for the job, in words (what an out-of-memory line quotes)."""
    try:
        p = predict_job(cfg, world_size, cluster_for(device))
        return f"the planner predicts {peak_words(p)}"
    except ValueError as e:  # a model the trace cannot run, a layout the planner cannot model
        return f"no planner estimate ({e})"
