"""Clocks for a step's anatomy: the phases' time, and the collectives' time by
mesh dim with how much of it the step waited for.

CPU: phases by the wall clock. gloo runs a collective on its own threads, so the
time the training thread spends off the CPU inside the compute phases (wall
minus its CPU time) is the communication it waited for: exposed. A dispatch
mode times every collective from its issue to its completion (the future of its
work; a functional collective's completion is its wait; gloo's reduce-scatter, which
has no future, is timed to its return): in flight.
CUDA: phases by CUDA events; the profiler's kernels give the collectives: the
union of NCCL kernels is in flight, the part no compute kernel overlaps is exposed.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from composer import torch_compat
from composer.observe.comm import OPS, group_of

_ASYNC = torch_compat.async_collective_tensor()
_WAIT = torch_compat.functional_collective("wait_tensor")
_FUNCTIONAL = {op for op in OPS if torch_compat.is_functional_collective(op)}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``intervals`` ((start, end) pairs)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds covered by both ``a`` and ``b``."""
    return union_length(a) + union_length(b) - union_length(a + b)


class PhaseClock:
    """Wall seconds by phase and, on CPU, the seconds the thread was off the CPU
    inside the phases that compute (``blocked``). CUDA phases are timed by events
    on the current stream, read by ``resolve`` (which synchronizes)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.blocked = 0.0
        self._events: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda and name != "data":  # the loader works on the host
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        yield
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        self.seconds[name] += wall
        if name != "data":
            self.blocked += max(wall - cpu, 0.0)

    def resolve(self) -> dict[str, float]:
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                self.seconds[name] += start.elapsed_time(end) / 1e3
            self._events.clear()
        return dict(self.seconds)


class CommClock(torch_compat.TorchDispatchMode):
    """While active, every collective's (issue, completion) interval by mesh dim
    (``names``: dim -> process group, as ``ParallelDims.groups()``)."""

    def __init__(self, names: dict[str, object]):
        super().__init__()
        self.names = {id(group): name for name, group in names.items()}
        self.intervals: dict[str, list] = defaultdict(list)
        self._functional: dict[int, tuple[str, float]] = {}  # storage -> (dim, issued)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, (DTensor, _ASYNC)) for t in types):
            # DTensor desugars the op into plain ops, and an async result waits for
            # its collective (wait_tensor), which come back here
            return NotImplemented
        if func is _WAIT:
            out = func(*args, **kwargs)
            issued = self._functional.pop(args[0].untyped_storage().data_ptr(), None)
            if issued is not None:
                self.intervals[issued[0]].append((issued[1], time.perf_counter()))
            return out
        if func not in OPS:
            return func(*args, **kwargs)
        dim = self.names.get(id(group_of(args, kwargs)), "other")
        issued = time.perf_counter()
        out = func(*args, **kwargs)
        if func in _FUNCTIONAL:
            for t in out if isinstance(out, (list, tuple)) else (out,):
                self._functional[t.untyped_storage().data_ptr()] = (dim, issued)
        else:
            self._on_done(out[-1] if isinstance(out, tuple) else out, dim, issued)
        return out

    def _on_done(self, work, dim: str, issued: float) -> None:
        entry = [issued, None]
        self.intervals[dim].append(entry)

        def done(future):
            entry[1] = time.perf_counter()
        if isinstance(work, torch.ScriptObject):  # c10d ops hand their Work boxed
            work = torch_compat.unbox_work(work)
        try:
            work.get_future().then(done)
        except RuntimeError:  # gloo's reduce-scatter has no future: timed to its return
            entry[1] = time.perf_counter()

    def in_flight(self) -> dict[str, list[tuple[float, float]]]:
        """Closed intervals by dim (a collective not seen to finish ends now)."""
        now = time.perf_counter()
        return {dim: [(start, now if end is None else end) for start, end in intervals]
                for dim, intervals in self.intervals.items()}


def kernel_comm(prof) -> tuple[float, float]:
    """A CUDA profile's (in flight, exposed) collective seconds: NCCL kernels'
    union, and the part of it that no other kernel overlaps."""
    comm, compute = [], []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        (comm if "nccl" in event.name.lower() else compute).append(span)
    in_flight = union_length(comm)
    return in_flight, in_flight - overlap_length(comm, compute)
