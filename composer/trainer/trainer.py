"""The trainer: a planned job's model, optimizers, data and observers, and its loop.

    torchrun --nproc_per_node=4 -m composer.train --config train_configs/debug_model.toml

runs ``composer.cli`` (arguments, logging, the planner's prediction, exit
statuses); this module knows nothing of them. ``build.py`` is the one place that knows
the build order, ``composer.parallel.parallelize`` the pass order.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch

from composer.faults.diagnosis import Doing, SigtermStop, Terminated
from composer.faults.recovery import Recovery
from composer.faults.replicas import OneGroup, make_replicas
from composer.job.plan import Plan
from composer.observe.base import Observers, RunView, StepInfo, make_observers
from composer.observe.record import record_of
from composer.parallel.data import accumulate
from composer.parallel.materialize import full_tensor
from composer.parallel.pipeline import build_pipeline
from composer.trainer.batches import build_data
from composer.trainer.build import build_model
from composer.trainer.loss import ScaledLoss, all_reduce_sum, autocast, gather_small
from composer.trainer.objective import make_objective
from composer.trainer.optim import build_optimizers, clip_grad_norm_, set_schedule_step
from composer.trainer.saves import Saves, checkpointer_for, export_at_end, load_initial
from composer.trainer.validation import due

log = logging.getLogger("composer")


class Trainer:
    """Owns the model, optimizer, data, observers and metrics of one run."""

    def __init__(self, plan: Plan, doing: Doing | None = None, build=build_model,
                 stops: SigtermStop = SigtermStop()):
        """``doing``: what the run is doing (start-up's phases too), for a fault's diagnosis;
        ``build``: plan -> model parts (the dry run's has fake weights); ``stops``: whether
        SIGTERM ends the run after a step. Whatever the start-up opened is closed again
        when it fails."""
        self.plan, self.step, self.build, self.stops = plan, 0, build, stops
        self.doing = doing or Doing()
        self.observers, self.checkpointer, self.replicas = Observers([]), None, OneGroup()
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        plan, cfg, dims, doing = self.plan, self.plan.cfg, self.plan.dims, self.doing
        doing.phase = "reading data"
        # before anything is written; a batch -> this rank's columns and model arguments
        self.train_data, self.validation, self.local = build_data(
            cfg, plan.tokenizer, dims, plan.rank, plan.accum_steps, plan.validation)
        doing.phase = "building the model"
        self.parts = self.build(plan)
        self.params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        self.optimizers, self.schedulers = build_optimizers(self.parts, cfg, dims)
        self.objective = make_objective(plan, self.parts)  # the loss, its normaliser, columns
        self.checkpointer = checkpointer_for(plan, self.parts, self.optimizers)
        self.saves = (Saves(self.checkpointer, doing, cfg.checkpoint.on_save_error)
                      if cfg.checkpoint.enable else None)
        doing.phase = "starting the observers"
        self.observers = make_observers(RunView(
            plan, self.parts, self.optimizers, self.checkpointer, lambda: self.step,
            self.reported, functools.partial(gather_small, device=plan.device), self.sum_all,
            lambda row: self.observers.summary(row)))
        self.pipeline_loss = ScaledLoss(self.objective.loss_sum)
        self.pp_group = dims.mesh("pp").get_group() if dims.pp > 1 else None
        self.pipeline = build_pipeline(  # only real microbatches' forwards are observed ones
            self.parts, plan.pipeline, self.pipeline_loss, plan.device, self.pp_group,
            lambda: self.observers.forward()) if plan.pipeline else None
        # Ranks that share a batch (tp, pp, cp) share its tokens: count each once.
        self.tokens_per_step = (plan.accum_steps * cfg.training.local_batch_size
                                * self.objective.sequences * cfg.data.seq_len
                                / (dims.tp * dims.pp * dims.cp))
        self.autocast = functools.partial(
            autocast, plan.device, plan.dtype, plan.mixed_dtype(cfg.training.mixed_precision_param),
            dims.dp_enabled and cfg.parallelism.zero_stage != 1)
        self.recovery = Recovery(cfg.recovery)
        self.replicas = make_replicas(plan, self.parts, self.optimizers, self.train_state,
                                      self.restore, record_of(plan))
        if plan.initial is not None:  # e.g. a LoRA run resumes its adapters on top of it
            doing.phase = f"loading {plan.initial.name}"
            load_initial(plan, self.parts, self.checkpointer, plan.initial, self.load)
        for converter in plan.converters:
            converter.weights_loaded(self.parts)
        if plan.resume is not None:
            self.load(plan.resume)

    def close(self) -> None:
        try:
            self.replicas.close()
        finally:
            self.observers.close()  # every one, also when one fails

    def train_state(self) -> dict[str, torch.Tensor]:
        """What besides weights and optimizer makes a resumed run continue exactly."""
        return {"step": torch.tensor(self.step),
                "windows_consumed": torch.tensor(self.train_data.windows_consumed),
                "rng": torch.get_rng_state()}

    def load(self, path: Path) -> None:
        """Continue from a checkpoint step: weights, optimizer, step, data, lr, RNG."""
        train = self.train_state()
        self.doing.phase = f"loading {path.name}"
        self.checkpointer.load(path, train)
        self.restore(train)

    def restore(self, train: dict[str, torch.Tensor]) -> None:
        """Continue from ``train``: the step, the data position, lr and RNG."""
        self.step = int(train["step"])
        data, windows = self.train_data, int(train["windows_consumed"])
        data.load_state_dict({**data.state_dict(), "windows_consumed": windows})
        torch.set_rng_state(train["rng"])
        for scheduler in self.schedulers:
            set_schedule_step(scheduler, self.step)
        self.observers.restarted()

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
        model, objective = functools.partial(self.parts[0], inputs, **kwargs), self.objective
        if scale is None:
            with plan.loss_context(), self.autocast():
                reference = objective.reference(model, targets)
                return full_tensor(objective.loss_sum(model(), targets, reference).detach())
        with plan.loss_context():
            with self.autocast(), self.phase("forward"):
                reference = objective.reference(model, targets)  # e.g. DPO's frozen base
                with self.observers.forward():
                    logits = model()
            with self.phase("loss"):
                loss = objective.loss_sum(logits, targets, reference)
            with self.phase("backward"):
                (loss * scale).backward()
        return full_tensor(loss.detach())

    def _run_pipeline(self, inputs: torch.Tensor, targets: torch.Tensor, extra: dict,
                      scale: float | None):
        self.pipeline_loss.scale = 1.0 if scale is None else scale
        phase = self.phase("pipeline") if scale is not None else contextlib.nullcontext()
        with self.plan.loss_context(), self.autocast(), phase:
            losses = self.pipeline.run(inputs, targets, extra, train=scale is not None)
        total = sum(full_tensor(x.detach()).double() for x in losses) / self.pipeline_loss.scale
        return torch.as_tensor(total, dtype=torch.float64, device=self.plan.device)

    def sum_all(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data ranks and the pipeline stages (tp ranks hold copies)."""
        if self.plan.pipeline is not None:
            t = all_reduce_sum(t, self.plan.dims, "pp")
        return self.replicas.sum(all_reduce_sum(t, self.plan.dims))

    def global_loss(self, total: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Sum the stages' (only the last has a loss) and the data ranks' losses."""
        return self.sum_all(total) / tokens

    def forward_backward(self, batches: list) -> tuple[torch.Tensor, int]:
        """Accumulate gradients over the microbatches; returns the global loss and its
        global normaliser (the objective's count: target tokens, or DPO's pairs).

        Each rank's loss is divided by the global count and scaled by the replicas
        (dp x cp), because data and context parallelism average gradients over them:
        the result is the gradient of the global mean loss on every layout."""
        plan, device = self.plan, self.plan.device
        batches = [self.local(batch) for batch in batches]
        tokens = sum(self.objective.count(t) for _, t, _ in batches).to(device)
        tokens = self.replicas.tokens(all_reduce_sum(tokens, plan.dims))
        # a batch of prompts only (fine-tuning) has no target: its gradient is zero
        scale = plan.dims.replicas * self.replicas.count / max(tokens.item(), 1)
        for part in self.parts:
            plan.spec.training.set_loss_scale(part, scale)
        total = torch.zeros((), device=device, dtype=torch.float64)
        for i, (inputs, targets, kwargs) in enumerate(batches):
            if self.pipeline is None:  # a pipeline schedule does this itself
                accumulate(self.parts[0], last=i == len(batches) - 1)
            total += self.run_batch(inputs, targets, kwargs, scale)
        return self.global_loss(total, tokens), int(tokens.item())

    def train_step(self) -> dict | None:
        """One optimizer step; None when a loss spike rolled the run back instead."""
        data = self.train_data
        self.replicas.begin()  # a heal from a peer group moves the step and the data
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
                self.replicas.average(self.params)
                grad_norm = clip_grad_norm_(self.params, self.plan.cfg.training.max_norm,
                                            self.pp_group)
                verdict = (self.recovery.judge(self.step + 1, loss.item(), grad_norm.item())
                           if self.replicas.commit() else "redo")
                if verdict == "step":
                    self.optimizer_step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if verdict == "rollback":
            self.recovery.roll_back(self.checkpointer, start, self.load, self.plan.rank != 0)
        if verdict == "redo":  # a group was lost: the others take the step again
            data.load_state_dict({**data.state_dict(), "windows_consumed": start})
        if verdict in ("rollback", "redo"):
            return None
        for scheduler in self.schedulers:
            scheduler.step()
        self.step += 1
        row = {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr,
               **self.recovery.counts(), **self.objective.row(self.sum_all, tokens),
               **self.replicas.row()}
        row.update(self.observers.row(StepInfo(self.step, tokens, self.tokens_per_step,
                                               self.reported(), self.plan.device)))
        return row

    def optimizer_step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()
        for converter in self.plan.converters:
            converter.after_step(self.parts)

    def evaluate(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's summed loss on this rank, without backward, and its target count."""
        inputs, targets, kwargs = self.local(batch)
        return self.run_batch(inputs, targets, kwargs), self.objective.count(targets).to(
            self.plan.device)

    def validate(self) -> float:
        return self.validation.loss(self.evaluate, lambda total, tokens: self.global_loss(
            total, all_reduce_sum(tokens, self.plan.dims)))

    def reported(self, step: int | None = None) -> bool:
        """Whether the step just taken (or ``step``) is logged (every validation step is)."""
        step = self.step if step is None else step
        return self.validation.due(step) or due(step, self.plan.cfg.metrics.log_freq,
                                                self.plan.cfg.training.steps)

    def fit(self) -> None:
        cfg = self.plan.cfg
        dims = self.plan.dims
        log.info("training %s for %d steps: data parallel x%d, context parallel x%d, tensor "
                 "parallel x%d, pipeline parallel x%d, %d accumulation step(s), %g tokens per "
                 "device per step", self.plan.label, cfg.training.steps, dims.dp, dims.cp, dims.tp,
                 dims.pp, self.plan.accum_steps, self.tokens_per_step)
        if self.step == cfg.training.steps:
            log.info("already at step %d: nothing to train", self.step)
        while self.step < cfg.training.steps:
            row = self.train_step()
            if row is None:
                continue
            stopping = self.stops(self.step)  # SIGTERM: save this step, then stop
            if self.saves:
                saving = stopping or due(self.step, cfg.checkpoint.interval, cfg.training.steps)
                self.saves.step_ended(self.step, saving and self.replicas.saves, self.train_state)
                row["save_errors"] = self.saves.errors
            if self.validation.due(self.step) and not stopping:
                self.doing.phase = "validation"
                row["val_loss"] = self.validate()
            if self.reported() or stopping:
                row["epoch"] = self.train_data.epoch
                self.observers.report(self.step, row)
            if stopping:
                if self.saves:
                    self.saves.finish()
                raise Terminated(self.step)
        self.finish()

    def finish(self) -> None:
        """Let a background save complete; export Hugging Face weights if asked."""
        if self.saves:
            self.saves.finish()
        export_at_end(self.plan, self.parts, self.step)

