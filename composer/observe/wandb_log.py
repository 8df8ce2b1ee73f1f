"""``metrics.wandb``: the run in Weights & Biases (``pip install 'composer-parallel[wandb]'``).

Rank 0 logs every reported row (metrics.jsonl's, at its step), the resolved config as
the W&B run's config and, at the end, ``config.toml`` and the run record ``run.json`` as
files of the W&B run. The W&B project is ``job.name``; its files go to
``<dump folder>/wandb/``. Without WANDB_API_KEY or WANDB_MODE in the environment the run
is offline (nothing leaves the machine; ``wandb sync`` uploads it later). The W&B run's
id is kept in ``run.json``, so a resumed run goes on in the same W&B run.
"""
from __future__ import annotations

import os
from pathlib import Path

from composer.observe.base import Observer
from composer.observe.record import record_of
from composer.observe.tracking import config_of, earlier_run


class WandbLogger(Observer):
    """``last``: the latest step logged. W&B takes only rising steps, so the steps a
    restart retakes keep their first rows there (metrics.jsonl has the retaken ones)."""

    def __init__(self, view):
        import wandb
        cfg = view.cfg
        self.folder, self.steps_done, self.total = Path(cfg.job.dump_folder), view.step, \
            cfg.training.steps
        online = os.environ.keys() & {"WANDB_API_KEY", "WANDB_MODE"}
        earlier = earlier_run(view.plan, "wandb")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.job.name, dir=str(self.folder), config=config_of(cfg),
                              mode=None if online else "offline", id=earlier.get("id"),
                              resume="allow" if earlier else None)
        self.last = 0
        record_of(view.plan)("wandb", {"id": self.run.id, "project": self.run.project,
                                       "dir": str(Path(self.run.dir).parent)})

    def report(self, step: int, row: dict) -> None:
        if step > self.last:
            self.run.log(row, step=step)
            self.last = step

    def close(self) -> None:
        """Ends the W&B run: exit code 0 when it reached its last step, else 1."""
        for name in ("config.toml", "run.json"):
            if (self.folder / name).is_file():
                self.run.save(str(self.folder / name), base_path=str(self.folder), policy="now")
        self.run.finish(exit_code=0 if self.steps_done() >= self.total else 1)


def wandb_observer(view) -> WandbLogger | None:
    if not view.cfg.metrics.wandb or view.plan.rank != 0:
        return None
    return WandbLogger(view)
