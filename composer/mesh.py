"""ParallelDims: the parallel degrees, validated, and the one DeviceMesh built from them.

The mesh has five named dims, outermost first: pp, dp_replicate, dp_shard, cp,
tp. tp is innermost so a tensor-parallel group stays inside a node. Flattened
views serve the passes: ``dp`` (data loading, DDP), ``dp_shard_cp`` (FSDP),
``dp_cp`` (loss reduction). Expert parallel borrows ranks of ``dp_shard x cp``:
``dp_shard_cp`` is unflattened into ``efsdp x ep`` (ep innermost, so an expert
group is consecutive ranks, the cp ranks of one sequence first), experts are
spread over ``ep`` and FSDP-sharded over ``efsdp``. No other code builds
process groups. Bad degrees raise ValueError.

Imports: torch_compat, config.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from composer import torch_compat

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


@dataclass
class ParallelDims:
    """The degrees of a layout, checked against ``world_size`` (ValueError naming
    the ones that do not multiply to it): pipeline ``pp``, data parallel
    ``dp_replicate`` x ``dp_shard`` (-1: what the others leave), context ``cp``,
    tensor ``tp``, and expert ``ep``, which borrows ranks of ``dp_shard`` x ``cp``.
    ``build_mesh`` (once the process group exists) makes the one DeviceMesh;
    ``mesh(name)`` hands out its dims and views, ``coords(rank)`` a rank's place
    in it, known before any process group.

    >>> from composer import ParallelDims
    >>> dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=2, ep=1, world_size=8)
    >>> dims.dp_shard, dims.coords(5)
    (2, {'tp': 1, 'cp': 0, 'dp_shard': 0, 'dp_replicate': 0, 'pp': 1})
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    # fault-tolerant replica groups (composer.faults.replicas): each group is a job of its
    # own, outside this mesh; only the data (which windows, how many per step) spans them
    replica_groups: int = 1
    replica_group: int = 0

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        fixed = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % fixed:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by pp {self.pp} x dp_replicate "
                    f"{self.dp_replicate} x cp {self.cp} x tp {self.tp} = {fixed}, so "
                    f"parallelism.data_parallel_shard_degree=-1 has no whole value "
                    f"({self.world_size} / {fixed} = {self.world_size / fixed:.2f})")
            self.dp_shard = self.world_size // fixed
        product = fixed * self.dp_shard
        if product != self.world_size:
            raise ValueError(
                f"parallel degrees multiply to {product} but the world size is {self.world_size}: "
                f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
                f"x cp {self.cp} x tp {self.tp}")
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"parallelism.expert_parallel_degree={self.ep} must divide dp_shard x cp = "
                f"{self.dp_shard} x {self.cp} = {self.dp_shard * self.cp} "
                f"(experts borrow those ranks)")

    @property
    def degrees(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step consumes."""
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> dict[str, int]:
        """This global rank's index along each dim, known before any process group
        exists (the mesh lays ranks out row-major over ``degrees``)."""
        index = {}
        for name, degree in reversed(list(zip(DIMS, self.degrees))):
            index[name] = rank % degree
            rank //= degree
        return index

    @property
    def replicas(self) -> int:
        """Ranks whose gradients of one parameter are averaged: data x context parallel."""
        return self.dp * self.cp

    @property
    def ddp_dim(self) -> str:
        """The mesh view DDP replicates over (context-parallel ranks hold copies too)."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def fsdp_dim(self) -> str:
        """The mesh view FSDP shards over."""
        return "dp_shard_cp" if self.cp > 1 else "dp_shard"

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def data_rank(self, rank: int) -> int:
        """Which of the ``data_degree`` shares of a step's batch this rank reads."""
        return self.replica_group * self.dp + self.dp_rank(rank)

    @property
    def data_degree(self) -> int:
        """The shares of a step's batch: data parallel ranks, over every replica group."""
        return self.replica_groups * self.dp

    @property
    def dp_enabled(self) -> bool:
        """Whether gradients are averaged over ranks (data or context parallel)."""
        return self.replicas > 1

    def init_process_groups(self, device_type: str, store: dist.Store, rank: int,
                            timeout: timedelta) -> DeviceMesh:
        """Join the job's process group of ``world_size`` ranks through ``store`` and
        build its mesh. Under torchrun the job's ranks are the launch's; a launch
        that runs several jobs gives each the store prefix and ranks of its own
        subset of the launch's ranks, so each job sees a world of its own size."""
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=self.world_size,
                                timeout=timeout)
        return self.build_mesh(device_type)

    def build_mesh(self, device_type: str, checkpoint_backend: str = "gloo") -> DeviceMesh:
        """Build the world mesh and its flattened views; ``mesh(name)`` hands them out.
        ``checkpoint_backend``: the backend of DCP's group of every rank."""
        world = init_device_mesh(device_type, self.degrees, mesh_dim_names=DIMS)
        self._meshes = {name: world[name] for name in DIMS}
        # torch wants flattened views kept by their owner, not sliced from the root.
        self._meshes.update({name: torch_compat.flatten_mesh(world[dims], name)
                             for name, dims in FLATTENED.items()})
        self._meshes["world"] = world
        self._checkpoint_group = dist.new_group(backend=checkpoint_backend)
        if self.ep > 1:
            shard = self.dp_shard * self.cp
            experts = torch_compat.unflatten_mesh(
                world["dp_replicate", "dp_shard_cp"], "dp_shard_cp", (shard // self.ep, self.ep),
                ("efsdp", "ep"))
            self._meshes.update(ep=experts["ep"], efsdp=experts["efsdp"], experts=experts)
        return world

    def checkpoint_group(self):
        """A gloo group of every rank for DCP's collectives, apart from training's
        (an asynchronous save runs them on a background thread)."""
        return self._checkpoint_group

    def groups(self) -> dict[str, object]:
        """Process group of every named dim and flattened view, by name. Views
        come first, so where a view and a base dim hold the same ranks (and torch
        hands both the same group) a reverse lookup finds the base dim."""
        names = (*FLATTENED, *DIMS, *(("efsdp", "ep") if self.ep > 1 else ()))
        return {name: self._meshes[name].get_group() for name in names}

    def mesh(self, *names: str) -> DeviceMesh:
        """A named dim, a flattened view (dp, dp_shard_cp, dp_cp), ep or efsdp, or,
        for several dims, their joint sub-mesh."""
        if len(names) == 1:
            return self._meshes[names[0]]
        root = "experts" if {"ep", "efsdp"} & set(names) else "world"
        return self._meshes[root][names]
