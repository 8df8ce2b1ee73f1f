"""``profiling.enable``: a ``torch.profiler`` trace of a window of steps on every rank.

Steps ``profiling.start_step`` .. ``start_step + steps - 1`` are traced into
``<dump_folder>/<profiling.folder>/rank<R>.steps-A-B.pt.trace.json``, which opens in
Perfetto (ui.perfetto.dev) and in TensorBoard's profiler plugin. On CUDA the same
window also records the allocator's history, dumped at its end as
``rank<R>.steps-A-B.memory.pickle`` (pytorch.org/memory_viz shows its peak).
Off by default; when off, no observer exists.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from composer import torch_compat
from composer.observe.base import Observer

log = logging.getLogger(__name__)


class StepProfiler(Observer):
    """``next_step()``: the number of the step about to run."""

    def __init__(self, folder: Path, rank: int, first: int, last: int,
                 next_step: Callable[[], int], device: torch.device):
        self.folder, self.first, self.last, self.next_step = folder, first, last, next_step
        self.cuda = device.type == "cuda"
        self.stem = f"rank{rank}.steps-{first}-{last}"
        self.prof: profile | None = None

    @contextlib.contextmanager
    def step(self):
        n = self.next_step()
        if not self.first <= n <= self.last:
            yield
            return
        if self.prof is None:
            self._start()
        with record_function(f"step {n}"):
            yield
        self.prof.step()
        if n == self.last:
            self._stop()

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.__enter__()
        if self.cuda:
            torch_compat.record_cuda_memory_history(max_entries=200_000)

    def _stop(self) -> None:
        self.prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"{self.stem}.pt.trace.json"
        self.prof.export_chrome_trace(str(trace))
        if self.cuda:
            torch_compat.dump_cuda_memory_snapshot(str(self.folder / f"{self.stem}.memory.pickle"))
            torch_compat.stop_cuda_memory_history()
        log.info("profile of steps %d-%d written to %s", self.first, self.last, trace)
        self.prof = None

    def close(self) -> None:
        if self.prof is not None:  # the run ended inside the window
            self.prof.__exit__(None, None, None)
            self.prof = None


def profile_observer(view) -> StepProfiler | None:
    plan, p = view.plan, view.cfg.profiling
    if not p.enable:
        return None
    return StepProfiler(Path(plan.cfg.job.dump_folder) / p.folder, plan.rank, p.start_step,
                        p.start_step + p.steps - 1, lambda: view.step() + 1, plan.device)
