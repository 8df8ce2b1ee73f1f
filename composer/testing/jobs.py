"""Run many training jobs in one torchrun launch, so that the launch's start-up
(Python, torch, the trainer's imports, torchrun's rendezvous) is paid once for
all of them instead of once per job. Test-only; the harness drives it:

    torchrun --nproc_per_node=W -m composer.testing.jobs PLAN.json

PLAN.json is a list of jobs ``{"name", "nproc", "argv", "logs", "remove"}``
(``remove``: paths deleted before the job starts). A job runs on the launch's
ranks ``0 .. nproc - 1``, once all of them have finished their earlier jobs: the
jobs run one after the other, and a job may read what an earlier one wrote. A
job is what ``python -m composer.train ARGV`` under torchrun with nproc ranks
would run (``composer.cli.run_argv``, the same entry), except that its process
group is built by ``ParallelDims`` over its own ranks, through a store prefix of
its own; a one-rank job has no process group, like a plain one-process run.

Every rank of a job writes ``<logs>/rank<r>.log`` (what it printed: its log,
error lines and, on failure, the traceback) and, when done,
``<logs>/exit-rank<r>.json`` (``code``, ``seconds``, and ``gloo_threads``: gloo's
threads still alive once the job is over and collected beyond those alive when it
started, which a job that ended every process group it made leaves none of);
the job's rank 0 writes its metrics.jsonl into its dump folder as usual.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import shutil
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from composer import torch_compat
from composer.cli.run import run_argv


@contextlib.contextmanager
def output_to(path: Path):
    """What a job prints (the CLI's log lines on stdout, its error lines on stderr)
    into ``path``; the logging set-up before is restored after (jobs also run in
    pytest's process)."""
    root = logging.getLogger()
    before = root.handlers[:], root.level
    out = open(path, "w")
    try:
        with out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            yield
    finally:
        for handler in root.handlers:
            if handler not in before[0]:
                handler.close()
        root.handlers[:], _ = before
        root.setLevel(before[1])
        _unbind(out)


class _Stderr:
    """Whatever ``sys.stderr`` is when written to: the log of the job running then."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _unbind(stream) -> None:
    """Point the handlers a library made during the job on ``stream`` (transformers'
    logger takes stderr when first used) at the stderr of whichever job runs next."""
    loggers = [logging.getLogger(), *(logging.getLogger(name)
                                      for name in logging.Logger.manager.loggerDict)]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
                handler.stream = _Stderr()  # setStream would flush the closed one
                if getattr(vars(handler).get("flush"), "__self__", None) is stream:
                    del handler.flush  # transformers binds its handler's to its stream's


def run_job(job: dict, store: dist.Store | None, rank: int) -> int:
    """This rank's part of ``job``; returns its exit status (that of the CLI)."""
    nproc = job["nproc"]
    logs = Path(job["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    start, threads_before = time.perf_counter(), gloo_threads()
    with output_to(logs / f"rank{rank}.log"):
        try:
            start_together(job, store, rank)
            own = dist.PrefixStore(f"jobs/{job['name']}", store) if nproc > 1 else None
            code = run_argv(job["argv"], rank=rank, world_size=nproc, store=own)
        except Exception:  # the job failed, the launch goes on: the test reads why
            print(f"job {job['name']} failed:\n{traceback.format_exc()}", file=sys.stderr)
            code = 1
            if dist.is_initialized():  # the peers see the closed connections and fail too
                dist.destroy_process_group()
    seconds = time.perf_counter() - start
    torch_compat.forget_compiled_code()  # each job compiles its own model
    gc.collect()
    (logs / f"exit-rank{rank}.json").write_text(json.dumps(
        {"code": code, "seconds": seconds, "gloo_threads": gloo_threads_left(threads_before)}))
    print(f"job {job['name']} rank {rank}/{nproc}: exit {code} in {seconds:.1f}s", flush=True)
    return code


# the names gloo gives its threads: a process group's workers and its transport's loop
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def gloo_threads() -> int:
    """How many of this process's threads are gloo's (Linux: the kernel's thread names).
    A process group's threads end with the group; one still alive at the interpreter's
    teardown can take the GIL there and abort the process."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended while we looked
            names.append((task / "comm").read_text().strip())
    return sum(name in GLOO_THREADS for name in names)


def gloo_threads_left(before: int, settle_s: float = 10.0) -> int:
    """gloo's threads beyond the ``before`` alive when the job started, once those of the
    groups just destroyed have had ``settle_s`` to end: a group's transport thread can end
    a moment after the group (later still on a loaded machine), where a group something
    keeps alive keeps its threads for good. An earlier job's leftovers are its own, and
    cost the jobs after it no wait."""
    deadline = time.monotonic() + settle_s
    while (count := gloo_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    return max(0, count - before)


def start_together(job: dict, store: dist.Store | None, rank: int) -> None:
    """The job's ranks wait here for each other: a job starts only once every one
    of its ranks has finished its earlier jobs, whose files it may read. Then
    rank 0 deletes the job's ``remove`` paths (a test's way to lose a checkpoint
    step between two jobs), before any rank looks at them."""
    name, nproc = job["name"], job["nproc"]
    if store is not None and nproc > 1:
        store.set(f"jobs/{name}/arrived/{rank}", "1")
        store.wait([f"jobs/{name}/arrived/{r}" for r in range(nproc)])
    if rank == 0:
        for path in job.get("remove", ()):
            shutil.rmtree(path)
        if store is not None:
            store.set(f"jobs/{name}/ready", "1")
    elif store is not None:
        store.wait([f"jobs/{name}/ready"])


def main(plan_file: str) -> None:
    jobs = json.loads(Path(plan_file).read_text())
    store, rank, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=300)))
    # what the imports made lives as long as the launch: each job's gc.collect (and
    # Python's own full collections) then scan only what the jobs made
    gc.freeze()
    for job in jobs:
        if rank < job["nproc"]:
            run_job(job, store, rank)


if __name__ == "__main__":
    main(sys.argv[1])
