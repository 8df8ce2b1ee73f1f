"""GPU self-check: eight short checks on one GPU, one table at the end.

    bash scripts/gpu_check.sh [--out DIR] [--budget S]   # one GPU, about 9 minutes, no downloads
    bash scripts/gpu_check.sh --dry-run                  # anywhere: the plan, commands validated

1. init: the debug model through composer's build (plan_job -> build_model) on
   cuda and on cpu, one process, same seed: every tensor equal to float32 tolerance;
2. debug: bf16 + compile through ``python -m composer.train``: finite, falling loss;
3. llama3 1B: bf16 + compile + selective AC: tokens/s, MFU, peak memory (metrics.jsonl);
4. float8: 3 with the float8 converter, its tokens/s over 3's (SKIP without torchao);
5. planner: ``python -m composer.planner --json`` for 3's job on h200-141gb, its
   predicted peak against 3's measured one;
6. flex: FlexAttention against SDPA at sequence 8192, causal and with documents: outputs
   and gradients, time, mask bytes (``scripts/gpu_flex_check.py``);
7. cp2: context parallel x2 under FlexAttention against one GPU's losses (SKIP with
   fewer than two GPUs);
8. dry run: ``composer.train --dry-run`` of llama3_8b.toml against a real step's
   ``max_memory_allocated`` (``scripts/gpu_dry_run_check.py``).

Each step is a subprocess with a timeout, all inside one budget. A failing check
is FAIL in the table and exit status 1; no GPU (and no --dry-run): one line, exit 2.
Run through the wrapper, which makes a tree that was never pip-installed importable.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from composer.cli.run import run_argv as train_main
from composer.config import parse_args
from composer.job.plan import plan_job
from composer.planner.cli import main as planner_main
from composer.trainer.build import build_model

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "debug_model.toml"
CLUSTER = "h200-141gb"
BUDGET_S = 540            # all steps together: the check fits 10 minutes with start-up
MIN_STEP_S = 10           # a step left less than this is not started

INIT_RTOL = 1e-5          # per tensor: max |cuda - cpu| / max |cpu|, float32 tolerance
MFU_FLOOR = 0.20          # below it bf16 matmuls or compile did not take effect
FLOAT8_MIN_RATIO = 1.0    # float8 must not be slower than bf16
MEMORY_TOLERANCE = 0.10   # the planner's stated tolerance (benchmarks/bench_planner.py)
FLEX_RTOL = 2e-2          # flex vs SDPA in bf16: outputs and gradients over the largest output
CP2_RTOL = 1e-4           # CP2 vs one GPU, float32 losses
PASS = {True: "PASS", False: "FAIL"}

QUIET = ["--validation.enable", "false", "--metrics.enable_tensorboard", "false"]
DEBUG_RUN = [*QUIET, "--training.mixed_precision_param", "bfloat16", "--compile.enable", "true",
             "--training.steps", "20", "--metrics.log_freq", "1",
             "--lr_scheduler.warmup_steps", "2"]
# Llama 3.2 1B keeps its 128,256-entry vocabulary over the byte tokenizer's ids:
# the cost of the real model. Causal attention (no document mask): the kernel
# Llama pre-training runs; the debug run covers the masked path.
LLAMA_1B = [*QUIET, "--model.flavor", "1B", "--data.seq_len", "2048",
            "--data.document_mask", "false", "--training.local_batch_size", "4",
            "--training.mixed_precision_param", "bfloat16",
            "--training.mixed_precision_reduce", "float32",
            "--activation_checkpoint.mode", "selective_op", "--compile.enable", "true",
            "--training.steps", "30", "--metrics.log_freq", "10",
            "--optimizer.lr", "3e-4", "--lr_scheduler.warmup_steps", "10"]
FLOAT8 = ["--model.converters", "float8", "--float8.recipe", "tensorwise"]


@dataclass
class Step:
    key: str
    title: str
    argv: list[str]
    timeout_s: int
    folder: str = ""      # a training run's dump folder under the run folder


@dataclass
class Result:
    check: str
    figure: str
    expected: str
    status: str           # PASS, FAIL, SKIP (dry run: OK, FAIL, SKIP)


@dataclass
class Outcome:
    ok: bool
    note: str             # why not, when not ok
    log: Path | None
    seconds: float = 0.0


def train_step(key: str, title: str, out: Path, args: list[str], timeout_s: int) -> Step:
    argv = [sys.executable, "-m", "composer.train", "--config", str(CONFIG), *args,
            "--job.dump_folder", str(out / key)]
    return Step(key, title, argv, timeout_s, folder=key)


def plan_steps(out: Path) -> list[Step]:
    py = sys.executable
    return [
        Step("init", "1 init: cuda vs cpu weights",
             [py, str(Path(__file__).resolve()), "--init-weights"], 90),
        train_step("debug", "2 debug: bf16 + compile", out, DEBUG_RUN, 120),
        train_step("llama1b", "3 llama3 1B: bf16 + compile + selective AC", out, LLAMA_1B, 150),
        train_step("float8", "4 float8 vs bf16 (llama3 1B)", out, LLAMA_1B + FLOAT8, 150),
        Step("planner", "5 planner peak vs measured (llama3 1B)",
             [py, "-m", "composer.planner", "--config", str(CONFIG), *LLAMA_1B,
              "--cluster", CLUSTER, "--world-size", "1", "--json"], 60),
        Step("flex", "6 flex vs SDPA (seq 8192, bf16)",
             [py, str(ROOT / "scripts" / "gpu_flex_check.py")], 150),
        Step("cp2", "7 CP2 (flex) vs one GPU (2 GPUs)",
             [py, str(ROOT / "scripts" / "gpu_flex_check.py"), "--cp2"], 150),
        Step("dryrun", "8 dry run vs measured peak (llama3 8B)",
             [py, str(ROOT / "scripts" / "gpu_dry_run_check.py"), "--timeout", "110"], 240),
    ]


def shown(argv: list[str]) -> str:
    """The command as a person would type it from the repository root."""
    text = shlex.join(["python", *argv[1:]])
    return text.replace(str(ROOT) + "/", "")


def torchao_missing() -> bool:
    return importlib.util.find_spec("torchao") is None


# ---- check 1's two builds (run as a subprocess: ``gpu_check.py --init-weights``)

def initial_state(device: str) -> dict[str, torch.Tensor]:
    """The debug model's initial parameters and buffers as composer builds them
    for one process on ``device``, in float32 on the CPU."""
    cfg, _ = parse_args(["--config", str(CONFIG), "--job.device", device])
    parts = build_model(plan_job(cfg, 0, 1))
    return {name: t.detach().to("cpu", torch.float32) for part in parts
            for name, t in [*part.named_parameters(), *part.named_buffers()]}


def compare_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict:
    """Max abs difference, and max over tensors of max |diff| / max |want|."""
    if got.keys() != want.keys():
        raise ValueError(f"different tensors: {sorted(got.keys() ^ want.keys())}")
    max_abs, max_rel, worst = 0.0, 0.0, ""
    for name, w in want.items():
        diff = (got[name] - w).abs().max().item()
        rel = diff / max(w.abs().max().item(), torch.finfo(torch.float32).tiny)
        max_abs = max(max_abs, diff)
        if rel >= max_rel:
            max_rel, worst = rel, name
    return {"tensors": len(want), "max_abs": max_abs, "max_rel": max_rel, "worst": worst}


def init_parity() -> int:
    print(json.dumps(compare_states(initial_state("cuda"), initial_state("cpu"))))
    return 0


# ---- running one step

class Runner:
    """Runs steps as subprocesses (their own session, killed whole on timeout)
    inside one overall budget; each step's output goes to ``<out>/<key>.log``."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s = out, budget_s
        self.deadline = time.monotonic() + budget_s

    def run(self, step: Step) -> Outcome:
        timeout = min(step.timeout_s, self.deadline - time.monotonic())
        if timeout < MIN_STEP_S:
            return Outcome(False, f"not run: the {self.budget_s:.0f} s budget is spent", None)
        log = self.out / f"{step.key}.log"
        print(f"[{step.title}] running (timeout {timeout:.0f} s): {shown(step.argv)}", flush=True)
        start = time.monotonic()
        # cwd is the run folder, not the repository: `python -m` puts its cwd first on
        # sys.path, and the repository's composer/ lacks composer.models.
        with open(log, "w") as f:
            proc = subprocess.Popen(step.argv, cwd=self.out, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        seconds = time.monotonic() - start
        print(f"[{step.title}] {'timed out' if rc is None else f'exit {rc}'} after {seconds:.1f} s",
              flush=True)
        if rc is None:
            return Outcome(False, f"timed out after {timeout:.0f} s", log, seconds)
        if rc != 0:
            return Outcome(False, f"exit status {rc}: {last_line(log)}", log, seconds)
        return Outcome(True, "", log, seconds)


def last_line(log: Path) -> str:
    return last_text(log.read_text(errors="replace"))


def last_text(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][-160:] if lines else "no output"


def last_json(log: Path) -> dict:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"{log.name}: no JSON line")


