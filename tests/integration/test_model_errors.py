"""An exception from inside the model or a pass, which is none of the known faults, ends
each rank with one line: the rank, the phase, the module's FQN, the layout and the
exception's first line, its traceback in the rank's log file (exit 10; 2 for what
building the model refuses). The models: tests/support/failing_models.py."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from composer.faults import diagnosis as faults
from composer.faults.diagnosis import Doing, internal_error
from composer.testing.harness import ROOT, Run, launch_env, run_jobs

QUICK = ["--data.seq_len", "32", "--training.steps", "2", "--training.local_batch_size", "2",
         "--validation.enable", "false", "--metrics.enable_tensorboard", "false"]
FSDP = "dp_shard=2 tp=1 pp=1 cp=1"  # two ranks' default layout


def model(name: str) -> list[str]:
    return ["--model.name", f"tests.support.failing_models:{name}", *QUICK]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every failing model on 2 ranks, in one launch."""
    here = tmp_path_factory.mktemp("model_errors")
    return run_jobs({
        "forward": Run(2, model("in_forward")),
        "backward": Run(2, model("in_backward")),
        "tp_refuses": Run(2, [*model("colwise_norm"), "--parallelism.tensor_parallel_degree", "2"]),
        "init": Run(2, model("in_init")),
        "constructor": Run(2, model("in_constructor")),
        "tuple": Run(2, model("returns_tuple")),
    }, here)


def lines_of(job, code: int, pattern: str) -> list[str]:
    """Each rank's one error line, checked against ``pattern`` (``{rank}``, ``{log}``: the
    rank's log file in the job's dump folder), which also holds the line and its traceback."""
    assert job.code == code, job.log()
    lines = []
    for rank in range(2):
        printed = (job.logs / f"rank{rank}.log").read_text()
        errors = [line for line in printed.splitlines() if line.startswith("error:")]
        log = job.folder / "logs" / f"rank{rank}.log"
        assert len(errors) == 1 and "Traceback" not in printed, printed
        expected = pattern.format(rank=rank, log=re.escape(str(log)))
        assert re.fullmatch(expected, errors[0]), (errors[0], expected)
        saved = log.read_text()
        assert errors[0].removeprefix(f"error: rank {rank}: ").split("; traceback in ")[0] in saved
        assert "Traceback (most recent call last):" in saved
        lines.append(errors[0])
    return lines


def test_a_forward_that_raises_is_one_line_per_rank(jobs):
    lines_of(jobs["forward"], faults.INTERNAL, (
        r"error: rank {rank}: internal error at step 1 in forward of module 'blocks\.1\.mlp' "
        rf"\(layout {FSDP}\): RuntimeError: the MLP refuses this batch; traceback in {{log}}"))
    saved = (jobs["forward"].folder / "logs" / "rank0.log").read_text()
    assert "second line, in the log only" in saved and 'in forward\n    raise RuntimeError' in saved


def test_a_backward_that_raises_names_the_module_that_called_its_function(jobs):
    lines_of(jobs["backward"], faults.INTERNAL, (
        r"error: rank {rank}: internal error at step 1 in backward of module 'blocks\.1\.mlp' "
        rf"\(layout {FSDP}\): RuntimeError: no gradient for this MLP; traceback in {{log}}"))


def test_what_a_pass_refuses_at_build_is_exit_2(jobs):
    lines_of(jobs["tp_refuses"], faults.UNSUPPORTED, (
        r"error: rank {rank}: unsupported at build of module 'norm_out' by "
        r"composer/parallel/tensor\.py:apply_tp \(layout dp_shard=1 tp=2 pp=1 cp=1\): "
        r"NotImplementedError: ColwiseParallel currently only support nn\.Linear and "
        r"nn\.Embedding!; traceback in {log}"))


def test_any_other_exception_at_build_is_an_internal_error(jobs):
    lines_of(jobs["init"], faults.INTERNAL, (
        r"error: rank {rank}: internal error in build of module 'blocks\.1\.mlp' by "
        rf"composer/parallel/materialize\.py:init_weights \(layout {FSDP}\): "
        r"RuntimeError: cannot draw this MLP's weights; traceback in {log}"))


def test_a_model_that_cannot_be_built_is_one_line_before_any_layout(jobs):
    """Its constructor raises while the job is checked (the model built on meta)."""
    lines_of(jobs["constructor"], faults.INTERNAL, (
        r"error: rank {rank}: internal error in build of the root module \(UnbuildableMLP\) "
        r"by composer/spec\.py:ModelSpec\.build_meta \(layout not yet made\): "
        r"RuntimeError: this MLP cannot be built; traceback in {log}"))


