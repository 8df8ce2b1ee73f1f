"""The run's saves as the trainer makes them: one every interval, the end of a
background one, and what a failed save does (``checkpoint.on_save_error``).

With "continue", a save that fails for lack of space or of a writable folder is
logged and counted and training goes on (every rank sees DCP's failure, so all
go on together); the next interval tries again, and the run's last line names
a last save that never succeeded. Any other failure, or any with "stop", is
raised for ``composer.cli.run`` to diagnose. Also how a run's checkpointer is made,
its starting weights loaded, and its Hugging Face export written at the end (``plan``
there is the job's ``composer.job.plan.Plan``, which sits above this folder).
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from composer.checkpoint.dcp import Checkpointer, everything, last_complete
from composer.checkpoint.hf import adapter_of, export_parts, load_hf_parts
from composer.converters.base import added_keys, export_key, saved_keys
from composer.data.tokenizer import export_files
from composer.faults.diagnosis import SAVE_FAULTS, Doing, diagnose

log = logging.getLogger(__name__)


def checkpointer_for(plan: Any, parts: list[nn.Module], optimizers: list) -> Checkpointer | None:
    """The run's checkpointer (None when it neither saves nor starts from a step),
    holding the keys the converters say a step holds."""
    c = plan.cfg.checkpoint
    if not (c.enable or c.initial_load_path):
        return None
    group = plan.dims.checkpoint_group() if dist.is_initialized() else None
    return Checkpointer(Path(plan.cfg.job.dump_folder) / c.folder, parts, optimizers, group,
                        c.keep_latest_k, c.async_mode == "async",
                        saved_keys(plan.converters) or everything)


def load_initial(plan: Any, parts: list[nn.Module], checkpointer: Checkpointer | None,
                 path: Path, resume: Callable[[Path], None]) -> None:
    """The starting weights from ``path``: a Hugging Face folder or a DCP step
    (its model only, or the whole run through ``resume``), without the keys a
    converter adds."""
    added = added_keys(plan.converters)
    if (path / "config.json").is_file():
        load_hf_parts(parts, path, plan.spec, plan.args, added)
    elif plan.cfg.checkpoint.initial_load_model_only:
        checkpointer.load(path, {}, model_only=True, keys=lambda k: not added(k))
    else:
        resume(path)


def export_at_end(plan: Any, parts: list[nn.Module], step: int) -> None:
    """Export Hugging Face weights if a key asks for it (as the converters say the
    weights are, e.g. LoRA folded in), and what each converter exports beside them
    (LoRA's PEFT folder); each carries the tokenizer's files."""
    c = plan.cfg.checkpoint
    folder = Path(plan.cfg.job.dump_folder) / c.folder
    dtype, write = getattr(torch, c.export_dtype), plan.rank == 0
    with tempfile.TemporaryDirectory() as scratch:  # the tokenizer's files, as trained
        files = export_files(plan.tokenizer, Path(scratch)) if write else []
        if export_key(plan.cfg, plan.converters) is not None:
            export_parts(parts, plan.converters, folder / f"step-{step}-hf", plan.spec,
                         plan.args, dtype, write=write, files=files)
            log.info("exported Hugging Face weights to %s", folder / f"step-{step}-hf")
        for converter in plan.converters:
            adapter = adapter_of(plan.spec, plan.args) if plan.spec.adapters.hf_adapter else None
            out = converter.checkpoint.export_extra(parts, folder, step, adapter, dtype, write,
                                                    files)
            if out is not None:
                log.info("exported %s", out)


class Saves:
    def __init__(self, checkpointer: Checkpointer, doing: Doing, on_save_error: str):
        self.checkpointer, self.doing, self.on_save_error = checkpointer, doing, on_save_error
        self.errors = 0               # failed saves
        self.unsaved: int | None = None  # the last failed save's step, if none succeeded since

    def step_ended(self, step: int, due: bool, train_state: Callable[[], dict[str, torch.Tensor]]
                   ) -> None:
        """After step ``step``: commit a finished background save; when ``due``, save
        (a background save still running ends first, as its own step's save)."""
        self.run(self.checkpointer.wait if due else self.checkpointer.poll)
        if due:
            self.run(lambda: self.checkpointer.save(step, train_state()), step)

    def run(self, action: Callable[[], None], step: int | None = None) -> None:
        """Run a checkpoint ``action``: a save of ``step``, or the end of a
        background save (then the step is that save's)."""
        self.doing.phase = "checkpoint"
        self.doing.step = step or self.checkpointer.pending_step or self.doing.step
        try:
            action()
        except (Exception, CheckpointException) as e:
            fault = diagnose(e, self.doing)
            if fault is None or fault.code not in SAVE_FAULTS or self.on_save_error == "stop":
                raise
            self.errors += 1
            self.unsaved = self.doing.step
            log.warning("checkpoint not saved: %s; training goes on "
                        "(checkpoint.on_save_error=continue)", fault.line)
            return
        if self.unsaved is not None and (self.checkpointer.saved_step or 0) > self.unsaved:
            self.unsaved = None

    def finish(self) -> None:
        """Let a background save end; say so if the run's last save never succeeded."""
        self.run(self.checkpointer.wait)
        if self.unsaved is not None:
            log.warning("the run ends without its last save (step %d, %d failed save(s) in "
                        "all); the newest complete checkpoint is %s", self.unsaved, self.errors,
                        last_complete(self.doing.folder))
