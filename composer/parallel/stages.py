"""Pipeline stages, decided before any process group: cut a model into stages by
its units, place them on the ``pp`` ranks, and check the schedule's constraints.

A stage is the whole model built again on the meta device with every unit it
does not own replaced, where it sits, by a weightless ``PassThrough``, the stage's input
handed to its first unit and its last unit's output returned (``cut_between``): any
forward runs as written, whatever it does around its units. A spec may instead ask
(``ParallelHooks.pipeline_pass_through = False``) that the units be removed (a block
deleted from its nn.ModuleDict, an embedding/norm/output set to None) for a forward that
skips what is missing. Parameter FQNs are the same on every layout.
Looped schedules put stage s on rank s % pp; V-shaped ones give rank r stages r
and 2pp-1-r.
Nothing here imports torch.distributed.pipelining (and with it the compiler).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from composer.config import config_from
from composer.parallel.tied import tied_groups
from composer.spec import PassThrough


@dataclass
class PipelinePlan:
    """How the model is cut into stages and which of them this rank runs."""

    schedule: str
    units: list[str]
    stage_units: list[list[str]]  # per stage, in stage order
    ids: list[int]                # this rank's stages
    microbatches: int
    pass_through: bool = False    # ParallelHooks.pipeline_pass_through

    def stage_modules(self, build: Callable[[], nn.Module]) -> list[nn.Module]:
        """This rank's stages, each ``build()`` (a fresh meta model) without the
        units of the other stages (with ``pass_through``: whose forward hands the stage's
        input to its first unit and returns its last unit's output, ``cut_between``)."""
        stages = []
        for i in self.ids:
            stage = prune(build(), self.units, self.stage_units[i], self.pass_through)
            if self.pass_through:
                cut_between(stage, self.units, self.stage_units[i], first=i == 0,
                            last=i == len(self.stage_units) - 1)
            stages.append(stage)
        return stages


V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


SINGLE_STAGE = ("GPipe", "1F1B")  # torch's PipelineScheduleSingle subclasses


def is_single_stage(schedule: str) -> bool:
    return schedule in SINGLE_STAGE


def stages_per_rank(schedule: str, requested: int) -> int:
    """1 for single-stage schedules, 2 for V shapes, else ``requested`` (0: 2)."""
    if is_single_stage(schedule):
        return 1
    if schedule in V_SHAPED:
        return 2
    return requested or 2


def stage_ids(rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


def split_units(units: list[str], blocks: list[str], stages: int, first_less: int = 0,
                last_less: int = 0) -> list[list[str]]:
    """Deal the blocks evenly over the stages (the first and last stage may take
    ``first_less``/``last_less`` fewer, to make room for the embedding and the
    output); units before the first block go to stage 0, after the last to the
    last stage. Raises ValueError when a stage would get no block."""
    total = len(blocks) + first_less + last_less
    sizes = [total // stages + (1 if i < total % stages else 0) for i in range(stages)]
    sizes[0] -= first_less
    sizes[-1] -= last_less
    if min(sizes) < 1:
        raise ValueError(f"{len(blocks)} blocks cannot fill {stages} stages "
                         f"(fewer by {first_less} first, {last_less} last): sizes {sizes}")
    start, end = units.index(blocks[0]), units.index(blocks[-1]) + 1
    parts, at = [], start
    for size in sizes:
        parts.append(units[at:at + size])
        at += size
    parts[0] = units[:start] + parts[0]
    parts[-1] = parts[-1] + units[end:]
    return parts


def parse_stage_fqns(text: str, units: list[str], stages: int) -> list[list[str]]:
    """'a,b;c;d,e' -> [[a, b], [c], [d, e]]: every unit once, in model order."""
    parts = [[u.strip() for u in stage.split(",") if u.strip()] for stage in text.split(";")]
    if len(parts) != stages:
        raise ValueError(f"{len(parts)} stages given, the layout has {stages}")
    if [u for p in parts for u in p] != units:
        raise ValueError(f"stages must list every unit once, in order: {', '.join(units)}")
    return parts


def prune(model: nn.Module, units: list[str], keep: list[str],
          pass_through: bool = False) -> nn.Module:
    """Remove every unit not in ``keep``: with ``pass_through`` a ``PassThrough`` takes
    its place; otherwise blocks leave their nn.ModuleDict and other modules become
    None (the model's forward skips them)."""
    for unit in units:
        if unit in keep:
            continue
        parent_name, _, name = unit.rpartition(".")
        parent = model.get_submodule(parent_name)
        if pass_through:
            setattr(parent, name, PassThrough())
        elif isinstance(parent, nn.ModuleDict):
            del parent[name]
        else:
            setattr(parent, name, None)
    return model


def cut_between(stage: nn.Module, units: list[str], held: list[str], first: bool,
                last: bool) -> nn.Module:
    """Make ``stage`` (the whole model, ``PassThrough``s in place of the ``units`` it
    lacks) compute what lies between the units it ``held`` and nothing else, whatever its
    forward does around them (positions added to the embedding, a scaled input, a final
    softcap): a stage after the first hands its input (the hidden states its forward is
    called with) to its first unit in place of what the forward made of it (the
    pass-throughs before that unit return that input too, so that what the forward does
    with them, e.g. adding two embeddings, meets tensors of one shape), and a stage
    before the last returns its last unit's output in place of what the forward returns."""
    entry = []  # this forward's input, until the first unit takes it

    def keep_input(module, args, kwargs):
        entry[:] = [args[0] if args else next(iter(kwargs.values()))]

    def give_input(module, args, output):
        return entry[0] if entry else output

    def take_input(module, args, kwargs):
        if not entry:  # a second call in one forward: the forward's own input stands
            return None
        hidden = entry.pop()
        if args:
            return (hidden, *args[1:]), kwargs
        name = next(k for k, v in kwargs.items() if torch.is_tensor(v))
        return args, {**kwargs, name: hidden}

    exit_ = []  # this forward's last unit's output

    def keep_output(module, args, output):
        exit_[:] = [output]

    def give_output(module, args, output):
        return exit_.pop() if exit_ else output

    if not first:
        stage.register_forward_pre_hook(keep_input, with_kwargs=True)
        stage.get_submodule(held[0]).register_forward_pre_hook(take_input, with_kwargs=True)
        for unit in units[:units.index(held[0])]:
            stage.get_submodule(unit).register_forward_hook(give_input)
    if not last:
        stage.get_submodule(held[-1]).register_forward_hook(keep_output)
        stage.register_forward_hook(give_output)
    return stage


def _units(spec, model: nn.Module, pp: int) -> list[str]:
    try:
        return spec.parallel.pipeline_units(model)
    except ValueError as e:
        raise ValueError(f"parallelism.pipeline_parallel_degree={pp}: model {spec.name!r} "
                         f"cannot be cut into pipeline stages: {e}; allowed: 1") from None


def _stage_units(p, spec, model: nn.Module, units: list[str], stages: int) -> list[list[str]]:
    try:
        if p.pipeline_parallel_stage_fqns:
            return parse_stage_fqns(p.pipeline_parallel_stage_fqns, units, stages)
        return split_units(units, spec.block_names(model), stages,
                           p.pipeline_parallel_first_stage_less_layers,
                           p.pipeline_parallel_last_stage_less_layers)
    except ValueError as e:
        key = "stage_fqns" if p.pipeline_parallel_stage_fqns else "degree"
        raise ValueError(f"parallelism.pipeline_parallel_{key}: {e}") from None


def _check_containers(model: nn.Module, units: list[str]) -> None:
    """A stage removes the units it does not hold: from an nn.ModuleList that would
    renumber the blocks after them (and their checkpoint keys)."""
    for unit in units:
        parent = unit.rpartition(".")[0]
        if isinstance(model.get_submodule(parent), nn.ModuleList):
            raise ValueError(f"parallelism.pipeline_parallel_degree: pipeline unit {unit!r} is "
                             f"in an nn.ModuleList, which would renumber the blocks after a "
                             f"removed one; keep the blocks in an nn.ModuleDict keyed "
                             f"'0'..'N-1', or leave ParallelHooks.pipeline_pass_through on")


def _check_tied(model, stage_units: list[list[str]]) -> None:
    """A weight shared by two stages would silently become two weights."""
    stage_of = {u: i for i, units in enumerate(stage_units) for u in units}
    for names in tied_groups(model):
        owners = {i for n in names for u, i in stage_of.items() if n.startswith(u + ".")}
        if len(owners) > 1:
            raise ValueError(f"parallelism.pipeline_parallel_degree: tied parameters "
                              f"{', '.join(names)} would land on stages {sorted(owners)}; "
                              f"use an untied flavor or keep them on one stage")


def _microbatches(p, local_batch: int, stages: int) -> int:
    m = p.pipeline_parallel_microbatches
    if m == 0:
        fits = [k for k in range(stages, local_batch + 1, stages) if local_batch % k == 0]
        if not fits:
            raise ValueError(f"training.local_batch_size={local_batch}: no multiple of the "
                              f"{stages} pipeline stages divides it; set "
                              f"parallelism.pipeline_parallel_microbatches")
        return fits[-1]
    if local_batch % m:
        raise ValueError(f"parallelism.pipeline_parallel_microbatches={m} does not divide "
                          f"training.local_batch_size={local_batch}")
    return m


def _check_schedule(schedule: str, m: int, pp: int, stages: int) -> None:
    """The constraints torch's schedules raise on, caught before any collective."""
    key = f"parallelism.pipeline_parallel_microbatches={m}"
    rounds = max(1, m // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
        raise ValueError(f"{key}: {schedule} needs a multiple of its rounds "
                          f"(microbatches // pp = {rounds})")
    if schedule in ("1F1B", "DualPipeV") and m < stages:
        raise ValueError(f"{key}: {schedule} needs at least as many microbatches as "
                          f"stages ({stages})")


def plan_pipeline(p, spec, model: nn.Module, pp: int, pp_rank: int,
                  local_batch: int) -> PipelinePlan | None:
    """This rank's stages for ``p`` (the parallelism config) and the meta ``model``
    of ``spec``; None without pipeline parallel. ValueError names the key."""
    return plan_stages(p, spec, model, pp, pp_rank, local_batch) if pp > 1 else None


def plan_stages(p, spec, model: nn.Module, pp: int, pp_rank: int,
                local_batch: int) -> PipelinePlan:
    """``plan_pipeline``'s cut, also of one stage on one rank (``pp`` = 1)."""
    if spec.parallel.pipeline_units is None:
        raise ValueError(f"parallelism.pipeline_parallel_degree={pp}: model "
                          f"{spec.name!r} names no pipeline units; allowed: 1")
    if p.zero_stage == 1:
        raise ValueError(f"parallelism.pipeline_parallel_degree={pp}: parallelism."
                          f"zero_stage=1 is not supported with pipeline parallel; allowed: 0, 2, 3")
    schedule = p.pipeline_parallel_schedule
    per_rank = stages_per_rank(schedule, p.pipeline_parallel_stages_per_rank)
    units = _units(spec, model, pp)
    stage_units = _stage_units(p, spec, model, units, pp * per_rank)
    if not spec.parallel.pipeline_pass_through:
        _check_containers(model, units)
    _check_tied(model, stage_units)
    m = _microbatches(p, local_batch, len(stage_units))
    _check_schedule(schedule, m, pp, len(stage_units))
    ids = stage_ids(pp_rank, pp, per_rank, schedule)
    return PipelinePlan(schedule, units, stage_units, ids, m, spec.parallel.pipeline_pass_through)


def pipeline_stages(spec, build: Callable[[], nn.Module], pp: int, pp_rank: int,
                    local_batch: int, schedule: str = "1F1B", microbatches: int = 0,
                    stages_per_rank: int = 0) -> tuple[PipelinePlan, list[nn.Module]]:
    """Cut the model of ``spec`` into pipeline stages as the trainer does, and return
    the plan and the meta modules of the stages pipeline rank ``pp_rank`` of ``pp``
    runs. ``build()``: a fresh meta model (converted, where converters are used);
    each stage is one of them with the units of the other stages removed
    (``ModelSpec.parallel.pipeline_units``), so parameter names stay the model's.
    The blocks are dealt evenly; ``schedule``: a torch schedule name (GPipe,
    1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
    DualPipeV); ``microbatches`` (0: the largest multiple of the stage count that
    divides ``local_batch``) and ``stages_per_rank`` (looped schedules; 0: 2) as the
    ``parallelism.pipeline_parallel_*`` keys of the same names say. ValueError
    (naming the key) for a cut or schedule that cannot work. Then parallelize and
    materialize each stage (``from_replica=True``) and ``build_pipeline``.

    >>> import torch
    >>> from torch import nn
    >>> from composer import ModelSpec, ParallelHooks, pipeline_stages
    >>> class Net(nn.Module):
    ...     def __init__(self, dim):
    ...         super().__init__()
    ...         self.blocks = nn.ModuleDict({str(i): nn.Linear(dim, dim) for i in range(4)})
    ...         self.head = nn.Linear(dim, 2)
    ...     def forward(self, x):
    ...         for block in self.blocks.values():
    ...             x = block(x).relu()
    ...         return x if self.head is None else self.head(x)
    >>> spec = ModelSpec("net", {"tiny": 8}, build=Net,
    ...                  blocks=lambda m: list(m.blocks.values()),
    ...                  parallel=ParallelHooks(pipeline_units=lambda m: [
    ...                      *(f"blocks.{k}" for k in m.blocks), "head"]))
    >>> plan, stages = pipeline_stages(spec, lambda: spec.build_meta(8), pp=2, pp_rank=1,
    ...                                local_batch=4)
    >>> plan.ids, plan.microbatches, [type(b).__name__ for b in stages[0].blocks.values()]
    ([1], 4, ['PassThrough', 'PassThrough', 'Linear', 'Linear'])
    """
    p = config_from({"parallelism": {
        "pipeline_parallel_degree": pp, "pipeline_parallel_schedule": schedule,
        "pipeline_parallel_microbatches": microbatches,
        "pipeline_parallel_stages_per_rank": stages_per_rank}}).parallelism
    plan = plan_stages(p, spec, build(), pp, pp_rank, local_batch)
    return plan, plan.stage_modules(build)
