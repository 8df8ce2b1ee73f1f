"""The dry run: the job's real build and one real training step, for one rank of the
full world, in this one CPU process, beside the planner's prediction.

    WORLD_SIZE=512 python -m composer.train --dry-run --config train_configs/llama3_405b.toml
    WORLD_SIZE=64 python -m composer.train --dry-run --dry-run-rank 9 --config F --json

``WORLD_SIZE`` is the world the job is meant for (``LOCAL_WORLD_SIZE`` its ranks a node,
8 unless given). The process joins torch's fake process group as the chosen rank (its
collectives return at once and move nothing), the parallelize passes run on the meta
model as in training, and the weights, activations and optimizer state are fake tensors
(shapes and dtypes, no data), so a 405B model's rank fits in a laptop. The step is the
trainer's own (its accumulation microbatches, the clip and the optimizer step; of more
than three microbatches the middle ones are one traced and counted for all) under
torch's memory tracker and the collective counter of ``metrics.comm_stats``: the rank's
peak by the categories of ``metrics.memory_breakdown`` and its collectives by
``{phase: {dim: {kind: {count, bytes, ring_bytes}}}}``. The planner's answer
(``composer.planner``, the CPU profile) is computed apart and printed beside it: two
independent answers to the same question. A scalar read from a tensor (``.item()``: the
loss normaliser's token count, the loss and gradient norm) reads 1 under fake tensors.

Exit status 0 when the step ran (fitting or not), 2 with one line for bad input. A pass
that cannot run under fake tensors is named in ``skipped``: the known ones (compile,
packed documents under SDPA) are traced without, and a step that fails anywhere else
(pipeline parallel: torch's stages swap their shapes through the process group at the
first step) leaves ``traced`` null beside the planner's answer, still with status 0.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
import traceback
import weakref

import torch
import torch.distributed as dist

from composer import torch_compat
from composer.config import ConfigError, JobConfig, parse_args
from composer.job.plan import Plan, plan_job
from composer.observe.comm import CommCounter, CommObserver
from composer.observe.memory import CATEGORIES, GIB, MemoryMeter, MemoryObserver
from composer.parallel.tied import retie, tied_groups
from composer.planner.cluster import load_cluster
from composer.planner.layout import layout_of, load_model
from composer.planner.predict import predict
from composer.planner.trace import RoutedRows, tensors_in
from composer.trainer.build import parallelized
from composer.trainer.optim import clip_grad_norm_
from composer.trainer.trainer import Trainer

log = logging.getLogger("composer")

FLAGS = ("--dry-run", "--json")


def _swapped(x, swap):
    """``x`` with each tensor in it swapped for ``swap(tensor)``."""
    if isinstance(x, torch.Tensor):
        return swap(x)
    if isinstance(x, dict):
        return {k: _swapped(v, swap) for k, v in x.items()}
    return type(x)(_swapped(v, swap) for v in x) if isinstance(x, (list, tuple)) else x


class _Values(torch_compat.TorchDispatchMode):
    """Inside a fake tensor mode: values for the integer tensors an MoE layer routes by.

    Fake tensors have no values, but routing reads some: its tokens per expert
    (``torch.bincount``), summed, exchanged by all-to-all and read as split sizes. Those
    are taken as even (balanced routing, the planner's assumption too) and kept beside
    their fake tensors, real, through every op whose tensor inputs all have one; an
    all-to-all hands each rank what it sent (balanced), and ``repeat_interleave`` by them
    knows its size. A router written as a loop gets balanced rows per expert
    (``composer.planner.trace.RoutedRows``). Any other
    scalar read (``.item()``: the loss normaliser's token count, the loss, the gradient
    norm) reads 1."""

    def __init__(self):
        super().__init__()
        self.values: dict[int, tuple] = {}  # id(fake tensor) -> (weak ref, real value)
        self.routed = RoutedRows()

    def value(self, t):
        held = self.values.get(id(t)) if isinstance(t, torch.Tensor) else None
        return held[1] if held is not None and held[0]() is t else None

    def keep(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        key = id(fake)

        def forget(ref):  # unless the id is another tensor's by now
            if self.values.get(key, (None,))[0] is ref:
                del self.values[key]
        self.values[key] = (weakref.ref(fake, forget), real)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is torch_compat.scalar_read_op():
            known = self.value(args[0])
            if known is None:
                return 1
            with torch_compat.real_tensors():
                return known.item()
        if func is aten.bincount.default:
            return self._even_counts(*args, **kwargs)
        if func is aten.repeat_interleave.Tensor and self.value(args[0]) is not None:
            return self._repeat(args[0])
        if func is aten.nonzero.default and (rows := self.routed.rows(args[0])) is not None:
            return torch.empty(rows, args[0].dim(), dtype=torch.long, device=args[0].device)
        out = func(*args, **kwargs)
        if func is aten.topk.default:
            self.routed.saw_topk(args[0], out)
        if func is torch.ops.c10d.alltoall_base_.default and self.value(args[1]) is not None:
            self.keep(args[0], self.value(args[1]))  # never written in place
        else:
            self._follow(func, args, kwargs, out)
        return out

    def _even_counts(self, chosen, weights=None, minlength=0):
        if not minlength:
            raise ValueError("torch.bincount without minlength: its bins are unknown on fake "
                             "tensors")
        total = chosen.numel()
        with torch_compat.real_tensors():
            real = torch.tensor([total // minlength + (i < total % minlength)
                                 for i in range(minlength)])
        fake = torch.empty(minlength, dtype=torch.int64, device=chosen.device)
        self.keep(fake, real)
        return fake

    def _repeat(self, repeats):
        """The index ``repeats`` (of known value) stands for: each i, repeats[i] times."""
        with torch_compat.real_tensors():
            real = self.value(repeats)
            real = torch.arange(len(real)).repeat_interleave(real)
        fake = torch.empty(len(real), dtype=real.dtype, device=repeats.device)
        self.keep(fake, real)
        return fake

    def _follow(self, func, args, kwargs, out) -> None:
        """Run ``func`` on the values too where every tensor input has one."""
        if not self.values:  # no routing counts yet: the common case, kept cheap
            return
        inputs = tensors_in((args, kwargs))
        if not inputs or any(self.value(t) is None for t in inputs):
            return
        real_args, real_kwargs = _swapped((args, kwargs), self.value)
        with torch_compat.real_tensors():
            real_out = func(*real_args, **real_kwargs)
        for fake, real in zip(tensors_in(out), tensors_in(real_out)):
            self.keep(fake, real)


def read_argv(argv: list[str], world_size: int) -> tuple[list[str], int, bool]:
    """(training's arguments, the rank to trace, --json) from the dry run's command line;
    ConfigError for a rank outside the world."""
    rest, rank, i = [], 0, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--dry-run-rank"):
            value = arg.partition("=")[2] if "=" in arg else (
                argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit() or int(value) >= world_size:
                raise ConfigError(f"--dry-run-rank={value!r}: must be a rank of the world, "
                                  f"0..{world_size - 1} (WORLD_SIZE={world_size})")
            rank = int(value)
            continue
        if arg not in FLAGS:
            rest.append(arg)
        i += 1
    return rest, rank, "--json" in argv


def dry_config(cfg: JobConfig, folder: str) -> list[str]:
    """Make ``cfg`` a dry run's: nothing written, nothing loaded, no compile; returns what
    it leaves out, one line each."""
    skipped = []
    if cfg.compile.enable:
        cfg.compile.enable = False
        skipped.append("compile: the memory tracker cannot see inside compiled code; "
                       "traced eager")
    if cfg.data.document_mask is not False and cfg.model.attention != "flex":
        cfg.data.document_mask = False
        skipped.append("documents: SDPA attends each document on its own, and where they "
                       "start is data, which fake tensors lack; traced as causal attention, "
                       "which holds a little less (the pieces of each document are joined)")
    cfg.checkpoint.enable = False
    cfg.validation.enable = False  # the traced step is training's; no held-out data needed
    cfg.checkpoint.initial_load_path = ""  # fake weights: nothing to load them into
    cfg.metrics.memory_breakdown = cfg.metrics.comm_stats = False  # the dry run's own
    cfg.metrics.enable_tensorboard = False
    cfg.metrics.step_anatomy = False  # it times by storage, which a fake tensor has not
    cfg.job.dump_folder = folder
    cfg.job.device = "cpu"
    return skipped


def planned(cfg: JobConfig, world_size: int) -> dict:
    """The planner's --json object for the job on the CPU profile."""
    cluster = load_cluster("cpu")
    with contextlib.redirect_stdout(None):
        layout = layout_of(cfg, load_model(cfg), world_size, cluster.device)
    return predict(layout, cluster).to_json()


@contextlib.contextmanager
def faked(mode):
    """``mode`` (a fake tensor mode) with the values MoE routing reads (``_Values``), and
    DTensor's shape inference kept out of the memory tracker."""
    with mode, _Values(), torch_compat.sharding_meta_apart():
        yield


def _fake_build(mode):
    """plan -> model parts: the passes on meta outside the fake mode (DeviceMesh's
    coordinates are real tensors), then fake weights, never drawn (their values do not
    matter, and CPU's draw would build the whole model once more to slice it)."""
    def build(plan: Plan):
        parts = parallelized(plan)
        with faked(mode):
            for part in parts:
                ties = tied_groups(part)
                part.to_empty(device=plan.device)
                retie(part, ties)
            for converter in plan.converters:
                converter.built(parts)
        for converter in plan.converters:  # e.g. QLoRA quantizes the (fake) weights
            converter.weights_loaded = _inside(mode, converter.weights_loaded)
        return parts
    return build


def _inside(mode, method):
    """``method`` run in the fake mode (the trainer calls it outside)."""
    def run(*args, **kwargs):
        with faked(mode):
            return method(*args, **kwargs)
    return run


def _step(trainer: Trainer, counter: CommCounter) -> None:
    """The trainer's step: the microbatches' forward and backward, the clip, the update."""
    plan = trainer.plan
    with trainer.phase("data"):
        batches = [trainer.train_data.next_batch() for _ in range(plan.accum_steps)]
    trainer.run_batch = _middle_once(trainer.run_batch, counter, plan.accum_steps)
    trainer.forward_backward(batches)
    with trainer.phase("optimizer"):
        clip_grad_norm_(trainer.params, plan.cfg.training.max_norm, trainer.pp_group)
        trainer.optimizer_step()
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)


def _middle_once(run_batch, counter: CommCounter, microbatches: int):
    """``run_batch`` for a step of ``microbatches``. The middle ones (after the first,
    which makes the gradients, and before the last, which syncs them) are the same code
    on the same shapes: the second runs, and each one after it counts its collectives
    again and gives its loss. Every microbatch's batch is held, as in training."""
    calls: list = []
    second: dict = {}

    def run(*args, **kwargs):
        calls.append(None)
        if len(calls) == 1 or len(calls) == microbatches > 2:
            return run_batch(*args, **kwargs)
        if not second:
            before = {key: list(entry) for key, entry in counter.calls.items()}
            out = run_batch(*args, **kwargs)
            second["delta"] = {key: [now - then for now, then in
                                     zip(entry, before.get(key, [0] * len(entry)))]
                               for key, entry in counter.calls.items()}
            second["like"] = out.shape, out.dtype, out.device  # not the tensor: it goes
            return out
        for key, delta in second["delta"].items():
            entry = counter.calls[key]
            entry[:] = [now + more for now, more in zip(entry, delta)]
        shape, dtype, device = second["like"]
        return torch.zeros(shape, dtype=dtype, device=device)
    return run


def _warm(trainer: Trainer) -> None:
    """An optimizer step on zero gradients: the optimizer state every later step finds."""
    for p in trainer.params:
        p.grad = torch.zeros_like(p)
    trainer.optimizer_step()
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)


