"""Checkpoints: exact resume, async == sync, pruning, broken steps skipped,
layout changes, a killed rank under torchrun, and loss-spike / NaN recovery."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from composer.checkpoint.dcp import find_resume
from composer.testing.harness import (
    PARITY,
    ROOT,
    Run,
    descendants,
    kill_tree,
    parent,
    read_metrics,
    run_jobs,
    train,
)

CKPT = [*PARITY, "--validation.enable", "false", "--training.steps", "6",
        "--checkpoint.enable", "--checkpoint.interval", "2"]


def load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP step, whole, in this process."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items() if hasattr(meta, "size")}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def assert_same_rows(rows: list[dict], reference: list[dict], rel: float = 0.0) -> None:
    by_step = {r["step"]: r for r in reference}
    for row in rows:
        ref = by_step[row["step"]]
        for key in ("loss", "grad_norm", "lr"):
            assert row[key] == pytest.approx(ref[key], rel=rel, abs=0), (row["step"], key)


def assert_resumed_once(folder: Path, full: list[dict], resumed_from: int) -> None:
    """metrics.jsonl after a resume: each step once (the first run's rows past the
    checkpoint dropped, the retaken steps equal to them), one event row where it restarted."""
    rows = read_metrics(folder, events=True)
    assert [(r["step"], r.get("event")) for r in rows] == [
        *[(s, None) for s in range(1, resumed_from + 1)], (resumed_from, "restarted"),
        *[(s, None) for s in range(resumed_from + 1, len(full) + 1)]]
    assert_same_rows([r for r in rows if "event" not in r], full)
    record = json.loads((folder / "run.json").read_text())  # the first run's, kept
    assert [(r["step"], Path(r["checkpoint"]).name) for r in record["resumes"]] == [
        (resumed_from, f"step-{resumed_from}")]
    assert (folder / "config.toml").is_file()


def resume_after_losing_the_last_step(folder: Path, nproc: int, args: list[str]) -> list[dict]:
    """Train 6 steps; forget step 6 as if the run had died after step 5; train
    again from step 4: its rows must equal the first run's, each step once."""
    full = train(folder, nproc, args)
    shutil.rmtree(folder / "checkpoint" / "step-6")
    with open(folder / "metrics.jsonl", "a") as f:  # a row the dying run left half-written
        f.write('{"step": 7, "loss": 2.')
    train(folder, nproc, args)
    assert_resumed_once(folder, full, 4)
    return full


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one_process")
    rows = resume_after_losing_the_last_step(
        folder, 1, [*CKPT, "--training.local_batch_size", "8", "--checkpoint.keep_latest_k", "2"])
    return folder, rows


def test_resume_is_exact_in_one_process(one_process):
    folder, rows = one_process
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]


def test_keep_latest_k_keeps_exactly_k(one_process):
    folder, _ = one_process
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == ["step-4", "step-6"]


