"""Launch real training processes with a hard timeout and read what they wrote.

Every multi-process test goes through ``launch`` or ``run_jobs``: a hang becomes
a failed test (the launch and every process below it are killed) instead of a
stuck CI job. ``run_jobs`` runs many training jobs in one launch (``composer.testing.jobs``);
``train`` runs a one-process job in this process.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from composer.testing.jobs import run_job


def _root() -> Path:
    """The source tree this package runs from (a checkout, installed editable), where
    launches run and find train_configs/, tests/ and examples/; else the current folder."""
    tree = Path(__file__).resolve().parents[2]
    return tree if (tree / "pyproject.toml").is_file() else Path.cwd()


ROOT = _root()

# The parity setting: float64 everywhere, a tiny debug model, a few steps, a
# validation pass every other step. Every step is logged, so the step anatomy (which
# times only logged steps, and changes no number) is off: tests/unit/test_anatomy.py,
# test_plugins.py and test_compile.py cover it.
PARITY = ["--training.dtype", "float64", "--training.steps", "4", "--data.seq_len", "32",
          "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
          "--metrics.step_anatomy", "false",
          "--validation.freq", "2", "--validation.steps", "1", "--lr_scheduler.warmup_steps", "2"]


# gloo's words when the ranks of a launch could not connect. Its cause here was a
# restarted rank reading its dead peer's address from torchrun's store (fixed by
# composer.train's per-attempt store prefix); 30 launches in a row now connect
# (scripts/soak_launch.py). Should one fail so again, it is tried once more and
# the session's summary counts it (tests/conftest.py).
GLOO_CONNECT = "Gloo connectFullMesh failed"
RETRIED: list[str] = []  # "<command>: <gloo's line>" for each launch tried again


def launch(args: list[str], nproc: int = 1, timeout: float = 300,
           program: str = "composer.train") -> subprocess.CompletedProcess:
    """Run ``program`` (a module, or a script ending in .py) with ``args`` as one
    process, or under torchrun with nproc ranks (again, once, counted, if gloo
    could not connect the ranks)."""
    result = _launch(args, nproc, timeout, program, torchrun=nproc > 1)
    output = result.stdout + result.stderr
    if result.returncode != 0 and GLOO_CONNECT in output:
        cause = next(line for line in output.splitlines() if GLOO_CONNECT in line)
        RETRIED.append(f"{program} x{nproc}: {cause.strip()}")
        result = _launch(args, nproc, timeout, program, torchrun=nproc > 1)
    return result


def _launch(args: list[str], nproc: int, timeout: float, program: str,
            torchrun: bool) -> subprocess.CompletedProcess:
    target = [program] if program.endswith(".py") else ["-m", program]
    if not torchrun:
        cmd = [sys.executable, *target, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *target, *args]
    return run_command(cmd, timeout)


def launch_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ROOT in a session of its own; past ``timeout`` kill it and
    everything below it and fail with the end of its output."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}\n"
                             f"{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_side_by_side(cmds: list[list[str]], logs: list[Path], timeout: float,
                     env: dict[str, str] | None = None) -> list[int]:
    """Start every command at once (each in a session of its own, its output into
    its log) and return their exit codes once all have ended; past ``timeout``
    kill them all, and everything below them, and fail with the ends of the logs."""
    procs = []
    for cmd, log in zip(cmds, logs, strict=True):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env or launch_env(), stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        return [proc.wait(timeout=max(0.0, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_tree(proc.pid)
        for proc in procs:
            proc.wait(timeout=60)
        tails = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs)
        raise AssertionError(f"timed out after {timeout}s: {len(cmds)} commands side by side\n"
                             f"{tails}") from None


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first."""
    below = {int(p.name): parent(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, up in below.items() if up in frontier]
        found += frontier
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it: torchrun starts
    each worker in a session of its own, out of reach of its agent's group."""
    victims = descendants(pid)
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # a signal is delivered, not yet acted on, on return
    while any(alive(v) for v in victims) and time.monotonic() < deadline:
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (neither gone nor a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def read_metrics(folder: Path, events: bool = False) -> list[dict]:
    """The step rows of ``folder``'s metrics.jsonl (and its event rows with ``events``)."""
    with open(folder / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return rows if events else [r for r in rows if "event" not in r]


def train(folder: Path, nproc: int = 1, args: list[str] = (), timeout: float = 300) -> list[dict]:
    """Train into ``folder`` and return its metrics rows; fail with the output on
    error. One process runs here, in pytest's process (as ``python -m
    composer.train`` would, without its start-up); more ranks under torchrun."""
    if nproc == 1:
        return run_here(folder, args).rows()
    result = launch(["--job.dump_folder", str(folder), *args], nproc, timeout)
    assert result.returncode == 0, (f"exit {result.returncode}\n{result.stdout[-4000:]}\n"
                                    f"{result.stderr[-4000:]}")
    return read_metrics(folder)


@dataclass
class Run:
    """A job for ``run_jobs``: its ranks and arguments; the dump folder it shares
    with an earlier job (to resume it), and paths deleted before it starts."""

    nproc: int
    args: list[str]
    folder: str | None = None  # under run_jobs' folder; default: the job's name
    remove: tuple[str, ...] = ()


@dataclass
class Job:
    """How one job ended: its exit status (the worst of its ranks'; None when it
    never finished), dump folder and logs."""

    name: str
    code: int | None
    folder: Path
    logs: Path
    launch_output: str = ""  # the end of the whole launch's output, for a job that never ended
    gloo_threads: int | None = None  # the most any rank had left once the job was over

    def log(self) -> str:
        logs = sorted(self.logs.glob("rank*.log"))
        text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)
        return text if self.code is not None else f"{text}\n--- launch\n{self.launch_output}"

    def rows(self) -> list[dict]:
        """The metrics rows; fails naming the job, with its logs, if it did not end well."""
        assert self.code == 0, f"job {self.name}: exit {self.code}\n{self.log()}"
        return read_metrics(self.folder)


def _plan(name: str, run: Run, folder: Path) -> dict:
    dump = folder / (run.folder or name)
    return {"name": name, "nproc": run.nproc, "logs": str(folder / "logs" / name),
            "remove": [str(folder / p) for p in run.remove],
            # a hang inside a job fails it in 2 minutes, not the collectives' default 10
            "argv": ["--job.collective_timeout_s", "120", *run.args,
                     "--job.dump_folder", str(dump)]}


def run_jobs(jobs: dict[str, Run], folder: Path, timeout: float = 900) -> dict[str, Job]:
    """Run every job in one launch of ``composer.testing.jobs`` (its start-up paid once), in
    order, each on the launch's ranks 0..nproc-1. A job that fails does not stop the others;
    a hang fails the whole launch."""
    plan = write_plan(jobs, folder)
    world = max(run.nproc for run in jobs.values())
    result = _launch([str(folder / "jobs.json")], world, timeout, "composer.testing.jobs",
                     torchrun=True)
    (folder / "launch.log").write_text(result.stdout + result.stderr)
    tail = f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return jobs_ended(plan, tail)


def write_plan(jobs: dict[str, Run], folder: Path) -> list[dict]:
    """The plan of ``jobs`` for ``composer.testing.jobs``, written to ``folder``/jobs.json."""
    folder.mkdir(parents=True, exist_ok=True)
    plan = [_plan(name, run, folder) for name, run in jobs.items()]
    (folder / "jobs.json").write_text(json.dumps(plan, indent=1))
    return plan


def jobs_ended(plan: list[dict], launch_output: str = "") -> dict[str, Job]:
    """How each job of a launch of ``plan`` ended."""
    return {job["name"]: _ended(job, launch_output) for job in plan}


def run_here(folder: Path, args: list[str], name: str = "here") -> Job:
    """One process, in this one: a one-rank job as run_jobs would run it. What it printed
    goes to ``<folder>/logs/<name>/``, beside the run's own log files."""
    job = {"name": name, "nproc": 1, "logs": str(folder / "logs" / name),
           "argv": [*args, "--job.dump_folder", str(folder)]}
    run_job(job, None, 0)
    return _ended(job)


def _ended(job: dict, launch_output: str = "") -> Job:
    logs = Path(job["logs"])
    dump = Path(job["argv"][-1])
    exits = [logs / f"exit-rank{r}.json" for r in range(job["nproc"])]
    if not all(p.is_file() for p in exits):
        return Job(job["name"], None, dump, logs, launch_output)
    ended = [json.loads(p.read_text()) for p in exits]
    return Job(job["name"], max(e["code"] for e in ended), dump, logs,
               gloo_threads=max(e["gloo_threads"] for e in ended))