def traced_step(trainer: Trainer, mode) -> tuple[dict, dict]:
    """A training step of ``trainer`` on fake tensors after an optimizer step on zero
    gradients (the state every later step finds): its peak by category (bytes) and its
    collectives."""
    plan = trainer.plan
    meter = MemoryMeter(plan.device, trainer.parts, trainer.optimizers)
    counter = CommCounter(plan.dims.groups())
    with faked(mode):
        _warm(trainer)
        trainer.observers.observers += [MemoryObserver(meter, None), CommObserver(counter)]
        with trainer.observers.step():
            _step(trainer, counter)
    return meter.last, counter.table()


def trace(cfg: JobConfig, rank: int, world_size: int) -> dict:
    """The job's rank ``rank`` traced: {"memory_gib", "comm"} and what it skipped."""
    with tempfile.TemporaryDirectory() as folder:
        skipped = dry_config(cfg, folder)
        plan = plan_job(cfg, rank, world_size)
        torch_compat.init_fake_process_group(rank, world_size)
        trainer = None
        try:
            plan.dims.build_mesh("cpu", checkpoint_backend=dist.get_backend())
            mode = torch_compat.fake_tensor_mode()
            trainer = Trainer(plan, build=_fake_build(mode))
            memory, comm = traced_step(trainer, mode)
        finally:
            if trainer is not None:
                trainer.close()
            dist.destroy_process_group()
            torch_compat.release_meshes()
    gib = {k: memory.get(k, 0) / GIB for k in CATEGORIES}
    return {"memory_gib": gib, "comm": comm}, skipped


