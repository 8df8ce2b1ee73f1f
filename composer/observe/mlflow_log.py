"""``metrics.mlflow``: the run in MLflow (``pip install 'composer-parallel[mlflow]'``).

Rank 0 logs the numbers of every reported row (metrics.jsonl's; nested ones by their
path) as MLflow metrics at the row's step, the resolved config as the MLflow run's params
(``section.key``) and, at the end, ``config.toml`` and the run record ``run.json`` as
artifacts. The experiment is ``job.name``; the tracking store
``metrics.mlflow_tracking_uri``, by default ``sqlite:///<dump folder>/mlflow.db`` with the
artifacts in ``<dump folder>/mlartifacts``. The MLflow run's id is kept in ``run.json``,
so a resumed run goes on in the same run.
"""
from __future__ import annotations

import time
from pathlib import Path

from composer.observe.base import Observer
from composer.observe.record import record_of
from composer.observe.tracking import config_of, earlier_run

PARAMS_PER_BATCH = 100  # the most params MLflow takes in one log_batch


def tracking_uri(cfg) -> str:
    """``metrics.mlflow_tracking_uri``, or the dump folder's own SQLite store."""
    db = Path(cfg.job.dump_folder).resolve() / "mlflow.db"
    return cfg.metrics.mlflow_tracking_uri or f"sqlite:///{db}"


def numbers(row: dict, prefix: str = "") -> dict[str, float]:
    """What MLflow keeps of a row: its numbers (not flags, lists, text or nulls), a nested
    one named by its path (``comm/forward/tp/all_reduce/bytes``)."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


class MlflowLogger(Observer):
    def __init__(self, view):
        from mlflow.tracking import MlflowClient
        cfg = view.cfg
        self.folder, self.steps_done, self.total = Path(cfg.job.dump_folder), view.step, \
            cfg.training.steps
        uri = tracking_uri(cfg)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(uri)
        earlier = earlier_run(view.plan, "mlflow")
        if earlier.get("tracking_uri") == uri:
            self.run_id = earlier["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._start(cfg, uri)
        record_of(view.plan)("mlflow", {"tracking_uri": uri, "run_id": self.run_id})

    def _start(self, cfg, uri: str) -> str:
        """A new MLflow run of experiment ``job.name``, its params the config; its id."""
        from mlflow.entities import Param
        found = self.client.get_experiment_by_name(cfg.job.name)
        artifacts = None if cfg.metrics.mlflow_tracking_uri else str(self.folder.resolve() /
                                                                     "mlartifacts")
        experiment = found.experiment_id if found else \
            self.client.create_experiment(cfg.job.name, artifact_location=artifacts)
        run_id = self.client.create_run(experiment).info.run_id
        params = [Param(f"{name}.{key}", str(value))
                  for name, section in config_of(cfg).items() for key, value in section.items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=params[i:i + PARAMS_PER_BATCH])
        return run_id

    def report(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in numbers(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        """Ends the MLflow run: FINISHED when it reached its last step, else FAILED."""
        for name in ("config.toml", "run.json"):
            if (self.folder / name).is_file():
                self.client.log_artifact(self.run_id, str(self.folder / name))
        done = self.steps_done() >= self.total
        self.client.set_terminated(self.run_id, "FINISHED" if done else "FAILED")


def mlflow_observer(view) -> MlflowLogger | None:
    if not view.cfg.metrics.mlflow or view.plan.rank != 0:
        return None
    return MlflowLogger(view)
