"""What a run prints: short lines, a progress bar on a terminal, an end-of-run summary,
and no third-party line in a run that uses float8 (torchao)."""
from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import torch

from composer.observe.metrics import MetricsLogger
from composer.testing.harness import ROOT, launch_env, run_here

TINY = ["--config", "train_configs/debug_model.toml", "--training.steps", "4",
        "--data.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--validation.freq", "2", "--metrics.enable_tensorboard", "false"]
PREFIX = re.compile(r"^\[rank0\] \d\d:\d\d:\d\d ")


def test_lines_are_short_and_the_run_ends_with_a_summary(tmp_path):
    job = run_here(tmp_path, [*TINY, "--checkpoint.enable", "true"])
    assert job.code == 0, job.log()
    lines = [line for line in job.log().splitlines() if PREFIX.match(line)]
    steps = [line for line in lines if " step " in line and "/4 " in line]
    assert len(steps) == 4 and all(len(line) <= 120 for line in steps), steps
    done = next(i for i, line in enumerate(lines) if " done: 4 steps, 256 tokens a device" in line)
    assert "loss" in lines[done] and "(best " in lines[done] and "at step 4)" in lines[done]
    assert lines[done + 1].endswith(f"metrics: {tmp_path / 'metrics.jsonl'}")
    assert lines[done + 2].endswith(f"checkpoints: {tmp_path / 'checkpoint'}")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_progress_bar(tmp_path, monkeypatch, caplog):
    """Where stdout is a terminal, steps redraw one line; a validation step stays a line."""
    caplog.set_level(logging.INFO, logger="composer")
    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    logger = MetricsLogger(str(tmp_path), True, False, 4, 0.0, None, torch.device("cpu"))
    for step in range(1, 5):
        logger.report(step, {"loss": 5.0 - step, "tokens_per_second": 1000.0,
                             "step_time_s": 0.5, **({"val_loss": 2.5} if step == 2 else {})})
    logger.close()
    drawn = screen.getvalue()
    assert "\rstep 1/4 [######" in drawn and "\rstep 4/4 [" + "#" * 24 + "] loss 1.0000" in drawn
    assert "1,000 tok/s  eta 0:00:02" in drawn and drawn.endswith("\n")
    logged = [r.getMessage() for r in caplog.records]
    assert [m for m in logged if m.startswith("step ")] == [
        "step 2/4  loss 3.0000  val 2.5000  1,000 tok/s  eta 0:00:01"]
    assert logged[-2].startswith("done: 4 steps") and "best 2.5000 at step 2" in logged[-2]


def test_no_third_party_line_reaches_the_console(tmp_path):
    """float8 imports torchao (a line per kernel library it cannot load here, a pytree
    deprecation warning), the planner imports its int-matmul kernels (no triton here):
    every line printed is composer's."""
    train = ["composer.train", *TINY, "--job.dump_folder", str(tmp_path), "--model.converters",
             "float8", "--training.steps", "1"]
    plan = ["composer.planner", "--config", "llama3_8b"]
    planned = re.compile(r"^(llama3/8B|  |memory|comm|step|tok|warn)")  # its report's lines
    for command, ours in ((train, PREFIX), (plan, planned)):
        out = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True,
                             text=True, timeout=300, env=launch_env())
        assert out.returncode == 0, out.stderr[-3000:]
        lines = (out.stdout + out.stderr).splitlines()
        assert lines and all(ours.match(line) for line in lines), lines


QUIET_PROBE = """
import logging, tempfile
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s|%(name)s|%(message)s")
import composer
logging.getLogger("composer").setLevel(logging.DEBUG)
import torchao.float8, torchao.kernel.intmm
import torch, torch.distributed.checkpoint as dcp
with tempfile.TemporaryDirectory() as folder:
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=folder)
"""


def test_every_line_the_console_is_spared_still_occurs():
    """Each known third-party line composer.torch_compat.quiet keeps off the console still
    comes (in the log at debug level): when one no longer does, its filter can go."""
    from composer.torch_compat.quiet import LOGGED, WARNED
    out = subprocess.run([sys.executable, "-c", QUIET_PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=launch_env())
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    for starts in LOGGED.values():
        for start in starts:
            assert any(start in line for line in lines), start
    for pattern in WARNED:
        assert any(re.search(pattern, line) for line in lines if "DEBUG|" in line), pattern
