"""Distributed checkpoints (torch.distributed.checkpoint) that survive crashes and
layout changes.

A step is written to ``step-N.tmp`` and renamed to ``step-N`` by rank 0 once
DCP has finished (its metadata file is written last, after every rank's data),
so a folder named ``step-N`` is always complete. A save that fails removes its
``.tmp`` folder, and a run starting finds and removes those a crash left. Pruning
runs only after that rename, and never touches the newest complete step. Resume
takes the newest complete step whose files are all there at their recorded
sizes; others are skipped with a warning naming them.

What is saved, all keyed by parameter FQN, so any layout can load any other's:
the model (``model.<fqn>``: DTensor shards or plain tensors), the optimizer
(``optimizer.state.<fqn>.<name>``, ``optimizer.param_groups.<fqn>.<key>``:
torch's flattened form, independent of how parameters are grouped), and the
training state as tensors (step, the data position, the RNG state). The lr
schedule is a function of the step. DCP's metadata is a pickle: load
checkpoints from folders you trust only.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

log = logging.getLogger(__name__)

STEP = re.compile(r"^step-(\d+)$")
# The layout of a step's keys (above). A step records it in FORMAT_FILE; one without
# that file was written before the field existed, in format 1.
FORMAT, FORMAT_FILE = 1, "composer.json"


def format_of(path: Path) -> int:
    file = path / FORMAT_FILE
    return json.loads(file.read_text()).get("format", 1) if file.is_file() else 1
OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def problem(path: Path) -> str | None:
    """Why the step folder ``path`` cannot be loaded, or None: its metadata must
    read and every file it names must hold the bytes it records."""
    if not (path / ".metadata").is_file():
        return "it has no .metadata (the save did not finish)"
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # any unreadable metadata means the same: skip this step
        return f"its .metadata does not read ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else -1
        if have < size:
            return f"{name} is {'missing' if have < 0 else f'truncated ({have} of {size} bytes)'}"
    return None


def complete_steps(folder: Path) -> list[tuple[int, Path]]:
    """``step-N`` folders, oldest first (named complete; contents not checked)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP.match(p.name))]
    return sorted(found)


def last_complete(folder: Path | None) -> str:
    """The newest complete step's name, or "none"."""
    steps = complete_steps(folder) if folder is not None else []
    return f"step-{steps[-1][0]}" if steps else "none"


def find_resume(folder: str | Path, load_step: int = -1, quiet: bool = False) -> Path | None:
    """The step folder to resume from: ``load_step`` (-1: the newest usable; None
    when there is none). Skipped folders get one warning line each (unless
    ``quiet``: other ranks); ValueError when ``load_step`` cannot be loaded.

    >>> import tempfile
    >>> from composer import find_resume
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     print(find_resume(folder))
    None
    """
    folder = Path(folder)
    warn = (lambda *a: None) if quiet else log.warning
    for tmp in sorted(folder.glob("step-*.tmp")) if folder.is_dir() else []:
        warn("checkpoint %s is incomplete (a save was interrupted); skipping it", tmp)
    for step, path in reversed(complete_steps(folder)):
        if load_step not in (-1, step):
            continue
        if format_of(path) != FORMAT:
            raise ValueError(f"checkpoint {path} is in checkpoint format {format_of(path)}; "
                             f"this composer reads format {FORMAT}")
        reason = problem(path)
        if reason is None:
            return path
        if load_step == step:
            raise ValueError(f"checkpoint.load_step={load_step}: {path} cannot be loaded: {reason}")
        warn("checkpoint %s is unusable: %s; skipping it", path, reason)
    if load_step != -1:
        raise ValueError(f"checkpoint.load_step={load_step}: no step-{load_step} in {folder}")
    return None


def everything(name: str) -> bool:
    return True