def read_rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- what each check makes of its rows (pure: tested on CPU)

def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def loss_trend(rows: list[dict]) -> tuple[bool, str]:
    """Finite losses whose last is below the first."""
    if len(rows) < 2:
        return False, f"{len(rows)} metrics row(s)"
    bad = next((r["step"] for r in rows if not _finite(r.get("loss"))), None)
    if bad is not None:
        return False, f"non-finite loss at step {bad}"
    first, last = rows[0]["loss"], rows[-1]["loss"]
    return last < first, f"loss {first:.3f} -> {last:.3f} in {rows[-1]['step']} steps"


def throughput(rows: list[dict]) -> dict:
    """Tokens/s and MFU averaged over the windows after the first (it holds the
    compilation), and the run's peak memory (the allocator's, GiB)."""
    steady = rows[1:] or rows
    mfus = [r.get("mfu") for r in steady]
    return {"tokens_per_second": sum(r["tokens_per_second"] for r in steady) / len(steady),
            "mfu": None if None in mfus else sum(mfus) / len(mfus),
            "memory_gib": max(r["memory_gib"] for r in rows),
            "loss_finite": all(_finite(r.get("loss")) for r in rows)}


def float8_verdict(bf16: dict | None, fp8: dict) -> tuple[str, str]:
    figure = f"{fp8['tokens_per_second']:,.0f} tok/s"
    if not fp8["loss_finite"]:
        return "FAIL", figure + ", non-finite loss"
    if bf16 is None:
        return "FAIL", figure + ", no bf16 run to compare"
    ratio = fp8["tokens_per_second"] / bf16["tokens_per_second"]
    figure += f" = {ratio:.3f}x bf16's {bf16['tokens_per_second']:,.0f}"
    return PASS[ratio >= FLOAT8_MIN_RATIO], figure


