"""What the trainer minimises (``training.objective``), behind one narrow interface so
the loop stays the same for every objective:

- ``count(targets)``: what one batch adds to the loss's normaliser (target tokens for
  "lm", pairs for "dpo"); the trainer sums it over microbatches and data ranks;
- ``reference(forward, targets)``: what the loss needs from a forward other than the
  trained one, computed before it (None for "lm"; DPO's reference log-probabilities);
  ``forward`` is the policy's forward on the batch, a ``functools.partial`` whose
  ``args`` and ``keywords`` another model may take;
- ``loss_sum(logits, targets, reference)``: the batch's summed loss;
- ``row(sum_all, count)``: the objective's own columns of a logged step.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from composer.data import IGNORE_INDEX
from composer.inference.decode import load_weights
from composer.job.plan import Plan
from composer.parallel.materialize import full_tensor
from composer.trainer.build import build_model
from composer.trainer.dpo import METRICS, dpo_terms
from composer.trainer.loss import loss_sum


class LanguageModeling:
    """Next-token cross-entropy over the target tokens (``training.objective = "lm"``)."""

    sequences = 1  # sequences a batch holds per example

    def __init__(self, plan: Plan):
        cfg = plan.cfg
        self.loss_fn = (torch.compile(loss_sum, backend=cfg.compile.backend)
                        if cfg.compile.enable and cfg.compile.loss else loss_sum)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets != IGNORE_INDEX).sum()

    def reference(self, forward: Callable[[], torch.Tensor], targets: torch.Tensor) -> None:
        return None

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor, reference=None
                 ) -> torch.Tensor:
        return self.loss_fn(logits, targets)

    def row(self, sum_all: Callable, count: int) -> dict:
        return {}


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B] each sequence's summed log-probability of its targets (IGNORE_INDEX ones
    add nothing), in float64 where the logits are. Through ``cross_entropy``, so
    vocabulary-sharded logits (loss parallel) work as they do for the LM loss."""
    flat = logits.flatten(0, 1)
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
    nll = F.cross_entropy(flat, targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    return -full_tensor(nll).view(targets.shape).sum(1)


class PreferenceDPO:
    """DPO on pairs (``training.objective = "dpo"``, composer/trainer/dpo.py): a batch holds
    each pair's chosen sequence, then its rejected one; the reference is the model
    under every converter's ``reference`` context (LoRA: adapters off), without grad."""

    sequences = 2

    def __init__(self, plan: Plan, parts: list[nn.Module]):
        self.beta, self.parts = plan.cfg.dpo.beta, parts
        self.contexts = [c.reference for c in plan.converters if c.reference is not None]
        # full fine-tuning: no converter keeps the base, so a frozen copy of it does
        self.frozen = None if self.contexts else frozen_copy(plan)
        self.sums = torch.zeros(3, dtype=torch.float64, device=plan.device)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(targets.shape[0] // 2)

    @torch.no_grad()
    def reference(self, forward: Callable[[], torch.Tensor], targets: torch.Tensor
                  ) -> torch.Tensor:
        if self.frozen is not None:
            return sequence_logps(self.frozen[0](*forward.args, **forward.keywords), targets)
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context(self.parts))
            return sequence_logps(forward(), targets)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor
                 ) -> torch.Tensor:
        loss, chosen, rejected = dpo_terms(sequence_logps(logits, targets), reference,
                                           self.beta)
        if torch.is_grad_enabled():  # training batches only, not validation's
            self.sums += torch.stack([chosen.sum(), rejected.sum(),
                                      (chosen > rejected).sum()]).detach().double()
        return loss

    def row(self, sum_all: Callable, count: int) -> dict:
        """The step's mean rewards, margin and accuracy over its global pairs."""
        chosen, rejected, right = (sum_all(self.sums.clone()) / count).tolist()
        self.sums.zero_()
        return dict(zip(METRICS, (chosen, rejected, chosen - rejected, right)))


def frozen_copy(plan: Plan) -> list[nn.Module]:
    """The model as the run starts it (its initial weights, else the seeded ones: what the
    policy starts from, whether or not it resumes), laid out like the policy, frozen."""
    parts = build_model(plan)
    load_weights(plan, parts, None)
    for part in parts:
        part.requires_grad_(False)
    return parts


def make_objective(plan: Plan, parts: list[nn.Module]) -> LanguageModeling | PreferenceDPO:
    if plan.cfg.training.objective == "dpo":
        return PreferenceDPO(plan, parts)
    return LanguageModeling(plan)
