"""``metrics.step_anatomy``: where each logged step's time went, and which rank
was slowest.

The row gets ``data_wait_s``, ``forward_s`` (the loss included), ``backward_s``
(or ``pipeline_s``: a pipeline schedule is one phase), ``optimizer_s``,
``comm_s`` (collectives in flight), ``comm_exposed_s`` (what the step waited
for), ``comm_hidden_s``, ``comm_share`` (exposed / the step), ``comm_dims_s``
(in flight by mesh dim), and across ranks ``slowest_rank``, ``slowest_rank_s``,
``median_rank_s``: a rank's time is its step less the communication it waited
for, so the rank the others wait for stands out. Only logged steps are timed:
the others pay nothing. On CPU ``comm_s`` and ``comm_dims_s`` need
``metrics.comm_stats`` (a dispatch mode times each collective, at a cost on every
op); without it the step's exposed communication is still measured. The log warns
once when communication passes 30% of the step, data wait 5%, or the slowest rank 20%
over the median, in two logged steps in a row (the first logged step, which holds the
start-up, is never judged): one step the machine preempted is not a slow loader.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from composer import torch_compat
from composer.observe.base import Observer, StepInfo
from composer.observe.timing import CommClock, PhaseClock, kernel_comm, union_length

log = logging.getLogger(__name__)

COMM_SHARE, DATA_SHARE, STRAGGLER = 0.30, 0.05, 1.20
PHASE_KEYS = {"data": "data_wait_s", "forward": "forward_s", "loss": "forward_s",
              "backward": "backward_s", "pipeline": "pipeline_s", "optimizer": "optimizer_s"}


class StepAnatomy(Observer):
    """``timed()``: whether the coming step is logged. ``gather``: this rank's small
    tensor -> every rank's. ``groups``: mesh dim -> process group (none: one process).
    ``advice``: what to run for a better layout, named in the communication warning;
    ``warn``: whether this rank logs the warnings (rank 0 does). ``time_collectives``:
    whether a dispatch mode times each collective on CPU (asked for with
    ``metrics.comm_stats``; never through compiled code, which refuses one): without
    it only the exposed time is known."""

    def __init__(self, device: torch.device, timed: Callable[[], bool], gather: Callable,
                 groups: dict | None, loader: str, advice: str, warn: bool = True,
                 time_collectives: bool = True):
        self.device, self.timed, self.gather, self.groups = device, timed, gather, groups
        self.time_collectives = time_collectives
        self.loader, self.advice = loader, advice
        self.warned: set = set() if warn else {"comm", "data", "ranks"}
        self.clock: PhaseClock | None = None
        self.comm: dict | None = None
        self.step_s = 0.0
        self.warmed_up = False  # the first logged step also holds the start-up: not judged
        self.held: set = set()  # what the previous logged step would have warned of

    @contextlib.contextmanager
    def step(self):
        if not self.timed():
            self.clock = None
            yield
            return
        self.clock = PhaseClock(self.device)
        with self._comm_clock():
            start = time.perf_counter()
            yield
            if self.clock.cuda:
                torch.cuda.synchronize()
            self.step_s = time.perf_counter() - start

    @contextlib.contextmanager
    def _comm_clock(self):
        self.comm = None
        if self.groups is None or self.device.type == "cuda" and \
                torch_compat.profiler_enabled():  # profiling.enable's window
            yield
        elif self.device.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                yield
            in_flight, exposed = kernel_comm(prof)
            self.comm = {"in_flight": in_flight, "exposed": exposed, "dims": {}}
        elif not self.time_collectives:
            yield
            self.comm = {"in_flight": None, "exposed": None, "dims": {}}
        else:
            with CommClock(self.groups) as clock:
                yield
            dims = clock.in_flight()
            in_flight = union_length([i for spans in dims.values() for i in spans])
            self.comm = {"in_flight": in_flight, "exposed": None,
                         "dims": {dim: union_length(spans) for dim, spans in dims.items()}}

    def phase(self, name: str):
        return self.clock.phase(name) if self.clock is not None else contextlib.nullcontext()

    def row(self, info: StepInfo) -> dict:
        if not info.logged or self.clock is None:
            return {}
        out: dict = {}
        for name, seconds in self.clock.resolve().items():
            key = PHASE_KEYS.get(name, f"{name}_s")
            out[key] = out.get(key, 0.0) + seconds
        if self.comm is not None:
            in_flight, exposed = self.comm["in_flight"], self.comm["exposed"]
            if exposed is None:  # CPU: what the thread waited for, within what was in flight
                exposed = self.clock.blocked if in_flight is None else min(self.clock.blocked,
                                                                           in_flight)
            out.update(comm_s=in_flight, comm_exposed_s=exposed,
                       comm_hidden_s=None if in_flight is None else in_flight - exposed,
                       comm_share=exposed / self.step_s if self.step_s else 0.0,
                       comm_dims_s=self.comm["dims"])
            out.update(self._slowest(self.step_s - exposed))
        if self.warmed_up:
            self._warn(out)
        self.warmed_up = True
        return out

    def _slowest(self, busy: float) -> dict:
        ranks = [t.item() for t in self.gather(torch.tensor([busy], dtype=torch.float64))]
        slowest = max(range(len(ranks)), key=ranks.__getitem__)
        return {"slowest_rank": slowest, "slowest_rank_s": ranks[slowest],
                "median_rank_s": statistics.median(ranks)}

    def _warn(self, row: dict) -> None:
        """Warns of what held in this logged step and the one before, once each."""
        share = row.get("comm_share", 0.0)
        data = row.get("data_wait_s", 0.0) / self.step_s if self.step_s else 0.0
        slowest = row.get("slowest_rank")
        now = {name for name, over in (("comm", share > COMM_SHARE),
                                       ("data", data > DATA_SHARE)) if over}
        if slowest is not None and row["slowest_rank_s"] > STRAGGLER * row["median_rank_s"]:
            now.add(("rank", slowest))
        due, self.held = (now & self.held) - self.warned, now
        if "comm" in due:
            dims = row["comm_dims_s"]
            blame = (f"in flight by dim: "
                     f"{', '.join(f'{d} {s:.3f}s' for d, s in sorted(dims.items()))}"
                     f"): {max(dims, key=dims.get)} is responsible" if dims else
                     "not timed by dim: metrics.comm_stats times each collective, "
                     "except in compiled code)")
            log.warning("communication is %.0f%% of the step (%.3fs waited of %.3fs; %s; for a "
                        "layout that moves less: %s", 100 * share, row["comm_exposed_s"],
                        self.step_s, blame, self.advice)
        if "data" in due:
            log.warning("data loading is %.0f%% of the step (%.3fs of %.3fs waiting for "
                        "batches): the loader (%s) is the bottleneck", 100 * data,
                        row["data_wait_s"], self.step_s, self.loader)
        if ("rank", slowest) in due and "ranks" not in self.warned:
            log.warning("rank %d is a straggler: %.3fs of work a step against the ranks' "
                        "median %.3fs (+%.0f%%)", slowest, row["slowest_rank_s"],
                        row["median_rank_s"], 100 * (row["slowest_rank_s"] /
                                                      row["median_rank_s"] - 1))
        self.warned |= due

    def summary(self, row: dict) -> str | None:
        """The exposed communication's share and the slowest rank, where there are
        ranks (each phase's time is in metrics.jsonl)."""
        parts = []
        if "comm_s" in row:
            parts.append(f"comm {row['comm_share']:.0%}")
        if "slowest_rank" in row:
            parts.append(f"slowest rank{row['slowest_rank']}")
        return "  ".join(parts) or None


def anatomy_observer(view) -> StepAnatomy | None:
    plan, cfg = view.plan, view.cfg
    if not cfg.metrics.step_anatomy:
        return None
    config = f"{cfg.job.dump_folder}/config.toml"
    return StepAnatomy(
        plan.device, lambda: view.reported(view.step() + 1), view.gather,
        plan.dims.groups() if dist.is_initialized() else None,
        f"data.dataset={cfg.data.dataset!r}",
        f"python -m composer.planner --config {config} "
        f"--world-size {plan.dims.world_size} --search",
        warn=plan.rank == 0,
        # the dispatch mode that times each collective sees every op (about 10 us each on
        # CPU: a 2-rank debug step took 1.5x as long); comm_stats's counter pays as much
        time_collectives=cfg.metrics.comm_stats and not cfg.compile.enable)
