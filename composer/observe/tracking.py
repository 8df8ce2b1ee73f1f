"""What the experiment trackers (``wandb_log``, ``mlflow_log``) read of a run: its
resolved config, and what an earlier run in the same folder recorded in ``run.json``."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from composer.config import JobConfig, sections


def config_of(cfg: JobConfig) -> dict[str, dict]:
    """The resolved config, section by section (config.toml's content)."""
    return {name: dataclasses.asdict(section) for name, section in sections(cfg).items()}


def recorded(folder: Path, key: str) -> dict:
    """What ``run.json`` in ``folder`` holds under ``key`` (empty: nothing)."""
    run = folder / "run.json"
    return (json.loads(run.read_text()).get(key) or {}) if run.is_file() else {}


def earlier_run(plan, key: str) -> dict:
    """A resumed run's tracker run, as the run it resumes recorded it under ``key``."""
    return recorded(Path(plan.cfg.job.dump_folder), key) if plan.resume is not None else {}
