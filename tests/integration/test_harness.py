"""The harness itself: a hang fails within its timeout and takes its whole
process group with it; in a shared launch a failing job stops no other."""
from __future__ import annotations

import time

import pytest

from composer.testing.harness import PARITY, Run, alive, launch, run_jobs

SLEEPER = """import os, sys, time
open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.slow
def test_a_hang_fails_in_its_timeout_and_kills_every_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    start = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 10s"):
        launch([str(tmp_path)], nproc=2, timeout=10, program=str(script))
    assert time.monotonic() - start < 25
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert not any(alive(pid) for pid in pids)


def test_a_failing_job_stops_no_other_in_its_launch(tmp_path):
    one = [*PARITY, "--training.steps", "1", "--validation.enable", "false"]
    jobs = run_jobs({"before": Run(1, one),
                     "bad": Run(1, [*one, "--data.seq_len", "100000"]),
                     "after": Run(1, one)}, tmp_path)
    assert (jobs["before"].code, jobs["bad"].code, jobs["after"].code) == (0, 2, 0)
    assert "data.seq_len=100000" in jobs["bad"].log()
    assert jobs["after"].rows()[0]["loss"] == jobs["before"].rows()[0]["loss"]
    with pytest.raises(AssertionError, match="job bad: exit 2"):
        jobs["bad"].rows()
