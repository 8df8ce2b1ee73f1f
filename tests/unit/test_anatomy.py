"""Where a step's time goes, the run record and the profiler, in one-process runs
(the multi-rank anatomy, a slowed rank named the straggler and its peer's wait in
tensor parallel's collectives, is proven in tests/integration/test_plugins.py)."""
from __future__ import annotations

import json
import time

import pytest

from composer.data.loader import DataLoader
from composer.observe.timing import overlap_length, union_length
from composer.testing.harness import PARITY, run_here

PHASES = ("data_wait_s", "forward_s", "backward_s", "optimizer_s")
QUICK = ["--training.steps", "4", "--training.local_batch_size", "2", "--data.seq_len", "32",
         "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
         "--validation.enable", "false"]


def test_interval_arithmetic():
    assert union_length([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == 3.0
    assert union_length([(0.0, 4.0), (1.0, 2.0)]) == 4.0
    assert union_length([]) == 0.0
    assert overlap_length([(0.0, 2.0), (3.0, 5.0)], [(1.0, 4.0)]) == 2.0
    assert overlap_length([(0.0, 1.0)], [(2.0, 3.0)]) == 0.0


def log_text(job) -> str:
    return (job.logs / "rank0.log").read_text()


def test_phases_add_up_to_the_step_and_a_quick_run_warns_of_nothing(tmp_path):
    """Summed over steps 2-8 (the first window also holds the start-up), of about 70 ms
    each: the step's own untimed bookkeeping (about 1 ms) is then 2-3% of it, and a
    step the other test worker's launch preempts between two phases, which can miss a
    quarter of itself, a few percent of the seven."""
    job = run_here(tmp_path, [*QUICK, "--training.steps", "8", "--training.local_batch_size",
                              "8", "--data.seq_len", "64"])
    rows = job.rows()[1:]
    steps = sum(row["step_time_s"] for row in rows)
    assert sum(row[k] for row in rows for k in PHASES) == pytest.approx(steps, rel=0.10)
    assert sum(row["data_wait_s"] for row in rows) < 0.05 * steps
    assert "comm_s" not in rows[-1] and "slowest_rank" not in rows[-1]  # one process: none
    assert "WARNING" not in log_text(job) and "the bottleneck" not in log_text(job)
    assert "loss" in log_text(job) and "comm" not in log_text(job)  # one process: none


def test_a_slow_loader_is_named_once(tmp_path, monkeypatch):
    next_batch = DataLoader.next_batch

    def slow(self):
        time.sleep(0.1)
        return next_batch(self)
    monkeypatch.setattr(DataLoader, "next_batch", slow)
    job = run_here(tmp_path, QUICK)
    for row in job.rows():
        assert 0.1 <= row["data_wait_s"] < 0.2
    text = log_text(job)
    assert text.count("the bottleneck") == 1
    assert "data loading is" in text and "the loader (data.dataset='tinyshakespeare')" in text


def test_one_slow_batch_is_not_a_slow_loader(tmp_path, monkeypatch):
    """Step 2's batch waits 0.1 s (as when the machine preempts the loader once); steps
    3 and 4 wait for nothing: the wait shows in step 2's row, and no step warns. Steps of
    some 4k tokens, so that the loader's own jitter on a busy machine stays under the
    warning's share of the step."""
    next_batch, calls = DataLoader.next_batch, []

    def once_slow(self):
        calls.append(1)
        if len(calls) == 2:
            time.sleep(0.1)
        return next_batch(self)
    monkeypatch.setattr(DataLoader, "next_batch", once_slow)
    job = run_here(tmp_path, [*QUICK, "--data.seq_len", "512", "--training.local_batch_size", "8"])
    waits = [row["data_wait_s"] for row in job.rows()]
    assert waits[1] >= 0.1 and max(waits[2:]) < 0.05, waits
    assert "the bottleneck" not in log_text(job)


def test_the_anatomy_can_be_turned_off(tmp_path):
    rows = run_here(tmp_path, [*QUICK, "--metrics.step_anatomy", "false"]).rows()
    assert not set(PHASES) & set(rows[-1])


def test_the_run_record_reruns_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_COMPOSER_TEST", "1")
    monkeypatch.setenv("UNRELATED_TEST_VARIABLE", "1")
    first = run_here(tmp_path / "a", [*PARITY, "--training.local_batch_size", "4"]).rows()
    record = json.loads((tmp_path / "a" / "run.json").read_text())
    assert record["world_size"] == 1 and record["seed"] == 0 and record["resumes"] == []
    assert record["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}
    assert record["versions"]["torch"] and record["versions"]["python"]
    assert len(record["hosts"]) == len(record["devices"]) == 1
    assert (record["env"]["TORCH_COMPOSER_TEST"] == "1"
            and "UNRELATED_TEST_VARIABLE" not in record["env"])
    assert record["git"] is None or len(record["git"]["commit"]) == 40
    # nothing but the dumped config: the same float64 losses, bit for bit
    again = run_here(tmp_path / "b", ["--config", str(tmp_path / "a" / "config.toml")],
                     name="again").rows()
    assert [r["loss"] for r in again] == [r["loss"] for r in first]
    assert [r.get("val_loss") for r in again] == [r.get("val_loss") for r in first]


def test_profiling_traces_the_window(tmp_path):
    run_here(tmp_path, [*QUICK, "--profiling.enable", "--profiling.start_step", "2"])
    trace = tmp_path / "profile" / "rank0.steps-2-3.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e["name"].startswith("step ")}
    assert steps == {"step 2", "step 3"}
    assert any(e["name"].startswith("aten::mm") for e in events)
    assert [p.name for p in (tmp_path / "profile").iterdir()] == [trace.name]


def test_profiling_is_off_by_default(tmp_path):
    run_here(tmp_path, QUICK)
    assert not (tmp_path / "profile").exists()
