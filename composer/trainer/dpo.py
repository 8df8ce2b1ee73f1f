"""Preference tuning by DPO (``training.objective = "dpo"``, section ``dpo``).

Each example is a pair of answers to one prompt, the ``chosen`` one preferred to the
``rejected`` one (``composer/data/preference.py``). With ``pi`` the summed log-probability
of an answer's learned tokens (exactly the tokens SFT learns) under the model being
trained and ``ref`` the same under the frozen reference (the base model: the converters'
``reference`` context, e.g. LoRA's adapters off, so no second copy; with full
fine-tuning a frozen copy of the starting model, sharded like the policy), a pair's
loss is

    -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

(Rafailov et al., 2023). Its rewards are ``beta * (pi - ref)`` of each answer; the
run reports their means over the step's pairs, the mean margin (chosen - rejected) and
the share of pairs whose chosen reward is the larger (``dpo_chosen_reward``,
``dpo_rejected_reward``, ``dpo_margin``, ``dpo_accuracy``). The loss is the mean over
the global batch's pairs (``training.local_batch_size`` counts pairs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from composer.config import JobConfig, bounded, register_section

METRICS = ("dpo_chosen_reward", "dpo_rejected_reward", "dpo_margin", "dpo_accuracy")


@dataclass
class Dpo:
    """Direct preference optimization (``training.objective = "dpo"``)."""

    beta: float = bounded(0.1, help="how far from the reference the policy may move: the "
                          "rewards are beta x the log-probability ratios; must be > 0")


    def check(self, cfg: JobConfig, dims) -> None:
        """Checked with the job's layout, before any process group (``composer.job``)."""
        check_dpo(cfg)


register_section("dpo", Dpo)


def check_dpo(cfg: JobConfig) -> None:
    """ValueError naming the key, for a DPO job composer cannot run (and for preference
    data without DPO); nothing to say for a language-modelling job on other data."""
    objective, data_format = cfg.training.objective, cfg.data.format
    if data_format == "preference" and cfg.data.columns:
        raise ValueError(f"data.columns={cfg.data.columns!r} with data.format='preference': "
                         f"pairs are read by their own fields (prompt, chosen, rejected); "
                         f"allowed: ''")
    if objective != "dpo":
        if data_format == "preference":
            raise ValueError(f"data.format='preference': pairs train only with "
                             f"training.objective='dpo' (it is {objective!r})")
        return
    p = cfg.parallelism
    if data_format != "preference":
        raise ValueError(f"training.objective='dpo': it learns from pairs; set "
                         f"data.format='preference' (it is {data_format!r})")
    if cfg.dpo.beta <= 0:
        raise ValueError(f"dpo.beta={cfg.dpo.beta}: out of range; allowed: > 0")
    if cfg.data.sft_packing:
        raise ValueError("data.sft_packing=true with training.objective='dpo': each answer "
                         "of a pair is its own padded sequence; allowed: false")
    for key, degree in (("pipeline_parallel_degree", p.pipeline_parallel_degree),
                        ("context_parallel_degree", p.context_parallel_degree)):
        if degree > 1:
            raise ValueError(f"parallelism.{key}={degree} with training.objective='dpo': a "
                             f"pair's answers and their log-probabilities must stay on one "
                             f"rank; allowed: 1")


def dpo_terms(policy: torch.Tensor, reference: torch.Tensor, beta: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss, chosen rewards, rejected rewards) of the pairs whose answers'
    log-probabilities are ``policy`` and ``reference`` ([2n]: the n chosen, then the n
    rejected)."""
    chosen, rejected = (beta * (policy - reference)).chunk(2)
    return -F.logsigmoid(chosen - rejected).sum(), chosen, rejected
