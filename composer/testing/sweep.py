"""Sweep models (named ``module:attribute``) over layouts, the planner and the dry run:
each layout's losses and gradient norms against the one-process run's (float64; equal
to a relative 1e-9), or the one line it was refused with; the planner's peak against
``metrics.memory_breakdown``'s on one process; ``--dry-run``'s outcome.

``tests/integration/test_own_models.py`` runs every style of ``examples/own_models.py`` on
every layout; ``benchmarks/bench_own_models.py`` runs the same with the dry run of each
and prints the table that docs/your_own_model.md shows.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from composer.testing.harness import PARITY, Job, Run, run_jobs
from composer.testing.parity import layout

TOLERANCE = 1e-9
QUIET = ["--validation.enable", "false", "--checkpoint.enable", "false"]
# name -> (ranks, arguments) over the global batch of 8 sequences
LAYOUTS = {
    "1 process": layout(1, zero=3, local=8),
    "FSDP2 x2": layout(2, zero=3, local=4),
    "TP2": layout(2, zero=3, local=8, tp=2),
    "PP2": layout(2, zero=3, local=8, pp=2),
    "CP2": layout(2, zero=3, local=8, cp=2),
}
# what the benchmark adds: pipeline parallel with the others
COMBINED = {
    "PP2 x FSDP2": layout(4, zero=3, local=4, pp=2),
    "PP2 x TP2": layout(4, zero=3, local=8, pp=2, tp=2),
    "PP2 AC full": layout(2, zero=3, local=8, pp=2, extra=("--activation_checkpoint.mode", "full")),
}
LAYOUTS.update(COMBINED)
REFERENCE = "1 process"
# the planner's check: a flavor big enough to show its figures, one process, float32
MEMORY = ["--model.flavor", "small", "--data.seq_len", "256", "--training.local_batch_size", "4",
          "--training.dtype", "float32", "--training.steps", "2", "--metrics.log_freq", "1",
          "--metrics.enable_tensorboard", "false", "--metrics.memory_breakdown", *QUIET]


def job_name(model: str, layout_name: str) -> str:
    return f"{model.rpartition(':')[2]}/{layout_name.replace(' ', '_')}"


def layout_jobs(plan: dict[str, list[str]]) -> dict[str, Run]:
    """One training job per model and layout of ``plan`` (model -> layouts), each model's
    one-process reference first."""
    jobs = {}
    for model, layouts in plan.items():
        for name in [REFERENCE, *(n for n in layouts if n != REFERENCE)]:
            nproc, args = LAYOUTS[name]
            jobs[job_name(model, name)] = Run(nproc, [*PARITY, *args, *QUIET,
                                                      "--model.name", model])
    return jobs


def memory_jobs(models: list[str]) -> dict[str, Run]:
    return {f"{model.rpartition(':')[2]}/memory": Run(1, [*MEMORY, "--model.name", model])
            for model in models}


def error_line(job: Job) -> str:
    """The first ``error:`` line a job's ranks printed (its refusal; of a failure, the
    rank's that failed, not its peers' that then waited in vain), or its last line."""
    lines = [line for log in sorted(job.logs.glob("rank*.log"))
             for line in log.read_text().splitlines()]
    errors = sorted((line for line in lines if line.startswith("error:")),
                    key=lambda line: "a peer stopped answering" in line)
    return errors[0] if errors else (lines[-1] if lines else f"exit {job.code}")


def worst_error(rows: list[dict], reference: list[dict]) -> float:
    """Over every step, of the loss and the gradient norm, relative."""
    by_step = {r["step"]: r for r in reference}
    return max(abs(r[key] - by_step[r["step"]][key]) / abs(by_step[r["step"]][key])
               for r in rows for key in ("loss", "grad_norm"))


def outcome(jobs: dict[str, Job], model: str, layout_name: str) -> dict:
    """``{"result": "pass" | "refused" | "differs" | "failed", "error": worst relative
    error, "line": the refusal}`` of one model's layout."""
    job, reference = jobs[job_name(model, layout_name)], jobs[job_name(model, REFERENCE)]
    if job.code == 2:
        return {"result": "refused", "line": error_line(job)}
    if job.code != 0 or reference.code != 0:
        return {"result": "failed", "line": error_line(job if job.code else reference)}
    rows, ref = job.rows(), reference.rows()
    if [r["step"] for r in rows] != [r["step"] for r in ref]:
        return {"result": "failed", "line": f"steps {[r['step'] for r in rows]}"}
    error = worst_error(rows, ref)
    return {"result": "pass" if error <= TOLERANCE else "differs", "error": error}


def _quietly(main, *args) -> tuple[int, str, str]:
    """``main(*args)`` in this process: (its exit status, its stdout, its stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(*args)
    return code, out.getvalue(), err.getvalue()


def planned(model: str, args: list[str]) -> dict:
    """``composer-plan --json``'s answer for ``model`` (no shape given), or its line."""
    from composer.planner.cli import main
    code, out, err = _quietly(main, [*args, "--model.name", model, "--json"])
    if code:
        return {"line": (err.strip().splitlines() or [f"exit {code}"])[-1]}
    return json.loads(out)


def dry_run(model: str, nproc: int, args: list[str]) -> dict:
    """``--dry-run --json``'s outcome on ``nproc`` ranks: ``{"peak": traced GiB}``, or
    ``{"line": why not}``."""
    from composer.config import ConfigError
    from composer.tools.dry_run import run
    try:
        code, out, _ = _quietly(run, [*args, "--model.name", model, "--dry-run", "--json"],
                                nproc)
    except ConfigError as e:
        return {"line": f"error: {e}"}
    traced = json.loads(out)["traced"] if code == 0 else None
    if not traced:
        return {"line": "; ".join(json.loads(out)["skipped"]) if code == 0 else f"exit {code}"}
    return {"peak": traced["memory_gib"]["peak"] if "memory_gib" in traced else traced}


def memory_ratio(model: str, job: Job) -> dict:
    """The planner's peak over ``metrics.memory_breakdown``'s (step 2, one process)."""
    if job.code != 0:
        return {"line": error_line(job)}
    measured = max(job.rows()[1]["memory"], key=lambda r: r["peak"])["peak"]
    plan = planned(model, MEMORY[:8])
    if "line" in plan:
        return plan
    return {"planned": plan["memory_gib"]["peak"], "measured": measured,
            "ratio": plan["memory_gib"]["peak"] / measured}


def sweep(plan: dict[str, list[str]], folder: Path, memory: list[str] = ()) -> dict:
    """``plan`` (model -> layouts) trained in one launch, and for the models in ``memory``
    the planner's peak against the measured one; model -> {"layouts": {layout: outcome},
    "memory": ratio}."""
    jobs = run_jobs({**layout_jobs(plan), **memory_jobs(list(memory))}, folder)
    out = {model: {"layouts": {name: outcome(jobs, model, name) for name in layouts
                               if name != REFERENCE}} for model, layouts in plan.items()}
    for model in memory:
        out.setdefault(model, {})["memory"] = memory_ratio(
            model, jobs[f"{model.rpartition(':')[2]}/memory"])
    return out
