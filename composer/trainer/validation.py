"""The held-out loss: the validation loader's first ``validation.steps`` global batches,
the same sequences on every layout, read from the start at each validation step."""
from __future__ import annotations

from typing import Callable

import torch

from composer.data import DataLoader


def due(step: int, freq: int, last: int) -> bool:
    """Whether ``step`` is every ``freq``-th one or the ``last``."""
    return step % freq == 0 or step == last


class Validation:
    """When the run validates and what the loss over the held-out batches is."""

    def __init__(self, data: DataLoader | None, batches: int, freq: int, last: int):
        """``batches``: microbatches per validation (steps x accumulation steps)."""
        self.data, self.batches, self.freq, self.last = data, batches, freq, last
        self.start = data.state_dict() if data is not None else None

    def due(self, step: int) -> bool:
        return self.data is not None and due(step, self.freq, self.last)

    @torch.no_grad()
    def loss(self, evaluate: Callable[[tuple], tuple[torch.Tensor, torch.Tensor]],
             total_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """The global mean loss: ``evaluate`` gives a batch's summed loss and target count
        on this rank, ``total_of`` (summed loss, count) their global mean."""
        self.data.load_state_dict(self.start)
        losses, counts = zip(*(evaluate(self.data.next_batch()) for _ in range(self.batches)))
        return total_of(sum(loss.double() for loss in losses), sum(counts)).item()