def untraced(error: Exception) -> str:
    """One line for a step that failed under fake tensors: the pass it failed in (the
    innermost frame in one of composer's passes or torch.distributed's packages), and
    torch's words. Nothing was traced; the config's checks and the planner's answer
    stand."""
    frames = traceback.extract_tb(error.__traceback__)
    where = "the step"
    for frame in reversed(frames):
        folder, _, name = frame.filename.replace(os.sep, "/").rpartition("/")
        if folder.endswith("/composer/parallel"):  # the pass's own file
            where = name.removesuffix(".py")
            break
        if "/torch/distributed/" in folder + "/":  # torch's package
            where = folder.rpartition("/")[2]
            break
    said = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (f"{where}: {type(error).__name__}: {said}; this pass cannot run under fake "
            f"tensors, so nothing was traced (the planner's answer stands alone)")


def table(out: dict) -> str:
    """The traced and the planned peak by category, then the collectives, as text."""
    if out["traced"] is None:
        out = {**out, "traced": {"memory_gib": {}, "comm": {}}}
    traced, plan = out["traced"]["memory_gib"], out["planned"]["memory_gib"]
    lines = [f"{'GiB':<12}{'traced':>10}{'planned':>10}"]
    lines += [f"{k:<12}{traced.get(k, 0):>10.3f}{plan.get(k, 0):>10.3f}" for k in CATEGORIES]
    lines.append(f"{'phase/dim/kind':<36}{'traced n':>9}{'planned n':>10}"
                 f"{'traced MiB':>12}{'planned MiB':>12}")
    rows = _comm_rows(out["traced"]["comm"]), _comm_rows(out["planned"]["comm"])
    for key in sorted(set(rows[0]) | set(rows[1])):
        (tn, tb), (pn, pb) = rows[0].get(key, (0, 0)), rows[1].get(key, (0, 0))
        lines.append(f"{'/'.join(key):<36}{tn:>9}{pn:>10}{tb / 2**20:>12.1f}{pb / 2**20:>12.1f}")
    lines += [f"skipped: {line}" for line in out["skipped"]]
    lines.append(f"{out['seconds']:.1f}s")
    return "\n".join(lines)


