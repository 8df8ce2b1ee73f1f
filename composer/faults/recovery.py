"""Keep a long run going through bad steps.

A step whose loss or gradient norm is not finite is skipped: its gradients are
dropped, the optimizer does not step, the step is counted. A loss above
``spike_factor`` times the running mean of the last ``spike_window`` steps
rolls the run back to its newest checkpoint; the batch that spiked is skipped
when the run reaches it again. After ``max_rollbacks`` the run stops with one
line saying why. Every rank sees the same global loss and norm, so every rank
decides the same.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from pathlib import Path
from typing import Callable

from composer.checkpoint.dcp import Checkpointer, find_resume
from composer.config import Recovery as RecoveryConfig

log = logging.getLogger(__name__)


class RecoveryError(RuntimeError):
    """The run cannot go on; the message is the one line the user sees."""


class Recovery:
    def __init__(self, cfg: RecoveryConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.spike_window)
        self.skipped = self.rollbacks = self.spike_step = 0
        self.bad_batches: set[int] = set()

    def judge(self, step: int, loss: float, grad_norm: float) -> str:
        """"step" (apply the update), "skip" (drop it) or "rollback"."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            if not self.cfg.skip_nonfinite:
                raise RecoveryError(f"step {step}: loss {loss}, gradient norm {grad_norm} "
                                    f"(recovery.skip_nonfinite = false)")
            self.skipped += 1
            log.warning("step %d: loss %s, gradient norm %s: update skipped (%d so far)",
                        step, loss, grad_norm, self.skipped)
            return "skip"
        full = len(self.history) == self.history.maxlen
        mean = sum(self.history) / max(len(self.history), 1)
        if self.cfg.spike_factor > 0 and full and loss > self.cfg.spike_factor * mean:
            if self.rollbacks >= self.cfg.max_rollbacks:
                raise RecoveryError(
                    f"step {step}: loss {loss:.4f} is {loss / mean:.1f}x the running mean "
                    f"{mean:.4f} after {self.rollbacks} rollback(s) (recovery.max_rollbacks)")
            self.spike_step = step
            log.warning("step %d: loss %.4f is %.1fx the running mean %.4f: rolling back",
                        step, loss, loss / mean, mean)
            return "rollback"
        self.history.append(loss)
        return "step"

    def roll_back(self, checkpointer: Checkpointer, bad_batch: int,
                  load: Callable[[Path], None], quiet: bool) -> None:
        """``load`` the newest checkpoint step; the batch that started at data position
        ``bad_batch`` is skipped when the run gets there again."""
        checkpointer.wait()
        path = find_resume(checkpointer.folder, -1, quiet=quiet)
        if path is None:
            raise RecoveryError(f"loss spike at step {self.spike_step}: no checkpoint to go "
                                f"back to")
        self.rollbacks += 1
        self.bad_batches.add(bad_batch)
        self.history.clear()
        load(path)
        log.warning("rolled back to %s; the batch of step %d will be skipped", path,
                    self.spike_step)

    def skip(self, position: int) -> bool:
        """Whether the step starting at data position ``position`` spiked before."""
        return position in self.bad_batches

    def counts(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped, "rollbacks": self.rollbacks}
