"""The observer interface: what watches the training loop (memory, communication,
router statistics, and any observer of a user's) and adds columns to its rows.

The trainer calls every observer the same way and names none of them. A factory
registered with ``register_observer`` gets a read-only view of the run (its
config, model parts, optimizers, checkpointer, step) once those exist, and
returns an observer, or None when its feature is off; an observer may declare a
config section of its own.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from composer.config import register_section


@dataclass
class StepInfo:
    """What the trainer knows of a training step that just finished."""

    step: int                 # its number, from 1
    tokens: int               # its loss normaliser: global target tokens (DPO: pairs)
    tokens_per_device: float  # the tokens this device processed (ranks sharing a batch split it)
    logged: bool              # whether this step's row is reported
    device: torch.device


class Observer:
    """Override what applies; every default does nothing."""

    def step(self) -> ContextManager:
        """Held around a training step's forward, backward and optimizer step."""
        return contextlib.nullcontext()

    def phase(self, name: str) -> ContextManager:
        """Held around one phase inside ``step``: "data" (fetching the step's
        batches), "forward", "loss", "backward", "pipeline" (a whole pipeline
        schedule) or "optimizer"."""
        return contextlib.nullcontext()

    def forward(self) -> ContextManager:
        """Held around each real forward of a training batch (each pipeline
        microbatch's too; not a schedule's shape inference, nor a recomputation)."""
        return contextlib.nullcontext()

    def row(self, info: StepInfo) -> dict:
        """The step's columns for the metrics row. Every rank calls it, so it may
        run collectives."""
        return {}

    def summary(self, row: dict) -> str | None:
        """Its part of the log line for a reported row, if any."""
        return None

    def report(self, step: int, row: dict) -> None:
        """A reported row, complete (every rank calls it; rank 0's is the global one)."""

    def restarted(self) -> None:
        """The run has just loaded a checkpoint (resume or roll-back)."""

    def close(self) -> None:
        """The run has ended (also when it failed)."""


@dataclass(frozen=True)
class RunView:
    """What an observer may read of the run, made once the model parts, the
    checkpointer and the optimizers exist. Read it; the run is the trainer's."""

    plan: Any                              # composer.job.plan.Plan: cfg, rank, device, dims, spec
    parts: list[nn.Module]                 # the model parts this rank holds
    optimizers: list                       # one per part
    checkpointer: Any                      # composer.checkpoint.dcp.Checkpointer, or None
    step: Callable[[], int]                # steps finished so far
    reported: Callable[[int], bool]        # whether that step's row is logged
    gather: Callable[[torch.Tensor], list]  # every rank's copy of a small tensor
    sum_all: Callable[[torch.Tensor], torch.Tensor]  # summed over data ranks and stages
    summary: Callable[[dict], str | None]  # every observer's part of a row's log line

    @property
    def cfg(self) -> Any:
        return self.plan.cfg


ObserverFactory = Callable[..., "Observer | None"]  # (view[, section]) -> an observer, or None
OBSERVERS: list[tuple[ObserverFactory, str | None]] = []


def register_observer(factory: ObserverFactory, section: tuple[str, type] | None = None) -> None:
    """Every run from now on asks ``factory(view)`` for an observer (None: its
    feature is off), ``view`` a RunView. With ``section`` = (name, dataclass),
    ``[name]`` becomes a config section of its own and the factory is asked
    ``factory(view, that section)``."""
    if section is not None:
        register_section(*section)
    OBSERVERS.append((factory, section[0] if section else None))


def make_observers(view: RunView) -> "Observers":
    """The registered observers of the run ``view`` is of."""
    made = (make(view, getattr(view.cfg, name)) if name else make(view)
            for make, name in OBSERVERS)
    return Observers([o for o in made if o is not None])


class Observers(Observer):
    """Many observers as one, called in registration order."""

    def __init__(self, observers: list[Observer]):
        self.observers = observers

    @contextlib.contextmanager
    def _all(self, contexts):
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            yield

    def step(self):
        return self._all(o.step() for o in self.observers)

    def phase(self, name: str):
        return self._all(o.phase(name) for o in self.observers)

    def forward(self):
        return self._all(o.forward() for o in self.observers)

    def row(self, info: StepInfo) -> dict:
        out: dict = {}
        for o in self.observers:
            out.update(o.row(info))
        return out

    def summary(self, row: dict) -> str | None:
        """Every observer's part of the log line, in registration order."""
        return "  ".join(part for o in self.observers if (part := o.summary(row))) or None

    def report(self, step: int, row: dict) -> None:
        for o in self.observers:
            o.report(step, row)

    def restarted(self) -> None:
        for o in self.observers:
            o.restarted()

    def close(self) -> None:
        """Close every observer, also when one raises; the first error is raised after."""
        errors = []
        for o in self.observers:
            try:
                o.close()
            except Exception as e:  # the others still close; re-raised below
                errors.append(e)
        if errors:
            raise errors[0]
