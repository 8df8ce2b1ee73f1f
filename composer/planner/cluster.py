"""Cluster profiles: what one device holds and computes, and what its links carry.

A profile is the planner's whole picture of the hardware: device memory, dense
peak per compute dtype, bandwidth and latency inside and across nodes, and the
efficiencies that turn peaks into achieved rates. Built-ins live in ``CLUSTERS``;
``load_cluster`` also reads a TOML file of the same fields.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

from composer.config import tomllib

COMPUTE_DTYPES = ("float64", "float32", "bfloat16", "float8")


@dataclass(frozen=True)
class Cluster:
    """One kind of node, repeated. Bandwidths are GB/s (1e9 bytes) per device in one
    direction; peaks are dense (no sparsity) TFLOP/s per device."""

    name: str
    devices_per_node: int
    memory_gib: float  # one device's capacity
    reserved_gib: float  # kept by the runtime and allocator, not usable by tensors
    peak_tflops: dict[str, float]  # by compute dtype, keys among COMPUTE_DTYPES
    intra_node_gbps: float  # NVLink (gloo over loopback on cpu)
    inter_node_gbps: float  # InfiniBand
    intra_node_latency_us: float
    inter_node_latency_us: float
    matmul_efficiency: float  # fraction of peak a large square matmul reaches (the ceiling)
    comm_efficiency: float  # fraction of link bandwidth that collectives reach
    op_overhead_us: float  # fixed host cost per launched op; dominates on CPU
    memory_gbps: float = 2000.0  # device memory bandwidth (GB/s): what element-wise ops run at
    attention_efficiency: float = 0.4  # fraction of peak the attention kernel reaches
    # passes of the compute dtype over the query x key scores at memory_gbps (0: a kernel
    # that keeps them on chip), and a cost per query row and head (us; 0: none)
    attention_score_passes: float = 0.0
    attention_row_us: float = 0.0
    cores_per_node: int = 0  # CPU: the cores a node's ranks share (0: each device its own)
    device: str = "cuda"  # which kernels the ranks run: "cuda", or "cpu" (gloo, SDPA's CPU path)
    # a matmul whose smallest dimension is this reaches half of matmul_efficiency (0: no loss)
    matmul_half_dim: float = 0.0
    # a matmul of this many GFLOPs reaches half of matmul_efficiency (0: no loss)
    matmul_half_gflop: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            _check_field(f.name, getattr(self, f.name))
        if self.reserved_gib >= self.memory_gib:
            raise ValueError(f"reserved_gib = {self.reserved_gib}: must be below "
                             f"memory_gib = {self.memory_gib}")


_POSITIVE = ("a positive number", lambda v: v > 0)
_NON_NEGATIVE = ("a number >= 0", lambda v: v >= 0)
_FRACTION = ("a number in (0, 1]", lambda v: 0 < v <= 1)
# zero is allowed where an idealised profile may leave a cost out
_RULES = {"memory_gib": _POSITIVE, "reserved_gib": _NON_NEGATIVE,
          "intra_node_gbps": _POSITIVE, "inter_node_gbps": _POSITIVE,
          "intra_node_latency_us": _NON_NEGATIVE, "inter_node_latency_us": _NON_NEGATIVE,
          "matmul_efficiency": _FRACTION, "comm_efficiency": _FRACTION,
          "op_overhead_us": _NON_NEGATIVE, "memory_gbps": _POSITIVE,
          "attention_efficiency": _FRACTION, "matmul_half_dim": _NON_NEGATIVE,
          "matmul_half_gflop": _NON_NEGATIVE, "attention_score_passes": _NON_NEGATIVE,
          "attention_row_us": _NON_NEGATIVE}


def _is_number(value) -> bool:
    # TOML's true/false would pass as 1/0 otherwise
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_field(key: str, value) -> None:
    if key == "cores_per_node":
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"cores_per_node = {value!r}: must be an integer >= 0")
    elif key == "device":
        if value not in ("cuda", "cpu"):
            raise ValueError(f"device = {value!r}: allowed: cuda, cpu")
    elif key == "name":
        if not (isinstance(value, str) and value):
            raise ValueError(f"name = {value!r}: must be a non-empty string")
    elif key == "devices_per_node":
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"devices_per_node = {value!r}: must be a positive integer")
    elif key == "peak_tflops":
        _check_peaks(value)
    else:
        allowed, ok = _RULES[key]
        if not (_is_number(value) and ok(value)):
            raise ValueError(f"{key} = {value!r}: must be {allowed}")


def _check_peaks(peaks) -> None:
    allowed = ", ".join(COMPUTE_DTYPES)
    if not (isinstance(peaks, dict) and peaks):
        raise ValueError(f"peak_tflops = {peaks!r}: must be a table of compute dtype -> TFLOP/s "
                         f"with keys among {allowed}")
    for dtype, value in peaks.items():
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"peak_tflops.{dtype}: unknown compute dtype"
                             f"{_nearest(dtype, COMPUTE_DTYPES)}; allowed: {allowed}")
        if not (_is_number(value) and value > 0):
            raise ValueError(f"peak_tflops.{dtype} = {value!r}: must be a positive number")


def _nearest(word: str, words) -> str:
    close = difflib.get_close_matches(word, list(words), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _gpu(name: str, memory_gib: float, peaks: dict[str, float], nvlink_gbps: float,
         ib_gbps: float, memory_gbps: float, matmul: tuple[float, float, float]) -> Cluster:
    """An 8-device node of NVIDIA GPUs; ``matmul``: (matmul_efficiency, matmul_half_dim,
    matmul_half_gflop), the roofline's efficiency curve (``composer.planner.roofline``)."""
    efficiency, half_dim, half_gflop = matmul
    return Cluster(name=name, devices_per_node=8, memory_gib=memory_gib, reserved_gib=1.5,
                   peak_tflops=peaks, intra_node_gbps=nvlink_gbps, inter_node_gbps=ib_gbps,
                   intra_node_latency_us=5.0, inter_node_latency_us=10.0,
                   matmul_efficiency=efficiency, comm_efficiency=0.7, op_overhead_us=5.0,
                   memory_gbps=memory_gbps, matmul_half_dim=half_dim,
                   matmul_half_gflop=half_gflop)


