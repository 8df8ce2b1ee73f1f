"""The entry point: config -> plan -> mesh -> model -> passes -> weights -> loop.

    torchrun --nproc_per_node=4 -m composer.train --config train_configs/debug_model.toml

Everything that can be wrong with the input is found in ``plan_job``, before any
process group exists, so bad input ends with one line and exit status 2 on
every rank instead of a hang. ``composer.parallel.parallelize`` is the one
place that knows the order of the passes.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from composer.batches import BatchCut, build_loaders
from composer.build import build_model
from composer.checkpoint.dcp import Checkpointer, everything, find_resume
from composer.checkpoint.saves import Saves
from composer.config import ConfigError, JobConfig, parse_args, to_toml
from composer.converters.base import added_keys, saved_keys
from composer.data import IGNORE_INDEX
from composer.faults import Doing, announce, diagnose
from composer.loss import ScaledLoss, all_reduce_sum, autocast, local_value, loss_sum
from composer.observe import OBSERVERS, StepInfo
from composer.observe.base import Observers
from composer.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, set_schedule_step
from composer.parallel.pipeline import Pipeline, build_pipeline
from composer.plan import DTYPES, Plan, export_key, plan_job
from composer.planner.predict import planned_peak, validation_report
from composer.recovery import Recovery, RecoveryError

log = logging.getLogger("composer")


class Trainer:
    """Owns the model, optimizer, data, observers and metrics of one run."""

    def __init__(self, plan: Plan):
        self.plan, cfg, dims = plan, plan.cfg, plan.dims
        self.train_data, self.val_data = build_loaders(plan)  # before anything is written
        self.parts = build_model(plan)
        self.params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        # one optimizer per model part, so each saves its state under its part's FQNs
        self.optimizers = [build_optimizer([p for p in part.parameters() if p.requires_grad],
                                           cfg.optimizer, dims, cfg.parallelism.zero_stage)
                           for part in self.parts]
        self.schedulers = [build_lr_scheduler(o, cfg.lr_scheduler, cfg.training.steps)
                           for o in self.optimizers]
        self.loss_sum = (torch.compile(loss_sum, backend=cfg.compile.backend)
                         if cfg.compile.enable and cfg.compile.loss else loss_sum)
        self.observers = Observers([o for make in OBSERVERS if (o := make(self)) is not None])
        self.pipeline_loss = ScaledLoss(self.loss_sum)
        self.pipeline = self._pipeline() if plan.pipeline else None
        self.pp_group = dims.mesh("pp").get_group() if dims.pp > 1 else None
        self.val_start = self.val_data.state_dict() if self.val_data else None
        # Ranks that share a batch (tp, pp, cp) share its tokens: count each once.
        self.tokens_per_step = (plan.accum_steps * cfg.training.local_batch_size
                                * cfg.data.seq_len / (dims.tp * dims.pp * dims.cp))
        self.local = BatchCut(plan)  # a batch -> this rank's columns and model arguments
        self.step = 0
        self.doing = Doing(folder=Path(cfg.job.dump_folder) / cfg.checkpoint.folder,
                           timeout_s=cfg.job.collective_timeout_s,
                           groups=dims.groups() if dist.is_initialized() else None,
                           estimate=functools.partial(planned_peak, cfg, dims.world_size,
                                                      plan.device))
        self.checkpointer = self._checkpointer()
        self.saves = (Saves(self.checkpointer, self.doing, cfg.checkpoint.on_save_error)
                      if cfg.checkpoint.enable else None)
        self.recovery = Recovery(cfg.recovery)
        if plan.initial is not None:  # e.g. a LoRA run resumes its adapters on top of it
            self._load_initial(plan.initial)
        for converter in plan.converters:
            converter.weights_loaded(self.parts)
        if plan.resume is not None:
            self.load(plan.resume)

    def _checkpointer(self) -> Checkpointer | None:
        c = self.plan.cfg.checkpoint
        if not (c.enable or c.initial_load_path):
            return None
        group = self.plan.dims.checkpoint_group() if dist.is_initialized() else None
        return Checkpointer(Path(self.plan.cfg.job.dump_folder) / c.folder, self.parts,
                            self.optimizers, group, c.keep_latest_k, c.async_mode == "async",
                            saved_keys(self.plan.converters) or everything)

    def train_state(self) -> dict[str, torch.Tensor]:
        """What besides weights and optimizer makes a resumed run continue exactly."""
        return {"step": torch.tensor(self.step),
                "windows_consumed": torch.tensor(self.train_data.windows_consumed),
                "rng": torch.get_rng_state()}

    def load(self, path: Path) -> None:
        """Continue from a checkpoint step: weights, optimizer, step, data, lr, RNG."""
        train = self.train_state()
        self.checkpointer.load(path, train)
        self.step = int(train["step"])
        data = self.train_data
        data.load_state_dict({**data.state_dict(), "windows_consumed": int(train["windows_consumed"])})
        torch.set_rng_state(train["rng"])
        for scheduler in self.schedulers:
            set_schedule_step(scheduler, self.step)
        self.observers.restarted()

    def _load_initial(self, path: Path) -> None:
        added = added_keys(self.plan.converters)
        if (path / "config.json").is_file():
            from composer.checkpoint.hf import adapter_of, load_hf_into  # needs safetensors
            for part in self.parts:
                load_hf_into(part, path, adapter_of(self.plan.spec, self.plan.args), skip=added)
            log.info("initial weights loaded from Hugging Face folder %s", path)
            return
        if self.plan.cfg.checkpoint.initial_load_model_only:
            self.checkpointer.load(path, {}, model_only=True, keys=lambda k: not added(k))
        else:
            self.load(path)

    def _pipeline(self) -> Pipeline:
        pipe = self.plan.pipeline
        # torch's schedules also run each stage on shape-inference inputs: only
        # the real microbatches' forwards are the observers' forwards.
        return build_pipeline(self.parts, pipe.ids, len(pipe.stage_units), pipe.schedule,
                              pipe.microbatches, self.pipeline_loss, self.plan.device,
                              self.plan.dims.mesh("pp").get_group(), self.plan.spec.blocks,
                              self.observers.forward)

    @contextlib.contextmanager
    def phase(self, name: str):
        """One phase of a training step, for the observers and for a fault's diagnosis."""
        self.doing.phase = name
        with self.observers.phase(name):
            yield

    def run_batch(self, inputs: torch.Tensor, targets: torch.Tensor, kwargs: dict,
                  scale: float | None = None) -> torch.Tensor:
        """Forward one batch (the model's keyword arguments ``kwargs``), and backward
        ``scale`` x its loss unless ``scale`` is None (evaluation); returns this
        rank's summed loss (zero on pipeline ranks without the last stage)."""
        plan, device = self.plan, self.plan.device
        inputs, targets = inputs.to(device), targets.to(device)
        kwargs = {key: t.to(device) for key, t in kwargs.items()}
        if self.pipeline is not None:
            return self._run_pipeline(inputs, targets, kwargs, scale)
        if scale is None:
            with plan.loss_context(), autocast(plan):
                return local_value(self.loss_sum(self.parts[0](inputs, **kwargs), targets).detach())
        watch = self.observers
        with plan.loss_context():
            with autocast(plan), self.phase("forward"), watch.forward():
                logits = self.parts[0](inputs, **kwargs)
            with self.phase("loss"):
                loss = self.loss_sum(logits, targets)
            with self.phase("backward"):
                (loss * scale).backward()
        return local_value(loss.detach())

    def _run_pipeline(self, inputs: torch.Tensor, targets: torch.Tensor, extra: dict,
                      scale: float | None):
        pipe, losses = self.pipeline, []
        self.pipeline_loss.scale = 1.0 if scale is None else scale
        args = (inputs,) if pipe.has_first else ()
        # keyword arguments reach every stage, cut into the microbatches like the inputs
        kwargs = {"target": targets, "losses": losses, **extra} if pipe.has_last else extra
        run = pipe.schedule.eval if scale is None else pipe.schedule.step
        phase = self.phase("pipeline") if scale is not None else contextlib.nullcontext()
        with self.plan.loss_context(), autocast(self.plan), phase:
            run(*args, **kwargs)
        total = sum(local_value(loss.detach()).double() for loss in losses)
        return torch.as_tensor(total / self.pipeline_loss.scale, dtype=torch.float64,
                               device=self.plan.device)

    def sum_all(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data ranks and the pipeline stages (tp ranks hold copies)."""
        if self.plan.pipeline is not None:
            t = all_reduce_sum(t, self.plan, "pp")
        return all_reduce_sum(t, self.plan)

    def global_loss(self, total: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Sum the stages' (only the last has a loss) and the data ranks' losses."""
        return self.sum_all(total) / tokens

    def forward_backward(self, batches: list) -> tuple[torch.Tensor, int]:
        """Accumulate gradients over the microbatches; returns the global loss and
        the global number of target tokens.

        Each rank's loss is divided by the global target-token count and scaled
        by the replicas (dp x cp), because data and context parallelism average
        gradients over them: the result is the gradient of the global mean loss
        on every layout.
        """
        plan, device = self.plan, self.plan.device
        batches = [self.local(batch) for batch in batches]
        tokens = sum((t != IGNORE_INDEX).sum() for _, t, _ in batches).to(device)
        tokens = all_reduce_sum(tokens, plan)
        # a batch of prompts only (fine-tuning) has no target: its gradient is zero
        scale = plan.dims.replicas / max(tokens.item(), 1)
        for part in self.parts:
            plan.spec.set_loss_scale(part, scale)
        total = torch.zeros((), device=device, dtype=torch.float64)
        for i, (inputs, targets, kwargs) in enumerate(batches):
            if self.pipeline is None and hasattr(self.parts[0], "set_requires_gradient_sync"):
                self.parts[0].set_requires_gradient_sync(i == len(batches) - 1)
            total += self.run_batch(inputs, targets, kwargs, scale)
        return self.global_loss(total, tokens), int(tokens.item())

    def train_step(self) -> dict | None:
        """One optimizer step; None when a loss spike rolled the run back instead."""
        data = self.train_data
        self.doing.step = self.step + 1
        lr = self.schedulers[0].get_last_lr()[0]
        with self.observers.step():
            with self.phase("data"):
                if self.recovery.skip(data.windows_consumed):
                    for _ in range(self.plan.accum_steps):
                        data.next_batch()
                start = data.windows_consumed
                batches = [data.next_batch() for _ in range(self.plan.accum_steps)]
            self.doing.phase = "forward"  # the loss normaliser's all-reduce comes first
            loss, tokens = self.forward_backward(batches)
            with self.phase("optimizer"):
                grad_norm = clip_grad_norm_(self.params, self.plan.cfg.training.max_norm,
                                            self.pp_group)
                loss = self.recovery.inject(self.step + 1, loss)
                verdict = self.recovery.judge(self.step + 1, loss.item(), grad_norm.item())
                if verdict == "step":
                    self.optimizer_step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if verdict == "rollback":
            self.roll_back(start)
            return None
        for scheduler in self.schedulers:
            scheduler.step()
        self.step += 1
        row = {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr,
               **self.recovery.counts()}
        row.update(self.observers.row(StepInfo(self.step, tokens, self.tokens_per_step,
                                               self.reported(), self.plan.device)))
        return row

    def optimizer_step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()
        for converter in self.plan.converters:
            converter.after_step(self.parts)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of the small tensor ``t``."""
        if not dist.is_initialized():
            return [t]
        t = t.to(self.plan.device)
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
        return [o.cpu() for o in out]

    def roll_back(self, bad_batch: int) -> None:
        """Reload the newest checkpoint; the batch that started at ``bad_batch`` is
        skipped when the run gets there again."""
        self.checkpointer.wait()
        path = find_resume(Path(self.plan.cfg.job.dump_folder) / self.plan.cfg.checkpoint.folder,
                           -1, quiet=self.plan.rank != 0)
        if path is None:
            raise RecoveryError(f"loss spike at step {self.step + 1} and no checkpoint to roll "
                                f"back to")
        self.recovery.rolled_back(bad_batch)
        self.load(path)
        log.warning("rolled back to %s; the batch of step %d will be skipped", path,
                    self.recovery.spike_step)

    @torch.no_grad()
    def validate(self) -> float:
        data = self.val_data
        data.load_state_dict(self.val_start)
        total = torch.zeros((), device=self.plan.device, dtype=torch.float64)
        tokens = torch.zeros((), device=self.plan.device, dtype=torch.int64)
        # steps x the global batch, the same sequences on every layout
        for _ in range(self.plan.cfg.validation.steps * self.plan.accum_steps):
            inputs, targets, kwargs = self.local(data.next_batch())
            total += self.run_batch(inputs, targets, kwargs)
            tokens += (targets != IGNORE_INDEX).sum().to(self.plan.device)
        return self.global_loss(total, all_reduce_sum(tokens, self.plan)).item()

    def due(self, freq: int, step: int | None = None) -> bool:
        step = self.step if step is None else step
        return step % freq == 0 or step == self.plan.cfg.training.steps

    def validating(self, step: int | None = None) -> bool:
        return self.val_data is not None and self.due(self.plan.cfg.validation.freq, step)

    def reported(self, step: int | None = None) -> bool:
        """Whether the step just taken (or ``step``) is logged (every validation step is)."""
        return self.validating(step) or self.due(self.plan.cfg.metrics.log_freq, step)

    def fit(self) -> None:
        cfg = self.plan.cfg
        dims = self.plan.dims
        log.info("training %s/%s for %d steps: data parallel x%d, context parallel x%d, tensor "
                 "parallel x%d, pipeline parallel x%d, %d accumulation step(s), %g tokens per "
                 "device per step", cfg.model.name, cfg.model.flavor, cfg.training.steps, dims.dp,
                 dims.cp, dims.tp, dims.pp,
                 self.plan.accum_steps, self.tokens_per_step)
        while self.step < cfg.training.steps:
            row = self.train_step()
            if row is None:
                continue
            if self.saves:
                self.saves.step_ended(self.step, self.due(cfg.checkpoint.interval),
                                      self.train_state)
                row["save_errors"] = self.saves.errors
            if self.validating():
                self.doing.phase = "validation"
                row["val_loss"] = self.validate()
            if self.reported():
                row["epoch"] = self.train_data.epoch
                self.observers.report(self.step, row)
        self.finish()

    def finish(self) -> None:
        """Let a background save complete; export Hugging Face weights if a key
        asks for it (as the converters say the weights are, e.g. LoRA folded in)."""
        plan, c = self.plan, self.plan.cfg.checkpoint
        if self.saves:
            self.saves.finish()
        if export_key(plan.cfg, plan.converters) is None:
            return
        from composer.checkpoint.hf import export_parts  # needs safetensors
        folder = Path(plan.cfg.job.dump_folder) / c.folder / f"step-{self.step}-hf"
        export_parts(self.parts, plan.converters, folder, plan.spec, plan.args,
                     DTYPES[c.export_dtype], write=plan.rank == 0)
        log.info("exported Hugging Face weights to %s", folder)


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt


def setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)


def init_distributed(plan: Plan, world_size: int, store: dist.Store | None = None) -> None:
    """The job's process groups: through torchrun's store, or through ``store``
    (already the job's own) where one launch runs several jobs."""
    if world_size == 1:
        return
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


def run(plan: Plan, world_size: int, store: dist.Store | None = None) -> int:
    """Train the planned job; returns the exit status: 0, 130 when interrupted, 3
    when recovery gave up, a fault's class (composer.faults) with its one line."""
    init_distributed(plan, world_size, store)
    trainer = None
    try:
        trainer = Trainer(plan)
        trainer.fit()
        return 0
    except KeyboardInterrupt:
        log.warning("interrupted at step %d; stopping", trainer.step if trainer else 0)
        return 130
    except ConfigError as e:  # found once the data is read: the same on every rank
        if plan.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except RecoveryError as e:
        if plan.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 3
    except (Exception, CheckpointException) as e:
        fault = diagnose(e, trainer.doing if trainer else Doing(phase="start"))
        if fault is None:
            raise
        announce(plan.rank, fault.line)
        return fault.code
    finally:
        if trainer is not None:
            trainer.observers.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def log_prediction(cfg: JobConfig, world_size: int, device: torch.device) -> None:
    """The planner's prediction for the validated job; one that will not fit warns."""
    try:
        line, warnings = validation_report(cfg, world_size, device)
    except ValueError as e:
        log.info("no prediction: %s", e)
        return
    log.info(line)
    for warning in warnings:
        log.warning(warning)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    setup_logging(rank)
    try:
        cfg, show = parse_args([a for a in argv if a != "--validate"])
        if show:
            print(to_toml(cfg), end="")
            return 0
        plan = plan_job(cfg, rank, world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if "--validate" in argv:
        log.info("config ok for %d rank(s)", world_size)
        if rank == 0 and plan.spec.shape is not None:
            log_prediction(cfg, world_size, plan.device)
        return 0
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    return run(plan, world_size)


def cli() -> None:
    code = main()
    # FSDP's modules hold reference cycles, so the run's sharded tensors, and through
    # them its process groups, live on until a cyclic collection. Left to interpreter
    # teardown, a gloo group's worker threads can be destroyed there and abort the
    # process ("terminate called without an active exception") after a good run.
    gc.collect()
    sys.exit(code)


if __name__ == "__main__":
    cli()