FSDP = [*CKPT, "--training.local_batch_size", "4"]
LAYOUTS = [  # (ranks, layout args): each continues from the previous one's checkpoint
    (4, ["--training.local_batch_size", "2"]),
    (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    (4, ["--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2"]),
    (1, ["--training.local_batch_size", "8"]),
]
EIGHT = [*CKPT, "--training.steps", "8"]
KILL = ["--training.steps", "12", "--data.seq_len", "256", "--training.local_batch_size", "8",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--validation.enable", "false", "--checkpoint.enable", "--checkpoint.interval", "4",
        "--job.collective_timeout_s", "60"]
EXPORT = [*CKPT, "--training.steps", "2", "--checkpoint.last_save_in_hf",
          "--checkpoint.export_dtype", "float64"]
FROM = [*PARITY, "--training.steps", "2", "--validation.enable", "false"]


def layout_chain(here: Path) -> dict[str, Run]:
    """FSDP x4 -> TP2 x FSDP2 -> PP2 x FSDP2 -> 1 process, 2 steps each, each
    from the previous one's last checkpoint, beside one process throughout."""
    jobs = {"layouts_reference": Run(1, [*EIGHT, "--training.local_batch_size", "8"])}
    for i, (nproc, layout) in enumerate(LAYOUTS):
        start = ["--checkpoint.initial_load_path",
                 str(here / f"layout{i - 1}" / "checkpoint" / f"step-{2 * i}"),
                 "--checkpoint.initial_load_model_only", "false"] if i else []
        jobs[f"layout{i}"] = Run(nproc, [*EIGHT, *layout, *start])
    return jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every multi-rank run of this file, in one launch, in this order."""
    here = tmp_path_factory.mktemp("checkpoint_runs")
    export = str(here / "export_a" / "checkpoint" / "step-2-hf")
    jobs = {
        # resume with FSDP: 6 steps; step 6 lost as if the run died after step 5; again
        "sync": Run(2, FSDP),
        "sync_resumed": Run(2, FSDP, folder="sync", remove=("sync/checkpoint/step-6",)),
        "async": Run(2, [*FSDP, "--checkpoint.async_mode", "async"]),
        **layout_chain(here),
        "kill_reference": Run(2, KILL),
        # Hugging Face export at the end of a run; import at the start of others
        "export_a": Run(2, [*EXPORT, "--training.local_batch_size", "4"]),
        "from_hf": Run(4, [*FROM, "--training.local_batch_size", "4",
                           "--parallelism.tensor_parallel_degree", "2",
                           "--checkpoint.initial_load_path", export]),
        "from_dcp": Run(1, [*FROM, "--training.local_batch_size", "8",
                            "--checkpoint.initial_load_path",
                            str(here / "export_a" / "checkpoint" / "step-2")]),
        "fresh": Run(1, [*FROM, "--training.local_batch_size", "8"]),
    }
    return here, run_jobs(jobs, here)


@pytest.mark.slow
def test_resume_is_exact_with_fsdp_and_async_writes_the_same_files(runs):
    here, jobs = runs
    full = jobs["async"].rows()  # the same steps, written in the background
    assert jobs["sync"].code == 0 and jobs["sync_resumed"].code == 0
    assert_resumed_once(here / "sync", full, 4)
    for step in (2, 4, 6):
        ours = load_checkpoint(here / "async" / "checkpoint" / f"step-{step}")
        theirs = load_checkpoint(here / "sync" / "checkpoint" / f"step-{step}")
        assert ours.keys() == theirs.keys() and len(ours) > 30
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), key


def broken_copy(source: Path, target: Path) -> Path:
    """A checkpoint folder whose newest steps are broken in three ways."""
    shutil.copytree(source, target)
    steps = target / "checkpoint"
    shutil.copytree(steps / "step-6", steps / "step-8.tmp")  # a save that never finished
    shutil.copytree(steps / "step-6", steps / "step-10")
    (steps / "step-10" / ".metadata").unlink()              # named complete, no metadata
    data = sorted((steps / "step-6").glob("*.distcp"))[0]
    with open(data, "r+b") as f:                             # a truncated data file
        f.truncate(data.stat().st_size // 2)
    return steps


def test_broken_steps_are_skipped_with_one_warning_each(one_process, tmp_path, caplog):
    steps = broken_copy(one_process[0], tmp_path / "copy")
    with caplog.at_level("WARNING"):
        assert find_resume(steps, -1) == steps / "step-4"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "step-8.tmp is incomplete" in lines[0]
    assert "step-10 is unusable: it has no .metadata" in lines[1]
    assert "step-6 is unusable: __0_0.distcp is truncated (" in lines[2]


def test_a_run_resumes_past_broken_steps(one_process, tmp_path):
    steps = broken_copy(one_process[0], tmp_path / "copy")
    result = subprocess.run(
        [sys.executable, "-m", "composer.train", *CKPT, "--training.local_batch_size", "8",
         "--job.dump_folder", str(tmp_path / "copy"), "--training.steps", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "checkpoint loaded: " + str(steps / "step-4") in result.stdout
    assert read_metrics(tmp_path / "copy")[-1]["step"] == 5


def test_mismatched_shapes_fail_with_one_line_naming_the_key(one_process, monkeypatch, capsys):
    from tests.integration.test_config import run_main
    code, lines = run_main(monkeypatch, capsys, 1, [
        *CKPT, "--training.local_batch_size", "8", "--job.dump_folder", str(one_process[0]),
        "--model.overrides", "ffn_dim_multiplier=2.0"])
    assert code == 2 and len(lines) == 1, lines
    assert "model.layers.0.feed_forward.w1.weight has shape [384, 128], llama3/debug has " \
           "[704, 128]" in lines[0]


@pytest.mark.slow
def test_layout_changes_keep_weights_and_optimizer_state(runs):
    """FSDP x4 -> TP2 x FSDP2 -> PP2 x FSDP2 -> 1 process, 2 steps each, against
    one process throughout: losses, and at the end every weight and optimizer
    tensor of the last checkpoint, at a relative 1e-9."""
    here, jobs = runs
    reference = jobs["layouts_reference"].rows()
    for i in range(len(LAYOUTS)):
        rows = jobs[f"layout{i}"].rows()
        assert rows[0]["step"] == 2 * i + 1
        assert_same_rows(rows[:2], reference, rel=1e-9)
    last = here / f"layout{len(LAYOUTS) - 1}" / "checkpoint" / f"step-{2 * len(LAYOUTS)}"
    ours, theirs = load_checkpoint(last), load_checkpoint(here / "layouts_reference" /
                                                          "checkpoint" / "step-8")
    assert ours.keys() == theirs.keys()
    assert any(k.startswith("optimizer.state.") and k.endswith("exp_avg_sq") for k in ours)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-9, atol=1e-12, msg=key)


@pytest.mark.slow
def test_a_killed_rank_restarts_and_ends_like_an_uninterrupted_run(runs, tmp_path):
    reference = runs[1]["kill_reference"].rows()
    code, out = run_and_kill_a_rank(tmp_path / "killed", KILL)
    assert code == 0, out[-3000:]
    assert "checkpoint loaded" in out
    rows = read_metrics(tmp_path / "killed", events=True)
    restarts = [r["step"] for r in rows if r.get("event") == "restarted"]
    assert len(restarts) == 1  # each step once: the rows past the checkpoint were dropped
    assert [r["step"] for r in rows if "event" not in r] == list(range(1, 13))
    assert rows[-1]["loss"] == reference[-1]["loss"]


@pytest.mark.slow
def test_a_stopped_rank_times_out_then_the_job_restarts_like_an_uninterrupted_run(runs, tmp_path):
    """A transient fault under torchrun --max-restarts: a peer that stops answering
    ends its partner in the timeout's line (exit 6); torchrun restarts both, they
    resume from the last complete step and end on the uninterrupted run's loss."""
    reference = runs[1]["kill_reference"].rows()
    code, out = run_and_kill_a_rank(tmp_path / "stopped",
                                    [*KILL, "--job.collective_timeout_s", "5"],
                                    fault=stop)
    assert code == 0, out[-3000:]
    line = next(line for line in out.splitlines() if "error: rank " in line)
    assert "a peer stopped answering at step" in line and "(job.collective_timeout_s=5)" in line
    assert "checkpoint loaded" in out
    rows = read_metrics(tmp_path / "stopped", events=True)
    assert len([r for r in rows if r.get("event") == "restarted"]) == 1
    assert [r["step"] for r in rows if "event" not in r] == list(range(1, 13))
    assert rows[-1]["loss"] == reference[-1]["loss"]


def run_and_kill_a_rank(folder: Path, args: list[str], fault=None) -> tuple[int | None, str]:
    """torchrun --max-restarts=1; once step 6 is logged, SIGKILL one worker (or
    ``fault(worker, agent)``). Exit status (None: still running after 200 s) and output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", "-m", "composer.train", "--job.dump_folder", str(folder), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    try:
        victim = wait_for_step_then_pick_a_worker(proc.pid, folder / "metrics.jsonl", step=6)
        if victim is None:
            return None, ""
        (fault or kill)(victim, proc.pid)
        out, _ = proc.communicate(timeout=200)
        return proc.returncode, out
    except subprocess.TimeoutExpired as e:
        return None, (e.output or b"").decode(errors="replace") if isinstance(e.output, bytes) \
            else (e.output or "")
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)


def kill(worker: int, agent: int) -> None:
    os.kill(worker, signal.SIGKILL)


def stop(worker: int, agent: int) -> None:
    """SIGSTOP ``worker``; once its peer has given up on it (the collective's
    timeout) and ended, let it go on, to meet torchrun's SIGTERM."""
    os.kill(worker, signal.SIGSTOP)
    peers = [pid for pid in descendants(agent) if parent(pid) == agent and pid != worker]
    deadline = time.time() + 60
    while any(parent(pid) == agent for pid in peers) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(worker, signal.SIGCONT)


def wait_for_step_then_pick_a_worker(agent: int, metrics: Path, step: int) -> int | None:
    """A worker's pid once ``step`` is logged; None if that takes over 150 s."""
    deadline = time.time() + 150
    while time.time() < deadline:
        if metrics.exists() and any(json.loads(line)["step"] >= step
                                    for line in metrics.read_text().splitlines()):
            workers = [pid for pid in descendants(agent) if parent(pid) == agent]
            assert workers, "no worker processes found"
            return max(workers)
        time.sleep(0.05)
    return None


def test_a_nonfinite_step_is_skipped_and_counted(tmp_path):
    rows = train(tmp_path, 1, [*PARITY, "--training.local_batch_size", "8",
                               "--job.plugins", "tests.support.inject",
                               "--inject.nonfinite_step", "3"])
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1]
    assert rows[2]["loss"] != rows[2]["loss"]  # NaN, logged as it was
    clean = train(tmp_path / "clean", 1, [*PARITY, "--training.local_batch_size", "8"])
    # step 4 starts from step 2's weights (step 3's update was dropped): its loss differs
    assert rows[3]["loss"] != clean[3]["loss"] and rows[1]["loss"] == clean[1]["loss"]


