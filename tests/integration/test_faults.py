"""Faults end in one line and an exit status of their class, leave nothing in the
way, and the run can go on: a real full disk (a tmpfs, where the test may mount
one), a peer stopped with SIGSTOP, a dump folder that cannot be a folder, the
debris of a crashed save; and the diagnosis of each class from its exception."""
from __future__ import annotations

import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from composer.checkpoint.dcp import last_complete
from composer.faults import diagnosis as faults
from composer.faults.diagnosis import Doing, diagnose
from composer.testing.harness import (
    PARITY,
    ROOT,
    descendants,
    kill_tree,
    launch_env,
    parent,
    read_metrics,
    run_here,
)

SAVE_EVERY_2 = [*PARITY, "--training.local_batch_size", "4", "--validation.enable", "false",
                "--checkpoint.enable", "--checkpoint.interval", "2"]


def test_each_class_is_diagnosed_from_its_exception(tmp_path):
    doing = Doing(step=15, phase="checkpoint", folder=tmp_path, timeout_s=20,
                  last_step=lambda: last_complete(tmp_path))
    (tmp_path / "step-10").mkdir()
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    fault = diagnose(CheckpointException("save", {0: (full, None)}), doing)
    assert fault.code == faults.NO_SPACE and fault.line.startswith(
        f"no space left on device writing checkpoint step 15 to {tmp_path} (")
    assert "free); the last complete step is step-10" in fault.line
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] "
                        "Timed out waiting 20000ms for recv operation")
    fault = diagnose(lost, Doing(step=3, phase="backward", timeout_s=20))
    assert fault.code == faults.TIMEOUT and fault.line.startswith(
        "a peer stopped answering at step 3 (backward): waited in a collective "
        "(job.collective_timeout_s=20)")
    fault = diagnose(torch.OutOfMemoryError("CUDA out of memory."), Doing(step=1, phase="forward"))
    assert fault.code == faults.OUT_OF_MEMORY and "at step 1 (forward)" in fault.line
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                       "can't allocate memory: you tried to allocate 201326592 bytes.")
    fault = diagnose(cpu, Doing(step=2, phase="backward",
                                estimate=lambda: "the planner says 9 GiB"))
    assert fault.code == faults.OUT_OF_MEMORY and fault.line.startswith(
        "out of memory at step 2 (backward), peak so far ")
    assert (" GiB resident; the planner says 9 GiB; lower it with "
            "activation_checkpoint.mode" in fault.line)
    gone = FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/shard-7.jsonl")
    assert diagnose(gone, Doing(step=9, phase="data")).code == faults.DATA
    assert diagnose(gone, Doing(step=9, phase="checkpoint")).code == faults.FOLDER
    fault = diagnose(FileNotFoundError("/data/shard-7.jsonl"), Doing(step=4, phase="validation"))
    assert fault.code == faults.DATA and fault.line == (
        "the data source went away or turned unreadable at step 4 (validation): "
        "FileNotFoundError: /data/shard-7.jsonl; "
        "data.dataset must stay readable until the run ends")
    assert diagnose(ValueError("a bug of ours"), Doing(phase="forward")) is None
    assert diagnose(ValueError("a bug of ours"), Doing(phase="validation")) is None


def test_a_fault_line_is_printed_off_the_main_thread_too(capsys):
    import threading
    worker = threading.Thread(target=faults.announce, args=(1, "a peer stopped answering"))
    worker.start()
    worker.join()
    assert capsys.readouterr().err == "error: rank 1: a peer stopped answering\n"


def test_a_streamed_file_that_vanishes_is_a_data_fault_at_its_next_pass(tmp_path):
    """data.streaming reads the files again at each epoch: the same windows as the
    in-memory source, and a file gone since the last pass ends the epoch's last
    batch in the data class."""
    from composer.data import DataLoader
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i:03d}"}) + "\n" for i in range(12)))
    memory, stream = (DataLoader(str(corpus), "byte", 15, 2, 0, 1, val_fraction=0,
                                 streaming=streaming) for streaming in (False, True))
    for _ in range(4):  # 10 windows of 16 tokens an epoch (14 a document)
        assert all(torch.equal(a, b) for a, b in zip(memory.next_batch(), stream.next_batch()))
    assert stream.epoch == 0
    corpus.rename(tmp_path / "moved.jsonl")
    with pytest.raises(FileNotFoundError) as gone:
        stream.next_batch()
    fault = diagnose(gone.value, Doing(step=7, phase="data"))
    assert (fault.code == faults.DATA
            and f"at step 7 (data): FileNotFoundError: {corpus}" in fault.line)


