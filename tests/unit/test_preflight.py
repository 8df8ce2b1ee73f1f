"""What used to go wrong silently or hours in, refused or said at start: a section
whose feature is off, fewer steps than the checkpoint, a changed config on resume, a
used dump folder, a folder that cannot be written, a checkpoint of another format,
a missing extra, exports only their owner can read."""
from __future__ import annotations

import json
import stat

import pytest

from composer.checkpoint.dcp import FORMAT_FILE
from composer.config import ConfigError
from composer.job.preflight import needs
from composer.testing.harness import read_metrics, run_here

TINY = ["--config", "train_configs/debug_model.toml", "--training.steps", "2",
        "--data.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--validation.enable", "false", "--metrics.enable_tensorboard", "false"]
SAVING = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2"]


def ran(folder, *args):
    """(exit status, rank 0's log) of a one-process run into ``folder``."""
    job = run_here(folder, list(args))
    return job.code, job.log()


def errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error:")]


def test_a_key_of_a_section_that_is_off_is_refused(tmp_path):
    code, log = ran(tmp_path, *TINY, "--lora.rank", "3")
    assert code == 2
    err = errors(log)
    assert len(err) == 1 and "lora.rank=3" in err[0] and "model.converters" in err[0], err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_steps_against_the_checkpoint_and_a_changed_config_on_resume(tmp_path):
    assert ran(tmp_path, *SAVING)[0] == 0
    code, log = ran(tmp_path, *SAVING, "--training.steps", "1")
    assert code == 2
    err = "".join(errors(log))
    assert "training.steps=1" in err and "step-2" in err and ">= 2" in err
    code, log = ran(tmp_path, *SAVING)  # as many steps as the checkpoint: nothing to do
    assert code == 0 and "already at step 2" in log
    code, log = ran(tmp_path, *SAVING, "--training.steps", "3", "--optimizer.lr", "1e-4")
    assert code == 0
    assert "changed config" in log and "optimizer.lr" in log and "training.steps 2 -> 3" in log
    resumes = json.loads((tmp_path / "run.json").read_text())["resumes"]
    assert resumes[0]["changed"] == {}
    assert resumes[-1]["changed"]["training.steps"] == [2, 3]
    assert resumes[-1]["changed"]["optimizer.lr"][1] == 1e-4
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_a_used_dump_folder_is_refused_unless_overwrite(tmp_path):
    board = [a for a in TINY if a not in ("--metrics.enable_tensorboard", "false")]
    assert ran(tmp_path, *board)[0] == 0
    code, log = ran(tmp_path, *board)
    assert code == 2
    err = errors(log)
    assert len(err) == 1 and "job.overwrite" in err[0] and "job.dump_folder" in err[0], err
    assert ran(tmp_path, *board, "--training.steps", "1", "--job.overwrite", "true")[0] == 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]  # the old rows are gone
    assert len(list((tmp_path / "tb").iterdir())) == 1  # one run's events


def test_a_checkpoint_folder_that_is_a_file_exits_5_at_start(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "checkpoint").write_text("not a folder")
    code, log = ran(tmp_path, *SAVING)
    assert code == 5
    err = errors(log)
    assert len(err) == 1 and "checkpoint.folder" in err[0] and "is a file" in err[0], err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_checkpoint_of_another_format_is_one_line_naming_both(tmp_path):
    assert ran(tmp_path, *SAVING)[0] == 0
    step = tmp_path / "checkpoint" / "step-2"
    assert json.loads((step / FORMAT_FILE).read_text()) == {"format": 1}
    (step / FORMAT_FILE).write_text(json.dumps({"format": 99}))
    code, log = ran(tmp_path, *SAVING, "--training.steps", "4")
    assert code == 2
    err = errors(log)
    assert len(err) == 1 and "format 99" in err[0] and "format 1" in err[0], err


def test_exports_are_readable_by_others(tmp_path):
    assert ran(tmp_path, *TINY, "--checkpoint.last_save_in_hf", "true")[0] == 0
    files = list((tmp_path / "checkpoint" / "step-2-hf").iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_a_missing_extra_names_it():
    with pytest.raises(ConfigError, match=r"checkpoint.last_save_in_hf: needs no_such_mod.*"
                                          r"pip install 'composer-parallel\[hf\]'"):
        needs("checkpoint.last_save_in_hf", "hf", "no_such_mod")
