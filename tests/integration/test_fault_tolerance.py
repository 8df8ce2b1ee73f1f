"""Fault-tolerant replica groups (composer.faults.replicas) with a real torchft
lighthouse on 127.0.0.1 and each group its own torchrun."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from composer.cli.run import run_argv
from composer.testing.harness import (
    PARITY,
    ROOT,
    kill_tree,
    launch_env,
    read_metrics,
    run_side_by_side,
)
from tests.integration.test_parity import RTOL, relative_error

torchft = pytest.importorskip("torchft")

FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_command(g: int, folder, lighthouse: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "-m", "composer.train", *PARITY, "--training.local_batch_size", "2",
            "--job.dump_folder", str(folder / f"g{g}"), *FT,
            "--fault_tolerance.replica_id", str(g), "--fault_tolerance.lighthouse", lighthouse,
            *extra]


def lighthouse_at(port: int, min_replicas: int) -> subprocess.Popen:
    return subprocess.Popen(["torchft_lighthouse", "--min_replicas", str(min_replicas),
                             "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000",
                             "--bind", f"[::]:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=launch_env())


# each group's inner layout: local batches that make the reference's global batch of 8
INNER = {"fsdp2": ["--parallelism.zero_stage", "3"],
         "tp2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]}


@pytest.mark.slow
@pytest.mark.parametrize("inner", INNER)
def test_two_groups_that_lose_none_match_hsdp_and_one_process(tmp_path, reference, inner):
    """Two groups (FSDP2 x2, or TP2 inside) joined by torchft take the steps of HSDP
    with two replicas: the 1-process run's losses at 1e-9 (float64), every row naming
    both groups, and run.json the settings and no heal."""
    port = free_port()
    lighthouse = lighthouse_at(port, 2)
    try:
        cmds = [group_command(g, tmp_path, f"http://127.0.0.1:{port}", INNER[inner])
                for g in (0, 1)]
        codes = run_side_by_side(cmds, [tmp_path / f"g{g}.log" for g in (0, 1)], timeout=300)
    finally:
        lighthouse.kill()
    assert codes == [0, 0], (tmp_path / "g0.log").read_text()[-3000:]
    ref = reference("llama3")
    for g in (0, 1):
        rows = [r for r in read_metrics(tmp_path / f"g{g}") if "loss" in r]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(r["groups"] == [0, 1] for r in rows)
        for ours, theirs in zip(rows, ref, strict=True):
            for key in ("loss", "grad_norm"):
                assert relative_error(ours[key], theirs[key]) <= RTOL, (g, key, ours, theirs)
        record = json.loads((tmp_path / f"g{g}" / "run.json").read_text())["fault_tolerance"]
        assert record["replica_id"] == g and record["heals"] == []
        assert record["windows_trained"] == [16, 16] and record["steps_missed"] == [0, 0]


def start_group(cmd: list[str], log) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def logged(folder) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [r for r in read_metrics(folder) if "loss" in r] if path.is_file() else []


STEPS, KILL_AT = 100, 5


def together(rows: list[dict]) -> bool:
    """Whether a group's last logged step is past KILL_AT with all three groups in it."""
    return bool(rows) and rows[-1]["step"] >= KILL_AT and rows[-1]["groups"] == [0, 1, 2]
KILL_HEAL = ["--training.steps", str(STEPS), "--parallelism.zero_stage", "3",
             "--validation.freq", "4", "--fault_tolerance.group_size", "3",
             "--fault_tolerance.timeout_s", "30"]


