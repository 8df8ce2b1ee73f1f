"""Fault-tolerant replica groups through torchft (``pip install 'composer-parallel[ft]'``).

With ``fault_tolerance.enable`` a job is one of ``group_size`` replica groups: each is an
ordinary composer job (its own torchrun, any inner layout) and a lighthouse
(``torchft_lighthouse``) forms a quorum of the live groups at every step. Gradients are
averaged over the quorum's groups by torchft's managed process group, which joins rank r
of every group (their layouts are the same, so are their shards). A step during which a
group is lost is not committed (``should_commit`` is false everywhere): the survivors redo
it with the new quorum, normalised by its tokens, and nothing of theirs restarts. A group
that starts behind the others (restarted, with or without a checkpoint) joins at the next
quorum and receives from a live peer's rank of its own number the weights, the optimizer
state, the step and the data position (torchft's heal), then trains on.

The windows a group reads at a step are a function of (step, replica_id) alone
(``ParallelDims.data_rank``): a group that is down trains none of its windows of those
steps, and a healed group takes its data position from its peer, so no window is
trained twice. ``OneGroup`` is what a job without fault tolerance has: nothing crosses it.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from composer.checkpoint.dcp import everything, run_state, set_run_state
from composer.config import JobConfig, bounded, register_section
from composer.converters.base import saved_keys
from composer.parallel.data import hook_all_reduce, reshard

log = logging.getLogger("composer")
EXTRA = "pip install 'composer-parallel[ft]'"


@dataclass
class FaultTolerance:
    """Replica groups that torchft keeps training when one is lost."""

    enable: bool = field(default=False, metadata={
        "help": "train as one of group_size replica groups that torchft keeps going when "
                "one is lost"})
    replica_id: int = bounded(0, 0, help="this group's id: 0..group_size-1")
    group_size: int = bounded(1, 1, help="the number of replica groups")
    min_replicas: int = bounded(1, 1, help="the fewest groups a step commits with")
    lighthouse: str = field(default="", metadata={
        "help": "the lighthouse's address (http://host:port); empty: torchft's "
                "TORCHFT_LIGHTHOUSE"})
    timeout_s: float = bounded(60.0, 1.0, help="the longest a quorum, a collective across "
                               "groups or a heal may take")

    def check(self, cfg: JobConfig, dims) -> None:
        """ValueError naming the key, for settings torchft cannot run."""
        if not self.enable:
            return
        if importlib.util.find_spec("torchft") is None:
            raise ValueError(f"fault_tolerance.enable=true: torchft is not installed: {EXTRA}")
        if self.replica_id >= self.group_size:
            raise ValueError(f"fault_tolerance.replica_id={self.replica_id}: out of range; "
                             f"allowed: 0..{self.group_size - 1} (group_size {self.group_size})")
        if self.min_replicas > self.group_size:
            raise ValueError(f"fault_tolerance.min_replicas={self.min_replicas}: more than the "
                             f"{self.group_size} groups; allowed: 1..{self.group_size}")
        if not (self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
            raise ValueError("fault_tolerance.lighthouse='': no lighthouse address and "
                             "TORCHFT_LIGHTHOUSE is unset; allowed: http://host:port")
        replicate = cfg.parallelism.data_parallel_replicate_degree
        if replicate != 1:
            raise ValueError(f"parallelism.data_parallel_replicate_degree={replicate} with "
                             f"fault tolerance: the replica groups replicate; allowed: 1")
        if cfg.recovery.spike_factor > 0:
            raise ValueError(f"recovery.spike_factor={cfg.recovery.spike_factor} with fault "
                             f"tolerance: one group writes the checkpoints a roll-back reads; "
                             f"allowed: 0")


register_section("fault_tolerance", FaultTolerance)


def replica_groups(cfg: JobConfig) -> tuple[int, int]:
    """(how many replica groups, which one this job is): (1, 0) without fault tolerance."""
    ft = cfg.fault_tolerance
    return (ft.group_size, ft.replica_id) if ft.enable else (1, 0)


class OneGroup:
    """A job without fault tolerance: one group, and nothing crosses it."""

    count = 1       # the groups taking part in this step
    saves = True    # whether this group writes the checkpoints

    def begin(self) -> None:
        """Before the step's first collective (a quorum; a heal, if this group is behind)."""

    def tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tokens over its groups (this group's: ``tokens``)."""
        return tokens

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def average(self, params: list[torch.Tensor]) -> None:
        """Average the parameters' gradients over the step's groups, in place."""

    def commit(self) -> bool:
        """Whether every group of the step may take it (False: redo it)."""
        return True

    def row(self) -> dict:
        return {}

    def close(self) -> None:
        """The run has ended (also when it failed)."""


def _local(state):
    """``state`` with this rank's shard of each DTensor: what a peer's same rank holds."""
    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    return state.to_local() if isinstance(state, DTensor) else state


def _copy_into(own: dict, received: dict) -> None:
    """Fill ``own`` (run_state's form) with a peer's ``_local`` copy, in place."""
    for key, value in received.items():
        mine = own.get(key)
        if isinstance(value, dict):
            _copy_into(mine, value)
        elif isinstance(mine, torch.Tensor):
            (mine.to_local() if isinstance(mine, DTensor) else mine).copy_(value)
        else:
            own[key] = value


class ReplicaGroups(OneGroup):
    """This job as one of torchft's replica groups (see the module's docstring).
    ``train_state``: the trainer's step, data position and RNG; ``restore``: the
    trainer continues from such a dict (a heal's); ``record(key, value)``: into the run
    record."""

    def __init__(self, plan, parts: list, optimizers: list, train_state: Callable[[], dict],
                 restore: Callable[[dict], None], record: Callable[[str, object], None]):
        import torchft
        self.ft = ft = plan.cfg.fault_tolerance
        self.parts, self.optimizers, self.train_state, self.restore = (
            parts, optimizers, train_state, restore)
        self.keys = saved_keys(plan.converters) or everything
        self.record = record
        self.per_step = plan.accum_steps * plan.cfg.training.local_batch_size * plan.dims.dp
        self.groups = list(range(ft.group_size))  # those of the last step
        self.windows = torch.zeros(ft.group_size, dtype=torch.int64)  # trained, per group
        self.missed = torch.zeros(ft.group_size, dtype=torch.int64)   # steps missed
        self.heals: list[dict] = []
        self.healed_from: int | None = None
        timeout = timedelta(seconds=ft.timeout_s)
        pg = (torchft.ProcessGroupNCCL(timeout) if plan.device.type == "cuda"
              else torchft.ProcessGroupGloo(timeout))
        self.store = None
        if "MASTER_ADDR" not in os.environ:  # one process, no torchrun: a store of its own
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.manager = torchft.Manager(
            pg=pg, min_replica_size=ft.min_replicas, load_state_dict=self._healed,
            state_dict=self._state, use_async_quorum=False, init_sync=False,
            replica_id=f"composer_{ft.replica_id}", lighthouse_addr=ft.lighthouse or None,
            rank=plan.rank, world_size=plan.dims.world_size, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout,
            store_addr="127.0.0.1" if self.store else None,
            store_port=self.store.port if self.store else None)
        # FSDP2's units average their own gradient shards across the groups during the
        # backward; average() takes the rest (DDP, a part FSDP2 does not shard)
        self.hooked = hook_all_reduce(parts, self._average_shard)
        self._record()

    def _record(self, **extra) -> None:
        self.record("fault_tolerance", {**asdict(self.ft), "heals": self.heals, **extra})

    @property
    def count(self) -> int:
        return self.manager.num_participants()

    @property
    def saves(self) -> bool:
        return min(self.groups) == self.ft.replica_id

    def _state(self) -> dict:
        """What a peer that heals from this group receives (torchft asks on its thread
        while the trainer waits for the quorum)."""
        run = run_state(self.parts, self.optimizers, self.train_state(), self.keys)
        return {"group": self.ft.replica_id, "run": _local(run),
                "windows": self.windows.clone(), "missed": self.missed.clone()}

    def _healed(self, received: dict) -> None:
        own = run_state(self.parts, self.optimizers, self.train_state(), self.keys)
        _copy_into(own, received["run"])
        set_run_state(self.parts, self.optimizers, own, self.keys)
        self.restore(own["train"])
        self.windows.copy_(received["windows"])
        self.missed.copy_(received["missed"])
        self.healed_from = received["group"]

    def begin(self) -> None:
        start, self.healed_from = time.monotonic(), None
        reshard(self.parts)  # a heal's source takes its state dict on some ranks only
        self.manager.start_quorum()
        if self.healed_from is None:
            return
        heal = {"step": int(self.train_state()["step"]), "source": self.healed_from,
                "seconds": round(time.monotonic() - start, 3)}
        self.heals.append(heal)
        log.info("healed from replica group %d at step %d in %.2f s", heal["source"],
                 heal["step"], heal["seconds"])
        self._record()

    def tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """One collective gives the step's tokens and which groups it has."""
        size = self.ft.group_size
        both = torch.zeros(1 + size, dtype=torch.float64, device=tokens.device)
        both[0], both[1 + self.ft.replica_id] = tokens, 1
        self.manager.allreduce(both, reduce_op=dist.ReduceOp.SUM).wait()
        groups = [g for g in range(size) if both[1 + g] > 0.5]
        if lost := sorted(set(self.groups) - set(groups)):
            log.warning("replica group(s) %s lost; the step goes on with groups %s", lost, groups)
        if joined := sorted(set(groups) - set(self.groups)):
            log.info("replica group(s) %s joined; the step has groups %s", joined, groups)
        self.groups = groups
        return both[0].to(tokens.dtype)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM).wait()
        return t

    def _average_shard(self, shard: torch.Tensor) -> None:
        self.manager.allreduce(shard).wait()  # the mean over the quorum's groups

    def average(self, params: list[torch.Tensor]) -> None:
        """One all-reduce per dtype of the local gradients no FSDP2 hook averaged, flattened."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None and id(p) not in self.hooked:
                grad = _local(p.grad)
                by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()  # the mean over the quorum's groups
            for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(part.view_as(grad))

    def commit(self) -> bool:
        committed = self.manager.should_commit()
        if committed:
            taking = torch.zeros_like(self.windows, dtype=torch.bool)
            taking[self.groups] = True
            self.windows += taking * self.per_step
            self.missed += ~taking
        return committed

    def row(self) -> dict:
        return {"groups": list(self.groups)}

    def close(self) -> None:
        windows, missed = self.windows.tolist(), self.missed.tolist()
        log.info("replica groups: windows trained %s, steps missed %s, heals %d",
                 windows, missed, len(self.heals))
        self._record(windows_trained=windows, steps_missed=missed)
        self.manager.shutdown(wait=False)


def make_replicas(plan, parts: list, optimizers: list, train_state: Callable[[], dict],
                  restore: Callable[[dict], None], record: Callable[[str, object], None]
                  ) -> OneGroup:
    """The run's replica groups: torchft's where fault tolerance is on."""
    if not plan.cfg.fault_tolerance.enable:
        return OneGroup()
    return ReplicaGroups(plan, parts, optimizers, train_state, restore, record)