def test_a_forward_that_returns_more_than_its_logits_is_told_what_the_trainer_takes(jobs):
    lines_of(jobs["tuple"], faults.INTERNAL, (
        r"error: rank {rank}: internal error at step 1 in forward at "
        r"composer/trainer/loss\.py:loss_sum \(layout dp_shard=2 tp=1 pp=1 cp=1\): TypeError: "
        r"the model's forward returned a tuple; composer's trainer takes its logits, one "
        r"tensor \[batch, seq, vocab\] .*; traceback in {log}"))


@pytest.mark.slow
def test_composers_launcher_prints_only_the_ranks_lines(tmp_path):
    """``composer-train --nproc 2``: rank 0's log, then each rank's line; no traceback, no
    warning of torch's, no report of the launcher's."""
    out = subprocess.run([sys.executable, "-m", "composer.train", "--nproc", "2",
                          *model("in_backward"), "--job.dump_folder", str(tmp_path)],
                         cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == faults.INTERNAL, out.stdout + out.stderr
    assert all(line.startswith("[rank0] ") for line in out.stdout.splitlines()), out.stdout
    assert out.stderr.splitlines() == [
        f"error: rank {r}: internal error at step 1 in backward of module 'blocks.1.mlp' (layout "
        f"{FSDP}): RuntimeError: no gradient for this MLP; traceback in "
        f"{tmp_path / 'logs' / f'rank{r}.log'}" for r in range(2)], out.stderr


class Explode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("nobody calls me from a module")


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no words")


def unprintable():
    raise Unprintable()


def raised(f) -> BaseException:
    try:
        f()
    except Exception as e:  # noqa: BLE001 (whatever it raised)
        return e
    raise AssertionError("did not raise")


def test_the_line_says_what_it_can_and_never_fails(tmp_path):
    """Each phase's word; a place outside every module: its function; a diagnosis that
    fails: a shorter line; a log file that cannot be written: said so."""
    linear = nn.Linear(2, 2)
    log = tmp_path / "logs" / "rank0.log"
    e = raised(lambda: Explode.apply(torch.ones(2, requires_grad=True)).sum().backward())
    fault = internal_error(e, Doing(step=4, phase="pipeline"), 0, FSDP, log, [linear])
    assert fault.code == faults.INTERNAL and fault.line.startswith(
        "internal error at step 4 in backward at tests/integration/test_model_errors.py:"
        "Explode.backward (layout dp_shard=2 tp=1 pp=1 cp=1): RuntimeError: nobody calls me")
    e = raised(lambda: linear(torch.ones(3)))
    for phase, word in (("optimizer", "optimizer"), ("checkpoint", "checkpoint"),
                        ("loading step-2", "checkpoint"), ("loss", "forward"),
                        ("validation", "validation")):
        line = internal_error(e, Doing(step=2, phase=phase), 0, FSDP, log, [linear]).line
        assert line.startswith(f"internal error at step 2 in {word} of the root module (Linear) "
                               f"(layout {FSDP}): RuntimeError: mat1 and mat2 shapes"), line
    assert internal_error(ValueError("x"), Doing(phase="building the model"), 0, FSDP, log,
                          []).code == faults.UNSUPPORTED
    e = raised(unprintable)
    assert internal_error(e, Doing(phase="forward"), 0, FSDP, log, []).line.startswith(
        "internal error in forward at tests/integration/test_model_errors.py:unprintable (layout "
        f"{FSDP}): Unprintable; traceback in ")
    e = raised(lambda: linear(torch.ones(3)))
    assert internal_error(e, Doing(phase="forward"), 0, FSDP, log, [None]).line == (
        f"internal error (forward): RuntimeError: mat1 and mat2 shapes cannot be multiplied "
        f"(1x3 and 2x2); traceback in {log}")  # a diagnosis that fails says less
    (tmp_path / "file").write_text("")
    line = internal_error(e, Doing(phase="forward"), 0, FSDP, tmp_path / "file" / "r.log",
                          []).line
    assert line.endswith(f"its traceback could not be written to {tmp_path / 'file' / 'r.log'}: "
                         f"File exists"), line  # its folder is a file
    assert Path(log).read_text().count("Traceback (most recent call last):") == 8