def _comm_rows(comm: dict) -> dict:
    return {(phase, dim, kind): (c["count"], c["bytes"])
            for phase, dims in comm.items() for dim, kinds in dims.items()
            for kind, c in kinds.items()}


@contextlib.contextmanager
def _ranks_a_node():
    """LOCAL_WORLD_SIZE 8 unless given, for the dry run only (a test's process runs on)."""
    given = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = given or "8"
    try:
        yield
    finally:
        if given is None:
            del os.environ["LOCAL_WORLD_SIZE"]


def run(argv: list[str], world_size: int) -> int:
    """The dry run of the command line ``argv`` (``--dry-run`` among its flags) for a
    world of ``world_size``; prints the report, returns the exit status. ConfigError
    for bad input."""
    start = time.perf_counter()
    rest, rank, as_json = read_argv(argv, world_size)
    cfg, _ = parse_args(rest)
    with _ranks_a_node():
        out = {"planned": planned(cfg, world_size)}
        try:
            out["traced"], out["skipped"] = trace(parse_args(rest)[0], rank, world_size)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 (any failure under fake tensors is reported)
            log.debug("dry run: the step failed under fake tensors", exc_info=e)
            out["traced"], out["skipped"] = None, [untraced(e)]
    out["seconds"] = time.perf_counter() - start
    for line in out["skipped"]:
        log.warning("dry run: skipped %s", line)
    print(json.dumps(out) if as_json else table(out))
    return 0