def memory_verdict(predicted_gib: float, measured_gib: float) -> tuple[str, str]:
    ratio = predicted_gib / measured_gib
    figure = f"predicted {predicted_gib:.2f} GiB / measured {measured_gib:.2f} GiB = {ratio:.3f}"
    return PASS[abs(ratio - 1) <= MEMORY_TOLERANCE], figure


# ---- the five checks on a GPU; ``seen`` carries check 3's figures to 4 and 5

def check_init(step: Step, runner: Runner, seen: dict) -> Result:
    expected = f"max rel <= {INIT_RTOL:g} (float32)"
    ran = runner.run(step)
    if not ran.ok:
        return Result(step.title, ran.note, expected, "FAIL")
    d = last_json(ran.log)
    figure = (f"{d['tensors']} tensors: max abs {d['max_abs']:.2e}, "
              f"max rel {d['max_rel']:.2e} ({d['worst']})")
    return Result(step.title, figure, expected, PASS[d["max_rel"] <= INIT_RTOL])


def check_debug(step: Step, runner: Runner, seen: dict) -> Result:
    ran = runner.run(step)
    ok, figure = loss_trend(read_rows(runner.out / step.folder)) if ran.ok else (False, ran.note)
    return Result(step.title, figure, "finite, last loss < first", PASS[ok])


def check_llama(step: Step, runner: Runner, seen: dict) -> Result:
    expected = f"MFU >= {MFU_FLOOR:.0%}, finite loss"
    ran, rows = runner.run(step), read_rows(runner.out / step.folder)
    if not ran.ok or not rows:
        return Result(step.title, ran.note or "no metrics rows", expected, "FAIL")
    t = seen["llama1b"] = throughput(rows)
    mfu = "MFU n/a" if t["mfu"] is None else f"MFU {t['mfu']:.1%}"
    figure = f"{t['tokens_per_second']:,.0f} tok/s, {mfu}, peak {t['memory_gib']:.2f} GiB"
    return Result(step.title, figure, expected,
                  PASS[t["mfu"] is not None and t["mfu"] >= MFU_FLOOR and t["loss_finite"]])


