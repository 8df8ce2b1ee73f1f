"""scripts/gpu_check.sh: the GPU self-check. Here (no GPU) its shell syntax, its
dry run (the five checks' commands, each validated; also from a tree that is
not pip-installed), its one-line refusal without a GPU, what each check makes of
its output, the budget and timeouts, and the table and exit status of a whole
run over stand-in commands. On a machine with CUDA the real run is a test too."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from composer.testing.harness import ROOT, launch_env, run_command

SCRIPT = ["bash", "scripts/gpu_check.sh"]
TITLES = ["1 init: cuda vs cpu weights", "2 debug: bf16 + compile",
          "3 llama3 1B: bf16 + compile + selective AC", "4 float8 vs bf16 (llama3 1B)",
          "5 planner peak vs measured (llama3 1B)", "6 flex vs SDPA (seq 8192, bf16)",
          "7 CP2 (flex) vs one GPU (2 GPUs)", "8 dry run vs measured peak (llama3 8B)"]
TORCHAO = importlib.util.find_spec("torchao") is not None


def load_helper():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gc = load_helper()


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The final table's rows by check title: [title, figure, expected, result]."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in TITLES:
            rows[cells[0]] = cells
    return rows


# ---------------------------------------------------------------- the shell script

def test_wrapper_syntax():
    assert subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=ROOT).returncode == 0


def assert_dry_run(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for title in TITLES:  # once in the plan, once in the table
        assert out.count(title) == 2, title
    commands = [line.strip() for line in out.splitlines() if line.startswith("      python")]
    assert len(commands) == 8
    init, debug, bf16, fp8, planner, flex, cp2, dry = commands
    assert flex == "python scripts/gpu_flex_check.py" and cp2 == flex + " --cp2"
    assert dry == "python scripts/gpu_dry_run_check.py --timeout 110"
    assert init == "python scripts/gpu_check.py --init-weights"
    for train in (debug, bf16, fp8):
        assert train.startswith("python -m composer.train --config train_configs/debug_model.toml")
        assert "--compile.enable true" in train
        assert "--training.mixed_precision_param bfloat16" in train
    for llama in (bf16, fp8, planner):
        assert "--model.flavor 1B" in llama and "--activation_checkpoint.mode selective_op" in llama
    assert "--model.converters float8" in fp8 and "float8" not in bf16
    # the planner predicts exactly the bf16 run's job
    assert planner.startswith("python -m composer.planner --config train_configs/debug_model.toml")
    assert planner.endswith("--cluster h200-141gb --world-size 1 --json")
    job = bf16.split("--config train_configs/debug_model.toml ")[1].split(" --job.dump_folder")[0]
    assert job in planner
    rows = table_rows(out)
    assert rows[TITLES[0]][1:] == ["plan_job + build_model (cpu)", "41 tensors, 951,424 values",
                                   "OK"]
    for title in TITLES[1:4]:
        assert rows[title][1] == "composer.train --validate"
    assert rows[TITLES[1]][2:] == rows[TITLES[2]][2:] == ["config ok for 1 rank(s)", "OK"]
    assert rows[TITLES[3]][2:] == (["config ok for 1 rank(s)", "OK"] if TORCHAO
                                   else ["torchao is not installed", "SKIP"])
    assert rows[TITLES[4]][1] == "composer.planner --json" and rows[TITLES[4]][3] == "OK"
    peak = float(rows[TITLES[4]][2].split("predicted peak ")[1].split(" GiB")[0])
    assert 20 < peak < 60  # 1B with fp32 state and AdamW: 18.4 GiB before any activation
    for title, script in zip(TITLES[5:], ("gpu_flex_check.py",) * 2 + ("gpu_dry_run_check.py",)):
        assert rows[title][1:] == ["imports, parser", f"{script} ok", "OK"]


@pytest.mark.slow  # real subprocesses (seconds each): the outer tier
def test_dry_run_lists_and_validates_the_eight_checks_from_a_tree_that_is_not_installed(tmp_path):
    # A sitecustomize (run after the .pth files) drops the editable install's finder
    # from every process, as on a machine that got a copy of the tree and no install.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n")
    env = {**launch_env(), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    plain = run_command([sys.executable, "-c", "import composer.models"], timeout=60, env=env)
    assert plain.returncode == 1 and "No module named 'composer.models'" in plain.stderr
    env["PYTHONPATH"] = str(tmp_path)  # the wrapper adds the tree itself
    start = time.monotonic()
    result = run_command(SCRIPT + ["--dry-run"], timeout=120, env=env)
    seconds = time.monotonic() - start
    assert_dry_run(result)
    assert seconds < 40, f"the dry run took {seconds:.1f} s"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_without_a_gpu_one_line_and_exit_2():
    result = run_command(SCRIPT, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: no CUDA device is visible (torch.cuda.is_available() is False): the GPU "
        "self-check needs one; --dry-run checks its plan on this machine"]


# ---------------------------------------------------------------- the dry run's validation

def test_a_renamed_key_breaks_the_dry_run(tmp_path, capsys):
    steps = gc.plan_steps(tmp_path)
    debug = steps[1]
    debug.argv = [a.replace("--compile.enable", "--compile.enabled") for a in debug.argv]
    planner = steps[4]
    planner.argv = [a.replace("h200-141gb", "h200-141g") for a in planner.argv]
    assert gc.dry_run(steps, tmp_path, 290) == 1
    rows = table_rows(capsys.readouterr().out)
    assert rows[TITLES[1]][2:] == [
        "error: unknown key 'compile.enabled' (did you mean 'compile.enable'?)", "FAIL"]
    assert rows[TITLES[4]][2].startswith("error: --cluster: unknown cluster 'h200-141g'")
    assert rows[TITLES[4]][3] == "FAIL"
    assert rows[TITLES[2]][3] == "OK"


def test_float8_skips_without_torchao(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "torchao_missing", lambda: True)
    step = gc.plan_steps(tmp_path)[3]

    class NoRun:
        def run(self, step):
            raise AssertionError("float8 ran without torchao")

    result = gc.check_float8(step, NoRun(), {})
    assert (result.figure, result.status) == ("torchao is not installed (float8 needs it)", "SKIP")
    assert gc.validate_train(step).status == "SKIP"


# ---------------------------------------------------------------- what the checks make of rows

def test_loss_trend():
    rows = [{"step": s, "loss": v} for s, v in ((1, 6.2), (2, 5.0), (3, 4.1))]
    assert gc.loss_trend(rows) == (True, "loss 6.200 -> 4.100 in 3 steps")
    assert gc.loss_trend(rows[::-1])[0] is False
    assert gc.loss_trend([rows[0], {"step": 2, "loss": math.nan}, rows[2]]) == (
        False, "non-finite loss at step 2")
    assert gc.loss_trend(rows[:1]) == (False, "1 metrics row(s)")


def test_throughput_leaves_out_the_compiling_window():
    rows = [{"step": 10, "loss": 9.0, "tokens_per_second": 10.0, "mfu": 0.01, "memory_gib": 30.0},
            {"step": 20, "loss": 8.0, "tokens_per_second": 100.0, "mfu": 0.40, "memory_gib": 31.0},
            {"step": 30, "loss": 7.0, "tokens_per_second": 120.0, "mfu": 0.44, "memory_gib": 31.0}]
    t = gc.throughput(rows)
    assert t["tokens_per_second"] == 110.0 and t["mfu"] == pytest.approx(0.42)
    assert t["memory_gib"] == 31.0 and t["loss_finite"]
    assert gc.throughput([{**r, "mfu": None} for r in rows])["mfu"] is None


def test_float8_and_memory_verdicts():
    bf16 = {"tokens_per_second": 50_000.0}
    fast = {"tokens_per_second": 60_000.0, "loss_finite": True}
    assert gc.float8_verdict(bf16, fast) == ("PASS", "60,000 tok/s = 1.200x bf16's 50,000")
    assert gc.float8_verdict(bf16, {**fast, "tokens_per_second": 45_000.0})[0] == "FAIL"
    assert gc.float8_verdict(bf16, {**fast, "loss_finite": False}) == (
        "FAIL", "60,000 tok/s, non-finite loss")
    assert gc.float8_verdict(None, fast)[0] == "FAIL"
    assert gc.memory_verdict(33.0, 30.5) == (
        "PASS", "predicted 33.00 GiB / measured 30.50 GiB = 1.082")
    assert gc.memory_verdict(34.0, 30.0)[0] == "FAIL"
    assert gc.memory_verdict(26.0, 30.0)[0] == "FAIL"
    bad = {"causal": FLEX_FIGURES, "documents": {**FLEX_FIGURES, "max_rel": 3e-2}}
    assert gc.flex_verdict(bad)[0] == "FAIL"


def test_compare_states():
    want = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    same = gc.compare_states({k: v.clone() for k, v in want.items()}, want)
    assert same == {"tensors": 2, "max_abs": 0.0, "max_rel": 0.0, "worst": "b"}
    got = {"a": torch.tensor([1.0, -2.2]), "b": torch.tensor([0.5])}
    d = gc.compare_states(got, want)
    assert d["worst"] == "a" and d["max_abs"] == pytest.approx(0.2)
    assert d["max_rel"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="different tensors"):
        gc.compare_states({"a": want["a"]}, want)


# ---------------------------------------------------------------- budget, timeouts, the table

@pytest.mark.slow  # real subprocesses (seconds each): the outer tier
def test_a_hung_step_is_killed_with_its_children(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "MIN_STEP_S", 1)
    child = tmp_path / "child.pid"
    hang = gc.Step("hang", "hang", [sys.executable, "-c",
                   "import subprocess, sys, time; p = subprocess.Popen(['sleep', '120']); "
                   f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(120)"], 3)
    outcome = gc.Runner(tmp_path, 60).run(hang)
    assert not outcome.ok and outcome.note == "timed out after 3 s" and outcome.seconds < 10
    pid = int(child.read_text())
    time.sleep(0.2)
    state = Path(f"/proc/{pid}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z", "the step's child survived"
    spent = gc.Runner(tmp_path, 0.5).run(hang)
    assert (spent.ok, spent.note, spent.log) == (False, "not run: the 0 s budget is spent", None)


def stand_in(step, script: str, *args: str):
    """``step`` with its command replaced by a quick Python one (no training)."""
    step.argv = [sys.executable, "-c", script, *args]
    return step


WRITE_ROWS = ("import os, sys; os.makedirs(sys.argv[1], exist_ok=True); "
              "open(os.path.join(sys.argv[1], 'metrics.jsonl'), 'w').write(sys.argv[2])")
PRINT = "import sys; print('some log line'); print(sys.argv[1])"


def rows_text(tps: float, memory: float) -> str:
    rows = [{"step": s, "loss": 8.0 - s / 10, "tokens_per_second": tps, "mfu": 0.4,
             "memory_gib": memory} for s in (10, 20, 30)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def stand_in_steps(out: Path, float8_tps: float) -> list:
    init, debug, bf16, fp8, planner, flex, cp2, dry = gc.plan_steps(out)
    return [stand_in(init, PRINT, json.dumps({"tensors": 41, "max_abs": 0.0, "max_rel": 0.0,
                                              "worst": "norm.weight"})),
            stand_in(debug, WRITE_ROWS, str(out / "debug"), rows_text(1.0, 1.0)),
            stand_in(bf16, WRITE_ROWS, str(out / "llama1b"), rows_text(50_000.0, 30.0)),
            stand_in(fp8, WRITE_ROWS, str(out / "float8"), rows_text(float8_tps, 28.0)),
            stand_in(planner, PRINT, json.dumps({"memory_gib": {"peak": 31.0}})),
            stand_in(flex, PRINT, json.dumps({name: FLEX_FIGURES for name in
                                              ("causal", "documents")})),
            cp2,  # no two GPUs here: skipped before it runs
            stand_in(dry, PRINT, "dry run of llama3_8b.toml: ratio 1.010 PASS")]


FLEX_FIGURES = {"max_rel": 4e-3, "flex_seconds": 0.002, "sdpa_seconds": 0.003,
                "flex_mask_bytes": 4096, "sdpa_mask_bytes": 0}


def test_a_run_prints_one_table_and_fails_on_any_fail(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gc, "torchao_missing", lambda: False)
    assert gc.gpu_run(stand_in_steps(tmp_path, 60_000.0), tmp_path, 60) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [rows[t][3] for t in TITLES] == ["PASS"] * 6 + ["SKIP", "PASS"]
    assert rows[TITLES[0]][1] == "41 tensors: max abs 0.00e+00, max rel 0.00e+00 (norm.weight)"
    assert rows[TITLES[1]][1] == "loss 7.000 -> 5.000 in 30 steps"
    assert rows[TITLES[2]][1] == "50,000 tok/s, MFU 40.0%, peak 30.00 GiB"
    assert rows[TITLES[3]][1] == "60,000 tok/s = 1.200x bf16's 50,000"
    assert rows[TITLES[4]][1] == "predicted 31.00 GiB / measured 30.00 GiB = 1.033"
    assert rows[TITLES[5]][1] == "; ".join(
        f"{name}: rel 4.0e-03, flex 2.0 ms / sdpa 3.0 ms, mask 4,096 B"
        for name in ("causal", "documents"))
    assert rows[TITLES[6]][1] == "0 GPU visible: CP2 needs two"
    assert rows[TITLES[7]][1] == "dry run of llama3_8b.toml: ratio 1.010 PASS"

    # float8 slower than bf16: FAIL, the others still PASS, the table still printed, exit 1
    assert gc.gpu_run(stand_in_steps(tmp_path, 40_000.0), tmp_path, 60) == 1
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [rows[t][3] for t in TITLES] == ["PASS", "PASS", "PASS", "FAIL", "PASS", "PASS",
                                            "SKIP", "PASS"]
    assert "--- float8: last lines of" in out and out.rstrip().endswith("|")


# ---------------------------------------------------------------- on a GPU

@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_run(tmp_path):
    result = run_command(SCRIPT + ["--out", str(tmp_path)], timeout=700)
    rows = table_rows(result.stdout)
    assert list(rows) == TITLES, result.stdout[-3000:]
    assert all(rows[t][3] in ("PASS", "SKIP") for t in TITLES), result.stdout[-4000:]
    assert result.returncode == 0
