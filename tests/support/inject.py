"""Test-only fault injection, as a plugin: ``--job.plugins tests.support.inject`` adds the
section ``[inject]``, whose keys make one step's loss NaN or large (each once),
so that a test can drive the recovery path end to end. The observer scales the
logits of that step's forward: NaN makes the loss and gradients NaN, 100 makes
the loss spike."""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

from composer.config import bounded
from composer.observe import Observer, register_observer

log = logging.getLogger(__name__)


@dataclass
class Inject:
    nonfinite_step: int = bounded(0, 0, help="make this step's loss NaN (0: never)")
    spike_step: int = bounded(0, 0, help="make this step's logits 100x (0: never)")


class Injector(Observer):
    def __init__(self, view, cfg: Inject):
        self.view, self.injected = view, set()
        self.at = {"nonfinite": (cfg.nonfinite_step, math.nan), "spike": (cfg.spike_step, 100.0)}

    @contextlib.contextmanager
    def forward(self):
        step = self.view.step() + 1
        due = [(kind, factor) for kind, (at, factor) in self.at.items()
               if at == step and kind not in self.injected]
        if not due:
            yield
            return
        kind, factor = due[0]
        self.injected.add(kind)
        log.warning("inject: step %d's logits x %s", step, factor)
        hook = self.view.parts[0].register_forward_hook(lambda module, args, out: out * factor)
        try:
            yield
        finally:
            hook.remove()


def injector(view, cfg: Inject) -> Injector | None:
    return Injector(view, cfg) if (cfg.nonfinite_step or cfg.spike_step) else None


register_observer(injector, section=("inject", Inject))
