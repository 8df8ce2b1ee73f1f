"""Checks at start for what would otherwise go wrong silently, or hours into a run.

Each raises a ConfigError with one line naming the key, the value and what is
allowed (exit status 2), except a path the run cannot write: a ``PathError``,
exit status 5 (``composer.faults.diagnosis.FOLDER``), as a save into it would be later.
``plan_job`` calls them before any process group exists and before any file of
the run is opened.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from composer.checkpoint.dcp import STEP
from composer.config import ConfigError, JobConfig
from composer.converters.base import CONVERTERS
from composer.faults.diagnosis import FOLDER

log = logging.getLogger("composer")

# what a dump folder holds of a run: its record, rows, config and TensorBoard events
RUN_FILES = ("run.json", "metrics.jsonl", "config.toml")


class PathError(ConfigError):
    """A path the run will write is not a writable folder (exit status 5)."""

    code = FOLDER


def needs(key: str, extra: str, *modules: str) -> None:
    """ConfigError naming ``key`` and the extra to install when a module it needs is
    missing (checked before training, not at the first use hours in)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"{key}: needs {', '.join(missing)}, which is not installed: "
                          f"pip install 'composer-parallel[{extra}]'")


def _changed(section: Any) -> list[tuple[str, Any]]:
    """(key, value) of ``section``'s fields that differ from its class's defaults."""
    default = type(section)()
    return [(f.name, getattr(section, f.name)) for f in dataclasses.fields(section)
            if getattr(section, f.name) != getattr(default, f.name)]


def _why_off(cfg: JobConfig, name: str, section: Any) -> str | None:
    """Why component section ``name`` is not read by this job, or None when it is: a
    converter's section is read when one of the converters that registered it is
    listed; another section says so itself (``off(cfg)``)."""
    users = [n for n, cls in CONVERTERS.items() if cls.section and cls.section[0] == name]
    if users:
        if set(users) & set(cfg.model.converters):
            return None
        return f"model.converters has none of {', '.join(users)}"
    off = getattr(section, "off", None)
    return off(cfg) if off is not None else None


def check_sections_in_use(cfg: JobConfig) -> None:
    """A key of a section whose feature is off, set to other than its default, is a
    mistake (``--lora.rank 8`` without the lora converter would train the full model)."""
    for name, section in cfg.components.items():
        changed = _changed(section)
        why = _why_off(cfg, name, section) if changed else None
        if why:
            key, value = changed[0]
            raise ConfigError(f"{name}.{key}={value!r}: [{name}] is not used by this job "
                              f"({why}); turn the feature on or leave the section out")


def step_of(path: Path) -> int:
    return int(STEP.match(path.name).group(1))


def check_steps(cfg: JobConfig, resume: Path | None) -> None:
    """Fewer steps than the checkpoint the run resumes from would do nothing."""
    if resume is not None and step_of(resume) > cfg.training.steps:
        raise ConfigError(f"training.steps={cfg.training.steps}: the run resumes from {resume}, "
                          f"past it; allowed: >= {step_of(resume)} (or another "
                          f"job.dump_folder, or checkpoint.enable = false)")


def _records(cfg: JobConfig) -> list[Path]:
    folder = Path(cfg.job.dump_folder)
    return [folder / name for name in (*RUN_FILES, "tb") if (folder / name).exists()]


def check_dump_folder(cfg: JobConfig, resume: Path | None) -> None:
    """A dump folder that holds another run, when this one does not resume it, is
    refused unless ``job.overwrite`` (then ``clear_records`` removes that run's)."""
    found = _records(cfg)
    if resume is None and found and not cfg.job.overwrite:
        raise ConfigError(f"job.dump_folder={cfg.job.dump_folder!r}: holds another run "
                          f"({found[0].name}) and this one does not resume it; allowed: a new "
                          f"folder, or job.overwrite = true to replace that run's records")


def clear_records(cfg: JobConfig, resume: Path | None) -> None:
    """Rank 0, as training starts: an overwritten run's records go, so the rows, the
    config and the TensorBoard events in the folder are this run's alone."""
    found = _records(cfg) if resume is None and cfg.job.overwrite else []
    if found:
        log.info("job.overwrite: replacing the records of the run in %s", cfg.job.dump_folder)
    for path in found:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _writable(key: str, path: Path) -> None:
    """``path`` is a folder, or can be made one: its nearest existing ancestor is a
    writable folder."""
    if path.exists() and not path.is_dir():
        raise PathError(f"{key}: {path} is a file; allowed: a folder (or a path not there yet)")
    here = path
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        raise PathError(f"{key}: {here} is a file, so {path} cannot be made; allowed: a folder")
    if not os.access(here, os.W_OK | os.X_OK):
        raise PathError(f"{key}: {here} is not writable, so {path} cannot be written")


def check_paths(cfg: JobConfig, exports: bool) -> None:
    """Every folder the run will write (``exports``: Hugging Face or adapter exports go
    to the checkpoint folder), checked before it writes the first."""
    dump = Path(cfg.job.dump_folder)
    _writable("job.dump_folder", dump)
    if cfg.checkpoint.enable or exports:
        _writable("checkpoint.folder", dump / cfg.checkpoint.folder)
    if cfg.profiling.enable:
        _writable("profiling.folder", dump / cfg.profiling.folder)
    if cfg.metrics.enable_tensorboard:
        _writable("metrics.enable_tensorboard", dump / "tb")


def check_memory_tracker(cfg: JobConfig, accum: int = 1) -> None:
    """What torch's MemTracker (``metrics.memory_breakdown`` on CPU) cannot follow
    (``accum``: the accumulation steps, once known)."""
    if cfg.compile.enable:
        raise ConfigError("metrics.memory_breakdown=true with compile.enable=true on CPU: the "
                          "memory tracker cannot see inside compiled code; allowed: one of them")
    if cfg.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError("metrics.memory_breakdown=true with parallelism.pipeline_parallel_degree="
                          f"{cfg.parallelism.pipeline_parallel_degree} on CPU: the memory "
                          "tracker's gradient hooks break the pipeline stages' backward; "
                          "allowed: one of them")
    if accum > 1:
        raise ConfigError(f"metrics.memory_breakdown=true with {accum} accumulation steps on CPU: "
                          f"the memory tracker follows one forward per step; allowed: "
                          f"training.global_batch_size = local_batch_size x data-parallel degree")


def check_profiling(cfg: JobConfig) -> None:
    p = cfg.profiling
    last = p.start_step + p.steps - 1
    if p.enable and last > cfg.training.steps:
        raise ConfigError(f"profiling.start_step={p.start_step} with profiling.steps={p.steps}: "
                          f"the window ends at step {last}, past training.steps="
                          f"{cfg.training.steps}; allowed: start_step + steps - 1 <= "
                          f"{cfg.training.steps}")


def check_trackers(cfg: JobConfig) -> None:
    """The experiment trackers switched on are installed (each is an extra of its own)."""
    for tracker in ("wandb", "mlflow"):
        if getattr(cfg.metrics, tracker):
            needs(f"metrics.{tracker}=true", tracker, tracker)
