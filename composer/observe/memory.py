"""Peak memory of a training step by category, on CPU and on CUDA.

The categories are parameters, gradients, optimizer state, activations and the
rest (buffers, temporaries, communication buffers). On CPU torch's MemTracker
sees every tensor the step allocates and says what each one is; the figures
are its breakdown at the moment of the step's peak. On CUDA the allocator's
counters give the peak; parameters, gradients and optimizer state are the
bytes of this rank's tensors, and activations are what the forward added to
the allocated memory.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from composer import torch_compat
from composer.observe.base import Observer, StepInfo

CATEGORIES = ("params", "grads", "optimizer", "activations", "other", "peak")
GIB = 2**30


def _bytes(tensors) -> int:
    """Bytes of this rank's storage behind ``tensors`` (each storage once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def state_bytes(parts: list[nn.Module], optimizers: list) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state this rank holds."""
    params = [p for part in parts for p in part.parameters()]
    states = [v for o in optimizers for s in o.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
            "optimizer": _bytes(states)}


class MemoryMeter:
    """``with meter.step(): ...`` around forward, backward and optimizer step;
    then ``meter.last`` holds that step's peak by category, in bytes."""

    def __init__(self, device: torch.device, parts: list[nn.Module], optimizers: list):
        # ZeRO-1's ZeroRedundancyOptimizer keeps its shard's state in the optimizer it wraps
        self.device, self.parts = device, parts
        self.optimizers = [getattr(o, "optim", o) for o in optimizers]
        self.last: dict[str, int] = {}
        self._before_forward = 0
        self._activations = 0
        self._tracker = None

    @contextlib.contextmanager
    def step(self):
        if self.device.type == "cuda":
            with self._cuda_step():
                yield
        else:
            with self._tracked_step():
                yield

    @contextlib.contextmanager
    def _tracked_step(self):
        tracker = torch_compat.frozen_aware_mem_tracker()
        tracker.track_external(*self.parts, *self.optimizers)
        self._tracker = tracker
        try:
            with tracker:
                yield
        finally:
            self._tracker = None
        snap = tracker.get_tracker_snapshot("peak").get(self.device, {})
        ref = torch_compat.mem_ref_type()
        kinds = {ref.PARAM: "params", ref.GRAD: "grads", ref.OPT: "optimizer",
                 ref.ACT: "activations"}
        out = dict.fromkeys(CATEGORIES, 0)
        for key, value in snap.items():
            if key == "Total":
                out["peak"] = value
            else:
                out[kinds.get(key, "other")] += value
        self.last = out

    @contextlib.contextmanager
    def _cuda_step(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._activations = 0
        yield
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        out = {**state_bytes(self.parts, self.optimizers), "activations": self._activations,
               "peak": peak}
        out["other"] = max(peak - sum(out[k] for k in CATEGORIES[:4]), 0)
        self.last = out

    def forward_started(self) -> None:
        if self.device.type == "cuda":
            self._before_forward = torch.cuda.memory_allocated(self.device)
        elif self._tracker is not None:  # it refuses a module's second forward otherwise
            self._tracker.reset_mod_stats()  # (the step's peak is kept apart)

    def forward_done(self) -> None:
        """CUDA: the activations a forward keeps are what it left allocated."""
        if self.device.type == "cuda":
            added = torch.cuda.memory_allocated(self.device) - self._before_forward
            self._activations = max(self._activations, added)


def per_rank_gib(last: dict[str, int], gather) -> list[dict[str, float]]:
    """Every rank's breakdown, in GiB (``gather``: this rank's tensor -> every rank's)."""
    mine = torch.tensor([float(last.get(k, 0)) for k in CATEGORIES], dtype=torch.float64)
    return [{k: round(v / GIB, 6) for k, v in zip(CATEGORIES, row.tolist())}
            for row in gather(mine)]


class MemoryObserver(Observer):
    """``metrics.memory_breakdown``: each step's peak by category on every rank.
    ``gather``: this rank's small tensor -> every rank's."""

    def __init__(self, meter: MemoryMeter, gather: Callable):
        self.meter, self.gather = meter, gather

    def step(self):
        return self.meter.step()

    @contextlib.contextmanager
    def phase(self, name: str):
        if name == "forward":
            self.meter.forward_started()
        elif name == "backward":  # the forward's activations are all there now
            self.meter.forward_done()
        yield

    def row(self, info: StepInfo) -> dict:
        ranks = per_rank_gib(self.meter.last, self.gather)
        return {"memory": ranks, "memory_activations_gib": max(r["activations"] for r in ranks)}

    def summary(self, row: dict) -> str | None:
        return f"act {row['memory_activations_gib']:.3f}GiB" if "memory" in row else None


def memory_observer(view) -> MemoryObserver | None:
    plan = view.plan
    if not plan.cfg.metrics.memory_breakdown:
        return None
    return MemoryObserver(MemoryMeter(plan.device, view.parts, view.optimizers), view.gather)
