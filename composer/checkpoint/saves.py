"""The run's saves as the trainer makes them: one every interval, the end of a
background one, and what a failed save does (``checkpoint.on_save_error``).

With "continue", a save that fails for lack of space or of a writable folder is
logged and counted and training goes on (every rank sees DCP's failure, so all
go on together); the next interval tries again, and the run's last line names
a last save that never succeeded. Any other failure, or any with "stop", is
raised for ``composer.train.run`` to diagnose.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch.distributed.checkpoint.api import CheckpointException

from composer.checkpoint.dcp import Checkpointer
from composer.faults import SAVE_FAULTS, Doing, diagnose, last_complete

log = logging.getLogger(__name__)


class Saves:
    def __init__(self, checkpointer: Checkpointer, doing: Doing, on_save_error: str):
        self.checkpointer, self.doing, self.on_save_error = checkpointer, doing, on_save_error
        self.errors = 0               # failed saves
        self.unsaved: int | None = None  # the last failed save's step, if none succeeded since

    def step_ended(self, step: int, due: bool, train_state: Callable[[], dict[str, torch.Tensor]]
                   ) -> None:
        """After step ``step``: commit a finished background save; when ``due``, save
        (a background save still running ends first, as its own step's save)."""
        self.run(self.checkpointer.wait if due else self.checkpointer.poll)
        if due:
            self.run(lambda: self.checkpointer.save(step, train_state()), step)

    def run(self, action: Callable[[], None], step: int | None = None) -> None:
        """Run a checkpoint ``action``: a save of ``step``, or the end of a
        background save (then the step is that save's)."""
        self.doing.phase = "checkpoint"
        self.doing.step = step or self.checkpointer.pending_step or self.doing.step
        try:
            action()
        except (Exception, CheckpointException) as e:
            fault = diagnose(e, self.doing)
            if fault is None or fault.code not in SAVE_FAULTS or self.on_save_error == "stop":
                raise
            self.errors += 1
            self.unsaved = self.doing.step
            log.warning("checkpoint not saved: %s; training goes on "
                        "(checkpoint.on_save_error=continue)", fault.line)
            return
        if self.unsaved is not None and (self.checkpointer.saved_step or 0) > self.unsaved:
            self.unsaved = None

    def finish(self) -> None:
        """Let a background save end; say so if the run's last save never succeeded."""
        self.run(self.checkpointer.wait)
        if self.unsaved is not None:
            log.warning("the run ends without its last save (step %d, %d failed save(s) in "
                        "all); the newest complete checkpoint is %s", self.unsaved, self.errors,
                        last_complete(self.doing.folder))