@pytest.mark.slow
def test_a_killed_group_heals_from_a_live_peer_and_the_survivors_never_go_back(tmp_path):
    """Three groups of FSDP2 x2; once all three train together past step 5, every
    process of group 1 is killed by SIGKILL, and it is started again with no dump or
    checkpoint folder: its state can only come from a heal. The survivors go on (their
    steps only ever rise; one whose step the kill left uncommitted while the other's
    committed catches up from the other, as torchft's commits are each group's own), the
    restarted group heals once from a survivor and trains on; from the heal on, every
    step's loss and gradient norm is the survivors' bit for bit (float64: a weight or an
    AdamW moment one bit apart would show), and all three end at step 100. Validation
    runs every 4 steps: a heal after it once desynchronised the source's FSDP2 ranks."""
    port = free_port()
    lighthouse = lighthouse_at(port, 1)
    url = f"http://127.0.0.1:{port}"
    cmds = {g: group_command(g, tmp_path, url, KILL_HEAL) for g in range(3)}
    logs = {g: tmp_path / f"g{g}.log" for g in range(3)}
    procs = {g: start_group(cmds[g], logs[g]) for g in range(3)}
    try:
        deadline = time.monotonic() + 240
        while not all(together(logged(tmp_path / f"g{g}")) for g in range(3)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values())
            time.sleep(0.1)
        kill_tree(procs[1].pid)
        procs[1].wait(timeout=60)
        killed_at = max(r["step"] for g in (0, 2) for r in logged(tmp_path / f"g{g}"))
        shutil.rmtree(tmp_path / "g1")
        procs[1] = start_group(cmds[1], logs[1])
        codes = {g: p.wait(timeout=max(1.0, deadline + 120 - time.monotonic()))
                 for g, p in procs.items()}
    finally:
        for p in procs.values():
            kill_tree(p.pid)
        lighthouse.kill()
    assert codes == {0: 0, 1: 0, 2: 0}, {g: logs[g].read_text()[-3000:] for g in range(3)}
    rows = {g: logged(tmp_path / f"g{g}") for g in range(3)}
    records = {g: json.loads((tmp_path / f"g{g}" / "run.json").read_text())["fault_tolerance"]
               for g in range(3)}
    for g in (0, 2):  # the survivors: never back, no restart, nothing from group 1 again
        steps = [r["step"] for r in rows[g]]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS, (g, steps)
        # a survivor whose step the kill left uncommitted (the other's was) catches up from
        # the other, as torchft's commits are each group's own; it never reloads
        late = [h for h in records[g]["heals"] if h["step"] >= killed_at]
        assert all(h["source"] == 2 - g for h in late) and len(late) <= 1, records[g]
    (heal,) = records[1]["heals"]
    assert heal["source"] in (0, 2) and heal["step"] >= killed_at, heal
    healed = {r["step"]: r for r in rows[1]}
    assert min(healed) == heal["step"] + 1 and max(healed) == STEPS
    survivor = {r["step"]: r for r in rows[heal["source"]]}
    both = sorted(set(healed) & set(survivor))  # a step the source caught up on is not its
    assert len(both) >= len(healed) - 1
    for step in both:
        ours, theirs = healed[step], survivor[step]
        assert ((ours["loss"], ours["grad_norm"], ours["groups"])
                == (theirs["loss"], theirs["grad_norm"], theirs["groups"])), step
    assert healed[STEPS]["groups"] == [0, 1, 2]
    assert rows[0][-1]["loss"] == rows[2][-1]["loss"] == rows[1][-1]["loss"]
    assert records[0]["windows_trained"] == records[1]["windows_trained"]
    assert records[1]["steps_missed"][1] >= heal["step"] - killed_at


@pytest.mark.parametrize("args, says", [
    (["--fault_tolerance.replica_id", "2"],
     "fault_tolerance.replica_id=2: out of range; allowed: 0..1"),
    (["--fault_tolerance.min_replicas", "3"], "fault_tolerance.min_replicas=3"),
    (["--fault_tolerance.replica_id", "0"], "TORCHFT_LIGHTHOUSE is unset"),
    (["--fault_tolerance.lighthouse", "http://h:1", "--recovery.spike_factor", "3"],
     "recovery.spike_factor=3.0 with fault tolerance"),
])
def test_settings_torchft_cannot_run_are_one_line_and_status_2(capsys, monkeypatch, args, says):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert run_argv(["--config", "train_configs/debug_model.toml", *FT, *args,
                     "--validate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_without_torchft_the_key_is_refused_naming_the_extra(capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    assert run_argv(["--config", "train_configs/debug_model.toml", *FT, "--validate"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("torchft is not installed: pip install 'composer-parallel[ft]'"), err

