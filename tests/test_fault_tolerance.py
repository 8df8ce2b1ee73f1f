"""Fault-tolerant replica groups (composer.fault_tolerance) with a real torchft
lighthouse on 127.0.0.1 and each group its own torchrun."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from composer.cli import run_argv
from tests.harness import PARITY, launch_env, read_metrics, run_side_by_side
from tests.test_parity import RTOL, relative_error

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


@pytest.mark.slow
def test_two_groups_that_lose_none_match_hsdp_and_one_process(tmp_path, reference):
    """Two groups of FSDP2 x2 joined by torchft take the steps of HSDP with two replicas:
    the 1-process run's losses at 1e-9 (float64), every row naming both groups, and
    run.json the settings and no heal."""
    port = free_port()
    lighthouse = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "2",
                                   "--join_timeout_ms", "5000", "--bind", f"[::]:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env=launch_env())
    try:
        cmds = [group_command(g, tmp_path, f"http://127.0.0.1:{port}",
                              ["--parallelism.zero_stage", "3"]) for g in (0, 1)]
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

