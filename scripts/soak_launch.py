"""Launch the debug model under torchrun many times in a row and count the
launches that failed: ranks that could not connect, a native abort, any non-zero exit.

    python scripts/soak_launch.py [--runs 30] [--nproc 4] [--busy 0] [--extra "--a.b c ..."]
    python scripts/soak_launch.py --parity quick [--runs 40]

Each launch trains 1 step on nproc CPU ranks (gloo), with nothing retried;
``--extra`` adds training arguments (e.g. a layout whose teardown to watch).
``--parity GROUP`` instead runs the parity launch of that group as the test suite's
``matrix`` fixture does (tests/integration/test_parity.py: its references and rows, all in one
launch of ``composer.testing.jobs``); a job that ends badly fails the launch too.
``--busy N`` keeps N busy loops running beside the launches (a loaded machine).
Python's stacks are dumped at a native abort (PYTHONFAULTHANDLER). Prints one line
per launch (a failed one's with its cause), then a summary row.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the test suite's own parity jobs, plan and reading of how they ended
from composer.testing.harness import jobs_ended, write_plan
from composer.testing.parity import group_jobs

ROOT = Path(__file__).resolve().parents[1]

CONNECT = ("connectFullMesh", "Connection refused", "Connection reset", "Socket Timeout")
# a rank's native abort: the C++ runtime's, glibc's heap checks, a fatal signal
ABORT = ("terminate called", "malloc(", "free(", "corrupted", "double free", "Fatal Python error",
         "Segmentation fault", "Signals.SIGABRT", "Signals.SIGSEGV")


def spin() -> None:
    while True:
        pass


def torchrun(nproc: int, program: list[str], timeout: float) -> tuple[int, str, float]:
    """Exit status, the cause line (an abort's or a connect failure's, else the end
    of the output) and seconds of one launch."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *program]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env=env)
    out = result.stdout + result.stderr
    lines = out.splitlines()
    cause = next((line.strip() for words in (ABORT, CONNECT) for line in lines
                  if any(w in line for w in words)), "")
    return result.returncode, cause or out[-300:].strip(), time.perf_counter() - start


def one_launch(nproc: int, extra: list[str]) -> tuple[int, str, float]:
    with tempfile.TemporaryDirectory() as folder:
        return torchrun(nproc, ["-m", "composer.train", "--job.dump_folder", folder,
                                "--training.steps", "1", "--data.seq_len", "32",
                                "--training.local_batch_size", "2",
                                "--metrics.enable_tensorboard", "false",
                                "--validation.enable", "false",
                                "--job.collective_timeout_s", "120", *extra], timeout=300)


def parity_launch(group: str) -> tuple[int, str, float]:
    """The parity group's launch, as tests/integration/test_parity.py's ``matrix`` runs it; a
    launch that exited 0 with a job that did not end well fails with its name."""
    jobs = group_jobs(group)
    with tempfile.TemporaryDirectory() as folder:
        plan = write_plan(jobs, Path(folder))
        nproc = max(run.nproc for run in jobs.values())
        code, cause, took = torchrun(nproc, ["-m", "composer.testing.jobs",
                                             str(Path(folder) / "jobs.json")], timeout=1800)
        bad = [f"{name} (exit {job.code})" for name, job in jobs_ended(plan).items() if job.code]
        if code == 0 and bad:
            return 1, f"jobs ended badly: {', '.join(bad)}", took
        return code, cause, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--extra", default="", help="more training arguments, one string")
    parser.add_argument("--parity", choices=("quick", "full"),
                        help="run this parity group's launch instead")
    args = parser.parse_args()
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    failed, seconds = 0, []
    try:
        for i in range(1, args.runs + 1):
            code, cause, took = (parity_launch(args.parity) if args.parity
                                 else one_launch(args.nproc, args.extra.split()))
            seconds.append(took)
            failed += code != 0
            print(f"launch {i}: exit {code} in {took:.0f}s" + (f": {cause}" if code else ""),
                  flush=True)
    finally:
        for p in busy:
            p.terminate()
    seconds.sort()
    what = f"parity {args.parity}" if args.parity else f"{args.nproc} ranks"
    print(f"| launches | of | busy loops | failed | median s | max s |\n"
          f"| --- | --- | --- | --- | --- | --- |\n"
          f"| {args.runs} | {what} | {args.busy} | {failed} | {seconds[len(seconds) // 2]:.1f} "
          f"| {seconds[-1]:.1f} |")


if __name__ == "__main__":
    main()
