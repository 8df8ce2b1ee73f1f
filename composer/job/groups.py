"""The job's process groups, made once the job is planned: through torchrun's store, or a
store of the job's own where one launch runs several jobs (``ParallelDims`` makes them)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from composer.job.plan import Plan


def init_distributed(plan: Plan, world_size: int, store: dist.Store | None = None
                     ) -> dist.Store | None:
    """The job's process groups: through torchrun's store, or through ``store``
    (already the job's own) where one launch runs several jobs. Returns the job's store
    (None for one process)."""
    if world_size == 1:
        return None
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    timeout = timedelta(seconds=plan.cfg.job.collective_timeout_s)
    if store is None:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun keeps one store for all its restarts and torch adds no prefix per
        # attempt, so a restarted rank could read a dead peer's address (gloo then
        # fails to connect, or stalls). Each attempt gets its own keys.
        store = dist.PrefixStore(
            f"composer/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    plan.dims.init_process_groups(plan.device.type, store, plan.rank, timeout)
    return store
