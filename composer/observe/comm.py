"""Count the collectives of a training step by kind, mesh dim and phase.

A TorchDispatchMode sees both the functional collectives DTensor issues
(tensor parallel) and the in-place c10d ops that FSDP2 and DDP's reducer
issue, so one counter covers every pass. Pipeline parallel's point-to-point
``isend``/``irecv`` (alone or batched) reach the dispatcher too, as c10d's send
and recv_ ops. Each collective is recorded with the bytes of its full
(unsharded) tensor and the bytes a ring algorithm moves through each rank:
all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n; a send or a recv
moves its tensor once.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from composer import torch_compat
from composer.observe.base import Observer, StepInfo

_funcol = torch_compat.functional_collective
_c10d = torch.ops.c10d

# op -> (kind, the argument holding the full tensor(s), or the local shard when the
# third entry says the full size is that times the group size)
OPS = {
    _funcol("all_reduce"): ("all_reduce", 0, False),
    _funcol("all_reduce_coalesced"): ("all_reduce", 0, False),
    _funcol("all_gather_into_tensor"): ("all_gather", 0, True),
    _funcol("all_gather_into_tensor_coalesced"): ("all_gather", 0, True),
    _funcol("reduce_scatter_tensor"): ("reduce_scatter", 0, False),
    _funcol("reduce_scatter_tensor_coalesced"): ("reduce_scatter", 0, False),
    _funcol("all_to_all_single"): ("all_to_all", 0, False),
    _funcol("broadcast"): ("broadcast", 0, False),
    _c10d.allreduce_.default: ("all_reduce", 0, False),
    torch_compat.c10d_base_op("allgather"): ("all_gather", 0, False),
    _c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0, False),
    torch_compat.c10d_base_op("reduce_scatter"): ("reduce_scatter", 1, False),
    _c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1, False),
    _c10d.alltoall_base_.default: ("all_to_all", 1, False),
    _c10d.broadcast_.default: ("broadcast", 0, False),
    _c10d.send.default: ("send", 0, False),
    _c10d.recv_.default: ("recv", 0, False),
    _c10d.recv_any_source_.default: ("recv", 0, False),
}
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "broadcast": lambda n: 1.0, "send": lambda n: 1.0, "recv": lambda n: 1.0}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0


def group_of(args, kwargs):
    """The process group of a collective: its name, the last string argument of a
    functional collective (the first may be the reduce op), or a ProcessGroup."""
    for a in reversed((*args, *kwargs.values())):
        if isinstance(a, str):
            return torch_compat.resolve_process_group(a)
        group = torch_compat.as_process_group(a)
        if group is not None:
            return group
    return None


class CommCounter(torch_compat.TorchDispatchMode):
    """Records every collective while active. ``names`` maps process groups to
    mesh-dim names (``{"tp": tp_group, ...}``); others are reported as "other"."""

    def __init__(self, names: dict[str, object]):
        super().__init__()
        self.names = {id(group): name for name, group in names.items()}
        self.phase = "step"
        self.calls: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before subclasses: step aside so DTensor desugars the op
            # into plain ops and collectives, which then come back here.
            return NotImplemented
        if func in OPS:
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs) -> None:
        kind, arg, gathered = OPS[func]
        group = group_of(args, kwargs)
        n = group.size() if group is not None else 1
        size = _nbytes(args[arg]) * (n if gathered else 1)
        entry = self.calls[(self.phase, self.names.get(id(group), "other"), kind)]
        entry[0] += 1
        entry[1] += size
        entry[2] += size * RING_FACTOR[kind](n)

    def table(self) -> dict:
        """{phase: {mesh dim: {kind: {count, bytes, ring_bytes}}}}"""
        out: dict = {}
        for (phase, dim, kind), (count, size, ring) in sorted(self.calls.items()):
            out.setdefault(phase, {}).setdefault(dim, {})[kind] = {
                "count": count, "bytes": size, "ring_bytes": ring}
        return out

    def reset(self) -> None:
        self.calls.clear()


SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A",
         "broadcast": "BC", "send": "SEND", "recv": "RECV"}


def comm_summary(comm: dict) -> str:
    """``{phase: {dim: {kind: {count, ring_bytes}}}}`` -> "tp AR 9 AG 1 1.2MiB | dp_shard ..."."""
    per_dim: dict = {}
    for dims in comm.values():
        for dim, kinds in dims.items():
            entry = per_dim.setdefault(dim, {"bytes": 0.0})
            for kind, c in kinds.items():
                entry[kind] = entry.get(kind, 0) + c["count"]
                entry["bytes"] += c["ring_bytes"]
    return " | ".join(
        f"{dim} " + " ".join(f"{SHORT[k]} {n}" for k, n in e.items() if k != "bytes")
        + f" {e['bytes'] / 2**20:.2f}MiB" for dim, e in sorted(per_dim.items()))


class CommObserver(Observer):
    """``metrics.comm_stats``: every collective of the step, by phase, mesh dim and kind."""

    def __init__(self, counter: CommCounter):
        self.counter = counter

    @contextlib.contextmanager
    def step(self):
        self.counter.reset()
        with self.counter:
            yield

    def phase(self, name: str):
        return self.counter.in_phase(name)

    def row(self, info: StepInfo) -> dict:
        return {"comm": self.counter.table()}

    def summary(self, row: dict) -> str | None:
        return "comm " + comm_summary(row["comm"]) if "comm" in row else None


def comm_observer(view) -> CommObserver | None:
    plan = view.plan
    if not (plan.cfg.metrics.comm_stats and dist.is_initialized()):
        return None
    return CommObserver(CommCounter(plan.dims.groups()))