# Where the machine cannot say: the machine the cpu profile was measured on.
CPU_CORES_FALLBACK = 2
CPU_MEMORY_GIB_FALLBACK = 24.0


def machine_cores() -> int:
    """The cores this process may run on (its affinity, e.g. a container's cpuset), else
    the machine's count, else CPU_CORES_FALLBACK."""
    try:
        return len(os.sched_getaffinity(0)) or CPU_CORES_FALLBACK
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return os.cpu_count() or CPU_CORES_FALLBACK


def machine_memory_gib(meminfo: str = "/proc/meminfo") -> float:
    """The machine's memory (MemTotal of ``meminfo``), else CPU_MEMORY_GIB_FALLBACK."""
    try:
        with open(meminfo) as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, IndexError, ValueError):
        return CPU_MEMORY_GIB_FALLBACK
    return kib / 2**20 if kib > 0 else CPU_MEMORY_GIB_FALLBACK


# The cpu profile is this machine (its cores and memory, read when composer loads;
# gloo over loopback, one thread per rank); docs/planner_cpu_profile.md lists the
# measurements its rates come from (a machine of 2 cores and 24 GiB).
# The link is the send/recv rate; comm_efficiency is the all-reduce's share of it
# (gloo's ring also adds on the CPU). The matmul constants are fitted by
# benchmarks/bench_gemm.py on single-thread GEMMs alone: the peaks are achieved rates
# (matmul_efficiency 1.0); bfloat16's is an older estimate, not refitted.
_CPU = Cluster(
    name="cpu",
    # torchrun runs up to 8 CPU ranks on this one machine; they share its cores
    devices_per_node=8,
    memory_gib=machine_memory_gib(),  # shared by all its ranks: an upper bound per rank
    reserved_gib=0.5,  # the interpreter, torch and gloo per rank (0.30 GiB measured), rounded up
    peak_tflops={"float32": 0.095, "float64": 0.045, "bfloat16": 0.20},
    intra_node_gbps=3.7, inter_node_gbps=3.7,  # one machine: no other link
    intra_node_latency_us=2600.0, inter_node_latency_us=2600.0,
    matmul_efficiency=1.0, comm_efficiency=0.43, op_overhead_us=2.6, memory_gbps=8.0,
    # attention: fitted by benchmarks/bench_attention.py on SDPA calls alone
    attention_efficiency=0.70, attention_score_passes=1.8, attention_row_us=0.58,
    cores_per_node=machine_cores(), device="cpu",
    matmul_half_dim=5.3, matmul_half_gflop=3.5e-5)

