"""Weights & Biases and MLflow (``metrics.wandb``, ``metrics.mlflow``): a short run logs
to both, and a run resuming it goes on in the same tracker runs; each is read back with
its library's own reader (W&B's transaction-log inspector, MLflow's client) and compared
with the folder's metrics.jsonl, config.toml and run.json. W&B runs offline by default,
as here: nothing leaves the machine."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from composer.cli.run import run_argv
from composer.config import tomllib
from composer.observe.mlflow_log import numbers
from composer.testing.harness import ROOT, read_metrics

ARGV = ["--config", str(ROOT / "train_configs" / "debug_model.toml"), "--training.steps", "3",
        "--metrics.log_freq", "1", "--validation.enable", "false", "--data.seq_len", "32",
        "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The dump folder of a 3-step run that logged to both trackers, resumed for a 4th."""
    folder = tmp_path_factory.mktemp("tracked") / "run"
    argv = [*ARGV, "--job.dump_folder", str(folder), "--metrics.wandb", "true",
            "--metrics.mlflow", "true", "--checkpoint.enable", "true"]
    with pytest.MonkeyPatch.context() as env:
        for name in ("WANDB_MODE", "WANDB_API_KEY"):  # composer's default: offline
            env.delenv(name, raising=False)
        env.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # were it online: refused at once
        env.setenv("WANDB_CONFIG_DIR", str(tmp_path_factory.mktemp("wandb_config")))
        env.setenv("WANDB_SILENT", "true")
        assert run_argv(argv) == 0
        assert run_argv([*argv, "--training.steps", "4"]) == 0
    return folder


def config_toml(folder: Path) -> dict:
    return tomllib.loads((folder / "config.toml").read_text())


def wandb_records(folder: Path) -> list[list[dict]]:
    """The records of each W&B transaction log in ``folder`` (the W&B run and its
    resumption), oldest first, as ``wandb leet inspect`` reads them."""
    logs = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    outs = [subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
            for log in logs]
    return [[json.loads(line) for line in out.splitlines()] for out in outs]


def test_wandb_has_the_rows_config_and_run_record(run):
    record = json.loads((run / "run.json").read_text())
    first, resumed = wandb_records(run)
    starts = [r["run"] for records in (first, resumed) for r in records if r["type"] == "run"]
    assert [(s["project"], s["run_id"]) for s in starts] == [("debug", record["wandb"]["id"])] * 2
    assert starts[1]["resume"] and all(s["telemetry"]["feature"]["offline"] for s in starts)
    configs = [{k: v for k, v in s["config"]["update"].items() if k != "_wandb"} for s in starts]
    assert configs[0] == config_toml(run)  # the first run's, which the folder keeps
    assert configs[1]["training"]["steps"] == 4  # and the resumed run's
    history = [r["history"] for r in first + resumed if r["type"] == "history"]
    logged = [{"step": h["step"]["num"], **{k: v for k, v in h["item"].items()
                                            if not k.startswith("_")}} for h in history]
    assert logged == read_metrics(run) and [r["step"] for r in logged] == [1, 2, 3, 4]
    saved = {f["path"] for r in resumed if r["type"] == "files" for f in r["files"]["files"]}
    assert {"config.toml", "run.json"} <= saved
    files = Path(record["wandb"]["dir"]) / "files"
    assert (files / "run.json").read_text() == (run / "run.json").read_text()
    assert [r["exit"]["exit_code"] for r in first + resumed if r["type"] == "exit"] == [0, 0]


def test_mlflow_has_the_rows_params_and_run_record(run, tmp_path):
    from mlflow.tracking import MlflowClient
    record = json.loads((run / "run.json").read_text())
    uri = f"sqlite:///{run.resolve() / 'mlflow.db'}"
    assert record["mlflow"]["tracking_uri"] == uri
    client = MlflowClient(uri)
    [found] = client.search_runs([client.get_experiment_by_name("debug").experiment_id])
    run_id = found.info.run_id
    assert run_id == record["mlflow"]["run_id"] and found.info.status == "FINISHED"
    rows = read_metrics(run)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == \
        [(r["step"], r["loss"]) for r in rows] and len(rows) == 4
    latest = {k: v for k, v in rows[-1].items()
              if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert found.data.metrics == latest
    assert found.data.params == {f"{name}.{key}": str(value)
                                 for name, section in config_toml(run).items()
                                 for key, value in section.items()}
    assert found.data.params["training.steps"] == "3"  # the run's, as it began
    assert {a.path for a in client.list_artifacts(run_id)} == {"config.toml", "run.json"}
    copy = client.download_artifacts(run_id, "run.json", str(tmp_path))
    assert json.loads(Path(copy).read_text()) == record
    assert Path(found.info.artifact_uri.removeprefix("file://")).is_relative_to(run.resolve())


def test_mlflow_keeps_a_rows_numbers_nested_ones_by_their_path():
    row = {"loss": 2.5, "step_time_s": 1, "mfu": None, "event": "restarted", "ok": True,
           "moe_tokens_per_expert": [[1, 2]], "comm": {"forward": {"tp": {"all_reduce": {
               "count": 9, "bytes": 8}}}}}
    assert numbers(row) == {"loss": 2.5, "step_time_s": 1.0,
                            "comm/forward/tp/all_reduce/count": 9.0,
                            "comm/forward/tp/all_reduce/bytes": 8.0}


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_not_installed_stops_the_run_before_training(monkeypatch, capsys, tmp_path,
                                                                tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # what importing it finds: nothing
    out = tmp_path / "out"
    code = run_argv([*ARGV, "--job.dump_folder", str(out), f"--metrics.{tracker}", "true"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines == [f"error: metrics.{tracker}=true: needs {tracker}, which is "
                                   f"not installed: pip install 'composer-parallel[{tracker}]'"]
    assert not out.exists()