def check_float8(step: Step, runner: Runner, seen: dict) -> Result:
    expected = f"float8 / bf16 tok/s >= {FLOAT8_MIN_RATIO:g}"
    if torchao_missing():
        return Result(step.title, "torchao is not installed (float8 needs it)", expected, "SKIP")
    ran, rows = runner.run(step), read_rows(runner.out / step.folder)
    if not ran.ok or not rows:
        return Result(step.title, ran.note or "no metrics rows", expected, "FAIL")
    status, figure = float8_verdict(seen.get("llama1b"), throughput(rows))
    return Result(step.title, figure, expected, status)


def check_planner(step: Step, runner: Runner, seen: dict) -> Result:
    expected = f"within {MEMORY_TOLERANCE:.0%} of check 3's measured peak"
    if "llama1b" not in seen:
        return Result(step.title, "not run: check 3 measured nothing", expected, "FAIL")
    ran = runner.run(step)
    if not ran.ok:
        return Result(step.title, ran.note, expected, "FAIL")
    status, figure = memory_verdict(last_json(ran.log)["memory_gib"]["peak"],
                                    seen["llama1b"]["memory_gib"])
    return Result(step.title, figure, expected, status)


def flex_verdict(d: dict) -> tuple[str, str]:
    """Flex within ``FLEX_RTOL`` of SDPA, causal and with documents."""
    parts, ok = [], True
    for name in ("causal", "documents"):
        r = d[name]
        ok = ok and r["max_rel"] <= FLEX_RTOL
        parts.append(f"{name}: rel {r['max_rel']:.1e}, flex {r['flex_seconds'] * 1e3:.1f} ms / "
                     f"sdpa {r['sdpa_seconds'] * 1e3:.1f} ms, mask {r['flex_mask_bytes']:,} B")
    return PASS[ok], "; ".join(parts)


def check_flex(step: Step, runner: Runner, seen: dict) -> Result:
    expected = f"max rel <= {FLEX_RTOL:g} (bf16)"
    ran = runner.run(step)
    if not ran.ok:
        return Result(step.title, ran.note, expected, "FAIL")
    status, figure = flex_verdict(last_json(ran.log))
    return Result(step.title, figure, expected, status)


def check_cp2(step: Step, runner: Runner, seen: dict) -> Result:
    expected = f"losses within {CP2_RTOL:g} (float32)"
    if torch.cuda.device_count() < 2:
        return Result(step.title, f"{torch.cuda.device_count()} GPU visible: CP2 needs two",
                      expected, "SKIP")
    ran = runner.run(step)
    if not ran.ok:
        return Result(step.title, ran.note, expected, "FAIL")
    worst = last_json(ran.log)["max_rel"]
    return Result(step.title, f"worst step loss rel {worst:.1e}", expected,
                  PASS[worst <= CP2_RTOL])


def check_dry_run(step: Step, runner: Runner, seen: dict) -> Result:
    ran = runner.run(step)  # the script's one line says PASS or FAIL, its status too
    return Result(step.title, last_line(ran.log) if ran.log else ran.note,
                  f"within {MEMORY_TOLERANCE:.0%}", PASS[ran.ok])


CHECKS: dict[str, Callable[[Step, Runner, dict], Result]] = {
    "init": check_init, "debug": check_debug, "llama1b": check_llama, "float8": check_float8,
    "planner": check_planner, "flex": check_flex, "cp2": check_cp2, "dryrun": check_dry_run}


def gpu_run(steps: list[Step], out: Path, budget_s: float) -> int:
    """Each check in turn, the failing ones' log tails, then the table; 1 if any failed."""
    out.mkdir(parents=True, exist_ok=True)
    for step in steps:  # a step that dies early or never runs leaves nothing old behind
        (out / f"{step.key}.log").unlink(missing_ok=True)
        if step.folder:
            shutil.rmtree(out / step.folder, ignore_errors=True)
    runner, seen, results = Runner(out, budget_s), {}, []
    for step in steps:
        try:
            results.append(CHECKS[step.key](step, runner, seen))
        except Exception as e:  # output a check could not read is its failure, not the table's
            results.append(Result(step.title, f"{type(e).__name__}: {e}", "", "FAIL"))
    for step, result in zip(steps, results):
        log = out / f"{step.key}.log"
        if result.status == "FAIL" and log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-12:]
            print(f"--- {step.key}: last lines of {log} ---", *tail, sep="\n")
    print(table(results, ("check", "figure", "reference / expected", "result")))
    return 1 if any(r.status == "FAIL" for r in results) else 0


# ---- the dry run: every command validated in this process, nothing trained