# NVIDIA's published dense figures (TFLOP/s; datasheets of A100, H100 SXM5, H200 SXM and
# HGX B200). composer trains float32 without TF32 by default, so "float32" is the plain
# FP32 rate, not TF32's; "float64" is the FP64 Tensor Core rate (twice the plain FP64 one
# on A100 and H100). memory_gib is about what torch.cuda reports for the device (it
# varies by a few hundred MiB with driver and ECC). memory_gbps is the datasheet's HBM
# bandwidth. NVLink per direction; InfiniBand per GPU: HDR 200 Gb/s = 25 GB/s, NDR
# 400 Gb/s = 50 GB/s.
#
# The matmul curves are NOT measured here (no GPU was lent): estimates from public
# figures, each listed with its source in docs/planner_cpu_profile.md ("GPU profiles").
# Ceiling: cuBLAS's large bf16 GEMMs reach about 0.8 of dense peak on A100 and about
# 0.75 on H100 (public GEMM sweeps; NVIDIA's Matrix Multiplication Background guide,
# DU-09799-001, shows the shape of the fall). half_dim 32: a quarter of a 128-wide tile
# filled halves the rate (cuBLAS then picks narrower tiles); half_gflop: about 3
# microseconds of the GPU's full rate (launch and the last wave's tail), scaled with
# the peak.
_HOPPER = {"float64": 67.0, "float32": 67.0, "bfloat16": 989.0, "float8": 1979.0}
_AMPERE = {"float64": 19.5, "float32": 19.5, "bfloat16": 312.0}
CLUSTERS: dict[str, Cluster] = {c.name: c for c in (
    _CPU,
    _gpu("a100-40gb", 40.0, _AMPERE, 300.0, 25.0, 1555.0, (0.8, 32.0, 0.75)),
    _gpu("a100-80gb", 80.0, _AMPERE, 300.0, 25.0, 2039.0, (0.8, 32.0, 0.75)),
    _gpu("h100-80gb", 79.6, _HOPPER, 450.0, 50.0, 3350.0, (0.75, 32.0, 2.2)),
    _gpu("h200-141gb", 140.4, _HOPPER, 450.0, 50.0, 4800.0, (0.75, 32.0, 2.2)),
    # B200's float32 and float64 are approximate (NVIDIA quotes about 75-80 and 37-40);
    # its 180 GiB is approximate too; its curve is Hopper's, scaled to its peak
    _gpu("b200", 180.0, {"float64": 37.0, "float32": 75.0, "bfloat16": 2250.0, "float8": 4500.0},
         900.0, 50.0, 8000.0, (0.75, 32.0, 5.0)),
)}


def load_cluster(name_or_path: str) -> Cluster:
    """A built-in profile by name (``CLUSTERS``), or a TOML file whose top-level keys
    are ``Cluster``'s fields, ``peak_tflops`` a table (``[peak_tflops]`` with
    ``bfloat16 = 989``). Every field is required except ``name``, which defaults to
    the file's stem, ``device`` (default cuda), ``memory_gbps`` (2000),
    ``attention_efficiency`` (0.4), ``attention_score_passes`` and ``attention_row_us``
    (0: attention at its FLOPs alone), ``cores_per_node`` (0), ``matmul_half_dim`` and
    ``matmul_half_gflop`` (0: every matmul at ``matmul_efficiency``). Raises ValueError
    naming what is wrong."""
    if name_or_path in CLUSTERS:
        return CLUSTERS[name_or_path]
    path = Path(name_or_path)
    if path.is_file():
        return _from_toml(path)
    if path.suffix == ".toml" or "/" in name_or_path:
        raise ValueError(f"cluster {name_or_path}: no such file")
    raise ValueError(f"unknown cluster '{name_or_path}'{_nearest(name_or_path, CLUSTERS)}; "
                     f"built-in: {', '.join(CLUSTERS)}, or a path to a TOML file")


def _from_toml(path: Path) -> Cluster:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"cluster {path}: invalid TOML: {e}") from None
    names = [f.name for f in fields(Cluster)]
    for key in data:
        if key not in names:
            raise ValueError(f"cluster {path}: unknown field '{key}'{_nearest(key, names)}")
    optional = ("name", "device", "memory_gbps", "cores_per_node", "attention_efficiency",
                "matmul_half_dim", "matmul_half_gflop", "attention_score_passes",
                "attention_row_us")
    missing = [n for n in names if n not in data and n not in optional]
    if missing:
        raise ValueError(f"cluster {path}: missing field '{missing[0]}'")
    try:
        return Cluster(**{"name": path.stem, **data})
    except ValueError as e:
        raise ValueError(f"cluster {path}: {e}") from None


def spans_nodes(ranks, devices_per_node: int) -> bool:
    """Whether a group of global ranks (numbered node by node) reaches past one node."""
    return len({r // devices_per_node for r in ranks}) > 1


def link_gbps_latency(cluster: Cluster, crosses: bool) -> tuple[float, float]:
    """(bytes per second that collectives reach, latency in seconds) of the link a
    group uses: InfiniBand when it crosses nodes, else NVLink."""
    if crosses:
        gbps, latency_us = cluster.inter_node_gbps, cluster.inter_node_latency_us
    else:
        gbps, latency_us = cluster.intra_node_gbps, cluster.intra_node_latency_us
    return gbps * 1e9 * cluster.comm_efficiency, latency_us * 1e-6