def check_shapes(path: Path, model: nn.Module, label: str,
                 keys: Callable[[str], bool] = everything) -> None:
    """Every parameter and buffer of ``model`` (full shapes, e.g. built on meta)
    that ``keys`` selects must be in the checkpoint with the same shape; names
    the first that is not."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, tensor in model.state_dict().items():
        if not keys(name):
            continue
        entry = saved.get(f"model.{name}")
        if entry is None:
            raise ValueError(f"checkpoint {path}: has no model.{name}, which {label} needs")
        shape = tuple(getattr(entry, "size", ()))
        if shape != tuple(tensor.shape):
            raise ValueError(f"checkpoint {path}: model.{name} has shape {list(shape)}, "
                              f"{label} has {list(tensor.shape)}")


def _model_states(parts: list[nn.Module], keys: Callable[[str], bool]) -> list[dict]:
    return [{k: v for k, v in get_model_state_dict(part).items() if keys(k)} for part in parts]


def _optimizer_states(parts: list[nn.Module], optimizers: list) -> list[dict]:
    return [get_optimizer_state_dict(part, opt, options=OPTIM)
            for part, opt in zip(parts, optimizers)]


def run_state(parts: list[nn.Module], optimizers: list | None, train: dict | None,
              keys: Callable[[str], bool] = everything) -> dict:
    """What a checkpoint step holds, keyed by FQN: ``model`` (the entries ``keys``
    selects), and unless ``optimizers`` is None ``optimizer`` and ``train``. Its tensors
    are this rank's (DTensors where the parts are sharded); ``set_run_state`` puts such
    a dict back."""
    state = {"model": {k: v for sd in _model_states(parts, keys) for k, v in sd.items()}}
    if optimizers is not None:
        state["optimizer"] = {k: v for sd in _optimizer_states(parts, optimizers)
                              for k, v in sd.items()}
        state["train"] = train
    return state


def set_run_state(parts: list[nn.Module], optimizers: list | None, state: dict,
                  keys: Callable[[str], bool] = everything) -> None:
    """Load ``state`` (``run_state``'s form, its values filled in) into the parts and,
    unless ``optimizers`` is None, the optimizers."""
    options = StateDictOptions(strict=keys is everything)
    for part, own in zip(parts, _model_states(parts, keys)):
        set_model_state_dict(part, {k: state["model"][k] for k in own}, options=options)
    if optimizers is not None:
        for part, opt, own in zip(parts, optimizers, _optimizer_states(parts, optimizers)):
            set_optimizer_state_dict(part, opt, {k: state["optimizer"][k] for k in own},
                                     options=OPTIM)


class Checkpointer:
    """Saves and loads this rank's model parts, their optimizers (one per part) and
    the training state as DCP steps ``<folder>/step-N``, which any layout loads:
    every entry is keyed by its parameter's name. ``group``: the processes that
    save together (default: all of them, when a process group exists); the trainer
    gives a gloo group of its own (``ParallelDims.checkpoint_group()``), as
    asynchronous saves run DCP's collectives on a background thread beside
    training's. ``keep_latest_k``: the complete steps kept (0: all). ``keys``: the
    model entries a step holds (LoRA: the adapters only; the base is reloaded from
    its own weights).

    >>> import tempfile
    >>> import torch
    >>> from composer import Checkpointer, find_resume
    >>> def made():
    ...     model = torch.nn.Linear(3, 2)
    ...     return model, torch.optim.AdamW(model.parameters())
    >>> model, optimizer = made()
    >>> model(torch.ones(1, 3)).sum().backward()
    >>> optimizer.step()
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     Checkpointer(folder, [model], [optimizer]).save(1, {"step": torch.tensor(1)})
    ...     again, again_optimizer = made()
    ...     train = {"step": torch.tensor(0)}
    ...     Checkpointer(folder, [again], [again_optimizer]).load(find_resume(folder), train)
    >>> int(train["step"]), torch.equal(again.weight, model.weight)
    (1, True)
    >>> torch.equal(again_optimizer.state[again.weight]["exp_avg"],
    ...             optimizer.state[model.weight]["exp_avg"])
    True
    """

    def __init__(self, folder: str | Path, parts: list[nn.Module], optimizers: list,
                 group=None, keep_latest_k: int = 0, async_mode: bool = False,
                 keys: Callable[[str], bool] = everything):
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        self.folder, self.parts, self.optimizers = Path(folder), parts, optimizers
        self.group, self.keep, self.async_mode = group, keep_latest_k, async_mode
        self.keys = keys
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending = None  # (future, tmp path, final path, step) of an async save
        self.saved_step: int | None = None  # the newest step this run has written whole
        if self.rank == 0:
            for tmp in sorted(self.folder.glob("step-*.tmp")) if self.folder.is_dir() else []:
                log.warning("removing %s: a save interrupted by a crash (it can never "
                            "complete)", tmp)
                shutil.rmtree(tmp, ignore_errors=True)

    def state(self, train: dict[str, torch.Tensor], model_only: bool = False,
              keys: Callable[[str], bool] | None = None) -> dict:
        return run_state(self.parts, None if model_only else self.optimizers,
                         None if model_only else train, keys or self.keys)

    def save(self, step: int, train: dict[str, torch.Tensor]) -> None:
        """Write step ``step`` (asynchronously if so configured)."""
        self.wait()
        final = self.folder / f"step-{step}"
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
        self._barrier()
        state = self.state(train)
        with self._discarded_on_failure(tmp):
            if self.async_mode:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group,
                                        no_dist=self.group is None)
                self.pending = (future, tmp, final, step)
            else:
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.group,
                         no_dist=self.group is None)
                self._commit(tmp, final, step)

    @contextlib.contextmanager
    def _discarded_on_failure(self, tmp: Path):
        """A save that fails leaves no partial step in the way of the next (DCP
        raises on every rank; rank 0 removes the folder). One process saves
        without a process group on purpose: DCP's warning that it assumed so is
        not printed (a fault's line must be the only one)."""
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                yield
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def poll(self) -> None:
        """Commit a finished asynchronous save (call once per step)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    @property
    def pending_step(self) -> int | None:
        """The step an asynchronous save is writing, if one is."""
        return self.pending[3] if self.pending is not None else None

    def wait(self) -> None:
        if self.pending is not None:
            future, tmp, final, step = self.pending
            self.pending = None
            with self._discarded_on_failure(tmp):
                future.result()
                self._commit(tmp, final, step)

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        """DCP writes its metadata after every rank's data: once rank 0's save has
        returned, the step is whole and can take its final name."""
        self.saved_step = step
        if self.rank == 0:
            (tmp / FORMAT_FILE).write_text(json.dumps({"format": FORMAT}) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            log.info("checkpoint saved: %s", final)
            self._prune()

    def _prune(self) -> None:
        if self.keep == 0:
            return
        for _, path in complete_steps(self.folder)[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
            log.info("checkpoint pruned: %s", path)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def load(self, path: Path, train: dict[str, torch.Tensor], model_only: bool = False,
             keys: Callable[[str], bool] | None = None) -> None:
        """Load ``path`` into the parts (and optimizers and ``train``, in place),
        whatever layout wrote it; ``keys``: the model entries to load (default:
        those this checkpointer saves)."""
        keys = keys or self.keys
        state = self.state(train, model_only, keys)
        dcp.load(state, checkpoint_id=str(path), process_group=self.group,
                 no_dist=self.group is None)
        set_run_state(self.parts, None if model_only else self.optimizers, state, keys)
        log.info("checkpoint loaded: %s%s", path, " (model only)" if model_only else "")
