"""docs/learn.md's experiments, each command run at the size the page shows (one launch of
two ranks for the training commands), and what the page tells the reader to look for."""
from __future__ import annotations

import re
import shlex

import pytest

from composer.cli.launch import split
from composer.planner.cli import main as plan
from composer.testing.harness import ROOT, Run, run_jobs

PAGE = ROOT / "docs" / "learn.md"


def commands() -> dict[str, list[str]]:
    """The page's composer-train commands by their dump folder's name: composer's args."""
    text = PAGE.read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        if line.startswith("composer-train --nproc 2 "):
            nproc, _, args = split(shlex.split(line)[1:])
            assert nproc == 2
            out[args[args.index("--job.dump_folder") + 1].split("/")[-1]] = args
    return out


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    c = commands()
    assert sorted(c) == ["learn_ddp", "learn_refused", "learn_resume", "learn_tp2",
                         "learn_zero1", "learn_zero3"]
    # the page's commands as they are, but without the validation pass at their last step
    # (nothing here reads it; it would be most of the launch's time)
    c = {name: [*args, "--validation.enable", "false"] for name, args in c.items()}
    jobs = {name: Run(2, args) for name, args in c.items() if name != "learn_resume"}
    # the interrupted run: stopped by the page's Ctrl-C once step 10 was saved
    jobs["learn_stopped"] = Run(2, [*c["learn_resume"], "--training.steps", "10"],
                                folder="learn_resume")
    jobs["learn_resume"] = Run(2, c["learn_resume"], folder="learn_resume")
    return run_jobs(jobs, tmp_path_factory.mktemp("learn"))


def log(job) -> str:
    return (job.logs / "rank0.log").read_text()


@pytest.mark.slow
def test_each_experiment_prints_what_the_page_says(ran):
    ddp = ran["learn_ddp"]
    assert ddp.rows()[-1]["step"] == 10
    assert "applied DDP over 2 ranks" in log(ddp) and "2 accumulation step(s)" in log(ddp)
    assert "done: 10 steps, 10,240 tokens a device" in log(ddp)
    assert ddp.rows()[-1]["loss"] == pytest.approx(4.77, abs=0.05)  # the page's figure

    zero1, zero3 = (ran[f"learn_zero{z}"].rows()[-1]["memory"][0] for z in (1, 3))
    assert zero3["params"] < zero1["params"] and zero1["optimizer"] == pytest.approx(
        zero3["optimizer"], rel=0.01)
    assert zero1["params"] * 2**30 == pytest.approx(918_656 * 4, rel=0.01)  # the whole model

    tp2 = ran["learn_tp2"]
    assert re.search(r"step 10/10 .* comm \d+%", log(tp2)), log(tp2)

    refused = ran["learn_refused"]
    assert refused.code == 2 and "error: world size 2 is not divisible by pp 1 x " in log(refused)

    resumed = ran["learn_resume"]
    assert "checkpoint loaded: " in log(resumed) and "step-10" in log(resumed)
    assert "resuming with a changed config: training.steps 10 -> 30" in log(resumed)
    assert [r["step"] for r in resumed.rows()] == [10, 20, 30]  # log_freq 10


def test_the_planner_table_puts_ddp_first(capsys):
    assert plan(["--config", "debug_model", "--world-size", "4", "--search", "--top", "5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r" +\d+  ", line)]
    assert len(rows) == 5 and rows[0].split()[1:4] == ["dp4", "zero0", "mbs8"], rows
