"""The observer interface: what watches the training loop (memory, communication,
router statistics, and any observer of a user's) and adds columns to its rows.

The trainer calls every observer the same way and names none of them. A factory
registered with ``register_observer`` gets the trainer once it holds its model
and optimizers, and returns an observer, or None when its feature is off.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch


@dataclass
class StepInfo:
    """What the trainer knows of a training step that just finished."""

    step: int                 # its number, from 1
    tokens: int               # its global target tokens (the loss normaliser)
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


ObserverFactory = Callable[[Any], "Observer | None"]  # the trainer -> an observer, or None
OBSERVERS: list[ObserverFactory] = []


def register_observer(factory: ObserverFactory) -> None:
    """Every trainer made from now on asks ``factory(trainer)`` for an observer."""
    OBSERVERS.append(factory)


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

    def summaries(self, row: dict) -> list[str]:
        return [part for o in self.observers if (part := o.summary(row))]

    def report(self, step: int, row: dict) -> None:
        for o in self.observers:
            o.report(step, row)

    def restarted(self) -> None:
        for o in self.observers:
            o.restarted()

    def close(self) -> None:
        for o in self.observers:
            o.close()
