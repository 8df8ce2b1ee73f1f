"""End-to-end runs of composer.train: learning, logs, validation, TensorBoard, Ctrl-C."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from composer.config import parse_args
from composer.testing.harness import ROOT, Run, launch, read_metrics, run_jobs, train

KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_second", "tflops", "mfu",
        "memory_gib", "step_time_s"}


def test_debug_model_learns_the_builtin_corpus(tmp_path):
    rows = train(tmp_path, 1, ["--config", "train_configs/debug_model.toml",
                               "--training.steps", "80", "--data.seq_len", "64",
                               "--metrics.log_freq", "5", "--validation.freq", "40"])
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert first > 5.0               # about ln(512) for an untrained model
    assert last < 2.8 < first / 1.8  # the bytes of English are far from uniform
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[1] < 3.0
    for row in rows:
        assert KEYS <= row.keys()
        assert row["mfu"] is None and row["tflops"] > 0 and row["tokens_per_second"] > 0
        assert math.isfinite(row["memory_gib"]) and row["memory_gib"] > 0.05


MIXED = ["--training.steps", "4", "--data.seq_len", "32", "--training.local_batch_size", "4",
         "--metrics.log_freq", "1", "--validation.enable", "false",
         "--metrics.enable_tensorboard", "false"]


def jsonl_run(here: Path) -> Run:
    """The non-built-in path end to end: datasets' json loader and an HF tokenizer."""
    from tests.unit.test_data import save_word_tokenizer
    tokenizer = save_word_tokenizer(here / "tokenizer.json", ["<s>", "</s>"])
    with open(here / "docs.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"body": " ".join(["hello", "world"][(i + k) % 2]
                                                 for k in range(40))}) + "\n")
    return Run(2, ["--data.dataset", str(here / "docs.jsonl"), "--data.text_field", "body",
                   "--data.tokenizer", tokenizer, "--data.seq_len", "16",
                   "--training.local_batch_size", "4", "--training.steps", "12",
                   "--metrics.log_freq", "4", "--validation.freq", "12", "--optimizer.lr", "3e-3",
                   "--metrics.enable_tensorboard", "false"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every multi-rank run of this file, in one launch."""
    here = tmp_path_factory.mktemp("train_runs")
    return run_jobs({
        "four_ranks": Run(4, ["--config", "train_configs/debug_model.toml", "--training.steps", "4",
                              "--data.seq_len", "32", "--training.local_batch_size", "2",
                              "--metrics.log_freq", "2", "--validation.freq", "4"]),
        # FSDP2 MixedPrecisionPolicy; DDP autocast
        **{f"bfloat16_zero{zero}": Run(2, MIXED + ["--parallelism.zero_stage", zero,
                                                    "--training.mixed_precision_param", "bfloat16"])
           for zero in ("3", "0")},
        "jsonl": jsonl_run(here),
        "moe": Run(2, ["--config", "train_configs/moe_debug.toml", "--training.steps", "40",
                       "--data.seq_len", "64", "--training.local_batch_size", "4",
                       "--metrics.log_freq", "10", "--validation.freq", "20",
                       "--metrics.expert_load"]),
    }, here)


@pytest.mark.slow
def test_four_ranks_write_metrics_and_tensorboard(runs):
    rows = runs["four_ranks"].rows()
    folder = runs["four_ranks"].folder
    assert [r["step"] for r in rows] == [2, 4]
    assert "val_loss" in rows[-1]
    events = list((folder / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1  # rank 0 only
    acc = EventAccumulator(str(folder / "tb"))
    acc.Reload()
    scalars = acc.Scalars("loss")
    assert [e.step for e in scalars] == [2, 4]
    for event, row in zip(scalars, rows):  # TensorBoard keeps float32
        assert abs(event.value - row["loss"]) <= 1e-6 * row["loss"]
    assert "val_loss" in acc.Tags()["scalars"]


LAUNCHER = [sys.executable, "-m", "composer.train", "--nproc", "2"]  # composer's own


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_ctrl_c_stops_cleanly(tmp_path, nproc):
    """Ctrl-C: the process (with 2 ranks, composer's launcher, which passes it on) stops
    at once with one line and exit status 130."""
    cmd = [*([sys.executable, "-m", "composer.train"] if nproc == 1 else LAUNCHER),
           "--job.dump_folder", str(tmp_path),
           "--training.steps", "100000", "--data.seq_len", "32", "--metrics.log_freq", "1",
           "--validation.enable", "false", "--metrics.enable_tensorboard", "false"]
    # The child starts with SIGINT's default action: it inherits an ignored one otherwise
    # (the full tier's process ignores it by then), and Python then never raises Ctrl-C.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                            "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        while not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try:  # stopping gets as long as starting: the full tier's launches share the cores
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            pytest.fail(f"still running 120 s after SIGINT:\n{proc.communicate(timeout=30)[0]}")
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    after = out[out.index("interrupted at step"):].strip().splitlines()
    assert len(after) == 1 and "Traceback" not in out, out  # the one line, and nothing else
    rows = read_metrics(tmp_path)  # every line is whole JSON
    assert rows and rows[-1]["step"] < 100000


LEFT_IN_FLIGHT = """
import sys, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from composer.cli.run import finish
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)  # as a stopped step leaves it
dist.destroy_process_group()
print("the run's one line", flush=True)
finish(int(sys.argv[2]))
"""


@pytest.mark.parametrize("code", [130, pytest.param(0, marks=pytest.mark.slow)])
def test_a_collective_a_stopped_step_left_in_flight_adds_no_lines(tmp_path, code):
    """Ctrl-C (or a fault) between a functional collective and its wait leaves it in
    torch's registry, and torch warns at exit in six lines under the run's one. A run
    that stopped ends without them; one that finished (which leaves none) keeps torch's
    warning, which then points at a real bug."""
    out = subprocess.run([sys.executable, "-c", LEFT_IN_FLIGHT, str(tmp_path / "rdzv"),
                          str(code)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == code, out.stderr
    assert out.stdout == "the run's one line\n"
    assert ("unwaited collective calls" in out.stderr) == (code == 0), out.stderr


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sigterm_saves_the_step_every_rank_is_in_and_exits_143(tmp_path, nproc):
    """SIGTERM (to the process; with 2 ranks to composer's launcher, which passes it on)
    stops the run at the end of a step all ranks agree on through the job's store: that
    step is saved, each rank says so in one line and exits 143, and so does the launcher;
    a second run resumes from it."""
    args = ["--job.dump_folder", str(tmp_path), "--training.steps", "100000",
            "--data.seq_len", "32", "--metrics.log_freq", "1", "--validation.enable", "false",
            "--metrics.enable_tensorboard", "false", "--checkpoint.enable",
            "--checkpoint.interval", "1000"]
    run = [sys.executable, "-m", "composer.train"] if nproc == 1 else LAUNCHER
    proc = subprocess.Popen([*run, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.time() + 120
        while not (tmp_path / "metrics.jsonl").exists() or len(read_metrics(tmp_path)) < 2:
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    last = read_metrics(tmp_path)[-1]["step"]
    stops = [line for line in out.splitlines() if "SIGTERM: stopped after step" in line]
    assert len(stops) == nproc and all(f"step {last}; saved" in line for line in stops), out
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*")) == [f"step-{last}"]
    assert proc.returncode == 143 and "Traceback" not in out, out
    rows = train(tmp_path, 1, args[2:] + ["--training.steps", str(last + 1)])
    assert [r["step"] for r in rows] == list(range(1, last + 2))  # resumed: one more step


def test_the_launcher_prints_only_composers_line_on_a_config_error(tmp_path):
    """A layout the job's world refuses: the launcher checks the job for that world before
    it starts a rank, so the error is one line at once, with its status."""
    out = subprocess.run([*LAUNCHER, "--job.dump_folder", str(tmp_path),
                          "--parallelism.tensor_parallel_degree", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [
        line for line in out.stderr.splitlines() if line.startswith("error: world size 2")], out
    assert out.stdout == "", out.stdout


@pytest.fixture(scope="module")
def float32_losses(tmp_path_factory):
    rows = train(tmp_path_factory.mktemp("fp32"), 1, MIXED + ["--training.local_batch_size", "8"])
    return [r["loss"] for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["3", "0"])  # FSDP2 MixedPrecisionPolicy; DDP autocast
def test_bfloat16_compute_tracks_float32(runs, float32_losses, zero):
    losses = [r["loss"] for r in runs[f"bfloat16_zero{zero}"].rows()]
    assert losses != float32_losses  # bf16 really ran
    assert losses == pytest.approx(float32_losses, rel=2e-2)


def test_print_config_is_the_resolved_toml(tmp_path):
    result = launch(["--config", "train_configs/debug_model.toml", "--training.steps", "7",
                     "--print-config"])
    assert result.returncode == 0, result.stderr
    (tmp_path / "resolved.toml").write_text(result.stdout)
    resolved, _ = parse_args(["--config", str(tmp_path / "resolved.toml")])
    expected, _ = parse_args(["--config", "train_configs/debug_model.toml",
                              "--training.steps", "7"])
    assert resolved == expected and resolved.training.steps == 7


@pytest.mark.slow
def test_trains_on_a_local_jsonl_with_a_tokenizer_json(runs):
    rows = runs["jsonl"].rows()
    # alternating words are perfectly predictable: the loss must fall far below ln(512)
    assert rows[0]["loss"] > 2.0 and rows[-1]["loss"] < 1.0 and rows[-1]["val_loss"] < 1.0


@pytest.mark.slow
def test_moe_config_learns_with_router_statistics_in_every_log(runs, tmp_path):
    rows, folder = runs["moe"].rows(), runs["moe"].folder
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0 and rows[-1]["val_loss"] < 3.5
    tokens = 2 * 4 * 64 * 2  # ranks x batch x seq x top_k, per layer
    for row in rows:
        load = row["moe_tokens_per_expert"]
        assert len(load) == 3 and all(sum(layer) == tokens for layer in load)  # 3 MoE layers
        assert row["moe_tokens_mean"] == tokens / 8
        assert row["moe_tokens_min"] == min(map(min, load))
        assert row["moe_tokens_max"] == max(map(max, load))
        assert row["moe_imbalance"] == max(max(layer) for layer in load) / (tokens / 8)
        assert 0 < row["moe_aux_loss"] < 0.1  # 3 layers x coef 0.01 x about 1 when balanced
    log = runs["moe"].log()
    assert "moe max/mean" in log and "aux 0.0" in log
    quiet = train(tmp_path / "quiet", 1, ["--model.name", "moe", "--training.steps", "1",
                                          "--data.seq_len", "32", "--validation.enable", "false",
                                          "--metrics.log_freq", "1"])
    assert "moe_imbalance" in quiet[0] and "moe_tokens_per_expert" not in quiet[0]  # off by default
    acc = EventAccumulator(str(folder / "tb"))
    acc.Reload()
    assert {"moe_imbalance", "moe_aux_loss", "moe_tokens_max"} <= set(acc.Tags()["scalars"])


OPTIONAL = ("datasets", "transformers", "safetensors", "tensorboard", "torchao")


def test_a_run_on_the_builtin_corpus_imports_no_optional_package(tmp_path):
    """Start-up: each rank pays only for what its run uses. A run on the built-in
    corpus without TensorBoard imports none of the optional packages."""
    code = ("import json, sys\nfrom composer.cli.run import run_argv\n"
            f"code = run_argv(['--job.dump_folder', {str(tmp_path)!r}, '--training.steps', '1',"
            " '--data.seq_len', '32', '--validation.enable', 'false',"
            " '--metrics.enable_tensorboard', 'false'])\n"
            f"print(json.dumps([code, [m for m in {OPTIONAL!r} if m in sys.modules]]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1",
                                              "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [0, []]
    assert read_metrics(tmp_path)[0]["step"] == 1