def test_a_dump_folder_that_cannot_be_one_is_one_line(tmp_path, monkeypatch, capsys):
    from composer.cli.run import run_argv
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = run_argv([*PARITY, "--job.dump_folder", str(tmp_path / "file" / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == faults.FOLDER and len(lines) == 1, lines  # found at start, before any file
    assert lines[0] == (f"error: job.dump_folder: {tmp_path / 'file'} is a file, so "
                        f"{tmp_path / 'file' / 'run'} cannot be made; allowed: a folder")


def open_files_under(folder: Path) -> list[str]:
    """The files under ``folder`` this process holds open."""
    fds = Path("/proc/self/fd")
    targets = [os.readlink(fd) for fd in fds.iterdir() if fd.is_symlink()]
    return [t for t in targets if t.startswith(str(folder))]


def test_a_failing_resume_load_closes_what_the_start_opened(tmp_path, monkeypatch, capsys):
    """The start-up opens metrics.jsonl and TensorBoard's event file before it
    loads the step to resume; a step that cannot be read ends in one line naming
    the phase (exit 9), and nothing the start opened stays open."""
    from composer.cli.run import run_argv
    args = [*SAVE_EVERY_2, "--metrics.enable_tensorboard", "true"]
    assert run_here(tmp_path, [*args, "--training.steps", "2"]).code == 0
    shard = tmp_path / "checkpoint" / "step-2" / "__0_0.distcp"
    with open(shard, "r+b") as f:  # the size stays, the zip header does not
        f.write(b"\xff" * 64)
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = run_argv([*args, "--training.steps", "4", "--job.dump_folder", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == faults.UNREADABLE_STEP and len(lines) == 1, lines
    assert lines[0].startswith("error: rank 0: step-2 cannot be read (loading step-2): "
                               "UnpicklingError: "), lines[0]
    assert lines[0].endswith("; remove it or start from an earlier complete step "
                             "(checkpoint.load_step)")
    assert list((tmp_path / "tb").iterdir()) and open_files_under(tmp_path) == []


def test_every_observer_closes_when_one_fails_to():
    from composer.observe import Observer
    from composer.observe.base import Observers
    closed = []

    class Failing(Observer):
        def close(self):
            closed.append("failing")
            raise OSError(errno.EIO, "the writer could not flush")

    class Plain(Observer):
        def close(self):
            closed.append("plain")

    with pytest.raises(OSError, match="could not flush"):
        Observers([Failing(), Plain(), Failing()]).close()
    assert closed == ["failing", "plain", "failing"]


def test_a_crashed_saves_debris_is_removed_at_the_start(tmp_path):
    debris = tmp_path / "checkpoint" / "step-3.tmp"
    debris.mkdir(parents=True)
    (debris / "__0_0.distcp").write_bytes(b"\0" * 1000)
    job = run_here(tmp_path, [*SAVE_EVERY_2, "--training.steps", "2"])
    assert job.code == 0 and not debris.exists()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]
    assert (f"removing {debris}: a save interrupted by a crash"
            in (job.logs / "rank0.log").read_text())


@pytest.fixture
def small_disk(tmp_path):
    """A 56 MB tmpfs: two float64 steps of the debug model (23 MB each) fit, a third does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=56m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_stops_in_one_line_then_the_run_goes_on(tmp_path, small_disk):
    folder, ckpt = tmp_path / "run", small_disk / "checkpoint"
    args = [*SAVE_EVERY_2, "--training.steps", "8", "--checkpoint.folder", str(ckpt)]
    died = subprocess.run([sys.executable, "-m", "composer.train", *args, "--job.dump_folder",
                           str(folder)], cwd=ROOT, env=launch_env(), capture_output=True,
                          text=True, timeout=300)
    lines = died.stderr.strip().splitlines()
    assert died.returncode == faults.NO_SPACE and len(lines) == 1, died.stderr[-3000:]
    assert lines[0].startswith(f"error: rank 0: no space left on device writing checkpoint "
                               f"step 6 to {ckpt} (")
    assert lines[0].endswith("the last complete step is step-4; free space, or keep fewer "
                             "steps (checkpoint.keep_latest_k)")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]  # no partial step-6
    # again, riding out the saves that fail: from step 4, as if never interrupted
    job = run_here(folder, [*args, "--checkpoint.on_save_error", "continue"], name="again")
    assert job.code == 0
    rows = read_metrics(folder)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["save_errors"] for r in rows[4:]] == [0, 1, 1, 2]
    reference = run_here(tmp_path / "reference", [*PARITY, "--training.local_batch_size", "4",
                                                  "--validation.enable", "false",
                                                  "--training.steps", "8"], name="ref").rows()
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-12)
    log = (job.logs / "rank0.log").read_text().strip().splitlines()
    ended = [line for line in log if "the run ends without its last save" in line]
    assert len(ended) == 1 and ended[0].endswith(
        "the run ends without its last save (step 8, 2 failed save(s) in all); the newest "
        "complete checkpoint is step-4")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]


@pytest.mark.slow
def test_a_stopped_peer_ends_in_one_line_naming_where_it_waited(tmp_path):
    out = tmp_path / "launch.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "composer.train", *PARITY, "--training.steps", "50", "--validation.enable",
           "false", "--job.collective_timeout_s", "5", "--job.dump_folder", str(tmp_path)]
    with open(out, "w") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        victim = stop_a_worker_after(agent.pid, tmp_path / "metrics.jsonl", step=2)
        deadline = time.time() + 60
        while "error: rank " not in out.read_text() and time.time() < deadline:
            time.sleep(0.2)
        os.kill(victim, signal.SIGCONT)  # let it see its peer gone, and end
        agent.wait(timeout=120)
    finally:
        if agent.poll() is None:
            kill_tree(agent.pid)
    text = out.read_text()
    # the rank that waited on its stopped peer says where (the other, woken, finds it gone)
    line = next(line for line in text.splitlines() if line.startswith("error: rank "))
    assert "a peer stopped answering at step" in line and "(job.collective_timeout_s=5)" in line
    assert "waited in " in line and "check that every rank is alive" in line
    assert "exitcode  : 6" in text  # torchrun's summary shows the child's status
    assert agent.returncode == 1


def stop_a_worker_after(agent: int, metrics: Path, step: int) -> int:
    """SIGSTOP one worker once ``step`` is logged; its pid."""
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and any(json.loads(line)["step"] >= step
                                    for line in metrics.read_text().splitlines()):
            workers = sorted(pid for pid in descendants(agent) if parent(pid) == agent)
            os.kill(workers[-1], signal.SIGSTOP)
            return workers[-1]
        time.sleep(0.05)
    raise AssertionError(f"step {step} was never logged")


def train_process(args: list[str], limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    """``python -m composer.train`` as its own process (under an address-space limit)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return subprocess.run([sys.executable, "-m", "composer.train", *args], cwd=ROOT,
                          env=launch_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=limit if limit_bytes else None)


@pytest.mark.slow
def test_out_of_memory_is_one_line_with_the_peak_and_the_planners_estimate(tmp_path):
    """A CPU allocation that fails (a 2 GiB address-space limit, a batch whose
    activations need more) is the out-of-memory class, as on CUDA."""
    died = train_process(["--training.steps", "2", "--training.local_batch_size", "16",
                          "--data.seq_len", "2048", "--validation.enable", "false",
                          "--metrics.enable_tensorboard", "false", "--job.dump_folder",
                          str(tmp_path)], limit_bytes=2 * 2**30)
    lines = died.stderr.strip().splitlines()
    assert died.returncode == faults.OUT_OF_MEMORY and len(lines) == 1, died.stderr[-3000:]
    assert re.fullmatch(
        r"error: rank 0: out of memory at step 1 \((forward|loss|backward)\), peak so far "
        r"[\d.]+ GiB resident; the planner predicts peak 1\.63 GiB per rank \(backward start\) "
        r"of [\d.]+ usable; lower it with activation_checkpoint\.mode, a smaller "
        r"training\.local_batch_size \(global_batch_size keeps the batch\), "
        r"parallelism\.zero_stage 3, or more tensor/pipeline parallel ranks", lines[0]), lines[0]


def write_shards(folder: Path, second: str) -> Path:
    """Two JSON-lines shards: 1,024 short documents (``datasets`` streams 1,024 rows
    at a time, so the second is opened only once the first is used up), then ``second``."""
    folder.mkdir(exist_ok=True)
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n"
                                            for i in range(1024)))
    (folder / "b.jsonl").write_text(second)
    return folder


@pytest.mark.slow
def test_a_shard_that_turns_unreadable_stops_in_one_line_then_the_run_resumes(tmp_path):
    """Streaming reaches a corrupt shard at step 19 (exit 8, one line; the log
    names the file); once it is mended the run resumes from step 15 and ends as
    a run that never met it, which read its data into memory."""
    good = "".join(json.dumps({"text": f"more {i}"}) + "\n" for i in range(300))
    data = write_shards(tmp_path / "data", second='{"text": "cut off\n')
    args = [*PARITY, "--data.dataset", str(data), "--data.seq_len", "128",
            "--training.local_batch_size", "4", "--validation.enable", "false",
            "--training.steps", "22", "--checkpoint.enable", "--checkpoint.interval", "5"]
    folder = tmp_path / "run"
    died = train_process([*args, "--data.streaming", "--job.dump_folder", str(folder)])
    lines = died.stderr.strip().splitlines()
    assert died.returncode == faults.DATA and len(lines) == 1, died.stderr[-3000:]
    assert lines[0] == ("error: rank 0: the data source went away or turned unreadable at step "
                        "19 (data): ArrowInvalid: JSON parse error: Invalid encoding in string. in "
                        "row 0; data.dataset must stay readable until the run ends")
    assert f"Failed to load JSON from file '{data / 'b.jsonl'}'" in died.stdout
    assert (sorted(p.name for p in (folder / "checkpoint").iterdir())
            == ["step-10", "step-15", "step-5"])
    (data / "b.jsonl").write_text(good)
    rows = run_here(folder, [*args, "--data.streaming"], name="again").rows()
    reference = run_here(tmp_path / "reference", args, name="ref").rows()
    assert [r["step"] for r in rows] == list(range(1, 23))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-12)


@pytest.mark.slow
def test_a_background_save_that_fails_is_ridden_out(tmp_path, small_disk):
    """checkpoint.async_mode: a save that fails on its thread (a full disk) is found
    at the next step's poll, removed, counted, and tried again at the next interval."""
    ckpt = small_disk / "checkpoint"
    job = run_here(tmp_path, [*SAVE_EVERY_2, "--training.steps", "8", "--checkpoint.folder",
                              str(ckpt), "--checkpoint.async_mode", "async",
                              "--checkpoint.on_save_error", "continue"])
    errors = [r["save_errors"] for r in job.rows()]
    # step 6's save fails on its thread: seen at step 7's poll if it has ended by then,
    # else at step 8, whose save waits for it first; step 8's own fails at the end
    assert errors[:6] == [0] * 6 and errors[6] in (0, 1) and errors[7] == 1, errors
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]  # no partial step
    log = (job.logs / "rank0.log").read_text().strip().splitlines()
    for step in (6, 8):
        assert sum(f"checkpoint not saved: no space left on device writing checkpoint step "
                   f"{step} to {ckpt} (" in line for line in log) == 1, step
    ended = [line for line in log if "the run ends without its last save" in line]
    assert len(ended) == 1 and ended[0].endswith(
        "the run ends without its last save (step 8, 2 failed save(s) in all); the newest "
        "complete checkpoint is step-4")