def test_a_loss_spike_rolls_back_and_skips_the_batch(tmp_path):
    args = [*CKPT, "--training.local_batch_size", "8", "--recovery.spike_factor", "3",
            "--recovery.spike_window", "2", "--job.plugins", "tests.support.inject",
            "--inject.spike_step", "5"]
    rows = train(tmp_path, 1, args)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["rollbacks"] == 1 and rows[3]["rollbacks"] == 0
    # after the rollback to step 4, steps 5 and 6 took the batches of steps 6 and 7
    longer = train(tmp_path / "clean", 1, [*CKPT, "--training.local_batch_size", "8",
                                           "--training.steps", "6"])
    assert rows[4]["loss"] != longer[4]["loss"]
    failing = subprocess.run(
        [sys.executable, "-m", "composer.train", *args, "--job.dump_folder", str(tmp_path / "f"),
         "--recovery.max_rollbacks", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert failing.returncode == 3
    assert failing.stderr.strip().splitlines()[-1].startswith(
        "error: step 5: loss "), failing.stderr[-2000:]
    assert "after 0 rollback(s) (recovery.max_rollbacks)" in failing.stderr


@pytest.mark.slow
def test_hugging_face_export_at_the_end_and_import_at_the_start(runs):
    from composer.checkpoint.hf import hf_names, open_hf, to_hf
    from composer.models.llama import LlamaAdapter, flavors
    here, jobs = runs
    assert jobs["export_a"].code == 0, jobs["export_a"].log()
    export, step = (here / "export_a" / "checkpoint" / "step-2-hf",
                    here / "export_a" / "checkpoint" / "step-2")
    saved = {k[len("model."):]: v for k, v in load_checkpoint(step).items()
             if k.startswith("model.")}
    expected = to_hf(saved, LlamaAdapter(flavors["debug"]))
    _, get = open_hf(export)
    assert sorted(hf_names(export)) == sorted(expected)
    for name, tensor in expected.items():  # sharded export == the checkpoint, converted
        assert torch.equal(get(name), tensor), name
    from_dcp = jobs["from_dcp"].rows()
    assert_same_rows(jobs["from_hf"].rows(), from_dcp, rel=1e-9)
    # it did start from the trained weights
    assert from_dcp[0]["loss"] < jobs["fresh"].rows()[0]["loss"]