def quietly(fn: Callable[[], int]) -> tuple[int, str]:
    """``fn()``'s status and everything it printed or logged."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        code = fn()
    return code, buffer.getvalue()


def validate_init(step: Step) -> Result:
    """Both builds' configs parse; the cpu half is built (the cuda half needs a GPU)."""
    try:
        parse_args(["--config", str(CONFIG), "--job.device", "cuda"])
        state = initial_state("cpu")
    except ValueError as e:  # ConfigError, and the build's own
        return Result(step.title, "plan_job + build_model (cpu)", f"error: {e}", "FAIL")
    params = sum(t.numel() for t in state.values())
    return Result(step.title, "plan_job + build_model (cpu)",
                  f"{len(state)} tensors, {params:,} values", "OK")


def validate_train(step: Step) -> Result:
    if step.key == "float8" and torchao_missing():
        return Result(step.title, "composer.train --validate", "torchao is not installed", "SKIP")
    code, text = quietly(lambda: train_main([*step.argv[3:], "--validate"]))
    lines = text.splitlines()
    answer = next((line.split("] ", 1)[-1].split(" ", 1)[-1] for line in lines
                   if "config ok" in line), None)
    if code != 0 or answer is None:
        error = next((line for line in lines if line.startswith("error:")), f"exit status {code}")
        return Result(step.title, "composer.train --validate", error, "FAIL")
    return Result(step.title, "composer.train --validate", answer, "OK")


def validate_planner(step: Step) -> Result:
    code, text = quietly(lambda: planner_main(step.argv[3:]))
    try:
        peak = json.loads(text.strip().splitlines()[-1])["memory_gib"]["peak"]
    except (ValueError, IndexError, KeyError):
        error = next((line for line in text.splitlines() if line.startswith("error:")),
                     f"exit status {code}, no JSON")
        return Result(step.title, "composer.planner --json", error, "FAIL")
    return Result(step.title, "composer.planner --json",
                  f"predicted peak {peak:.2f} GiB on {CLUSTER}", "OK" if code == 0 else "FAIL")


def validate_script(step: Step) -> Result:
    """The script imports and its parser takes the step's arguments (what it runs needs
    CUDA)."""
    spec = importlib.util.spec_from_file_location(step.key, step.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.parser().parse_args(step.argv[2:])
    return Result(step.title, "imports, parser", f"{Path(step.argv[1]).name} ok", "OK")


VALIDATORS: dict[str, Callable[[Step], Result]] = {
    "init": validate_init, "debug": validate_train, "llama1b": validate_train,
    "float8": validate_train, "planner": validate_planner, "flex": validate_script,
    "cp2": validate_script, "dryrun": validate_script}


def dry_run(steps: list[Step], out: Path, budget_s: float) -> int:
    print(f"GPU self-check plan: {len(steps)} checks, budget {budget_s:.0f} s, run folder {out}")
    for step in steps:
        print(f"  {step.title} [timeout {step.timeout_s} s]\n      {shown(step.argv)}")
    print("dry run: validating every command here (no training)", flush=True)
    results = [VALIDATORS[step.key](step) for step in steps]
    print(table(results, ("check", "validated", "answer", "result")))
    return 1 if any(r.status == "FAIL" for r in results) else 0


def table(results: list[Result], header: tuple[str, ...]) -> str:
    rows = [header, *((r.check, r.figure, r.expected, r.status) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan, validate every command")
    p.add_argument("--out", default=str(ROOT / "outputs"), help="logs go to OUT/gpu_check")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all steps together")
    p.add_argument("--init-weights", action="store_true", help=argparse.SUPPRESS)  # check 1's child
    a = p.parse_args(argv)
    if a.init_weights:
        return init_parity()
    out = Path(a.out).resolve() / "gpu_check"
    steps = plan_steps(out)
    if a.dry_run:
        return dry_run(steps, out, a.budget)
    if not torch.cuda.is_available():
        print("error: no CUDA device is visible (torch.cuda.is_available() is False): the GPU "
              "self-check needs one; --dry-run checks its plan on this machine", file=sys.stderr)
        return 2
    ao = "absent" if torchao_missing() else "present"
    print(f"GPU self-check on {torch.cuda.get_device_name(0)}: torch {torch.__version__}, "
          f"torchao {ao}, planner cluster {CLUSTER}, budget {a.budget:.0f} s, logs in {out}",
          flush=True)
    return gpu_run(steps, out, a.budget)


if __name__ == "__main__":
    sys.exit(main())
