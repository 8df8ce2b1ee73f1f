"""Kill one replica group of a fault-tolerant job mid-run and restart it with no
checkpoint: the wall time lost with torchft, beside today's torchrun restart.

    OMP_NUM_THREADS=1 python benchmarks/ft_kill_heal.py [--groups 3] [--steps 60] [--kill-at 15]
                                                        [--val-freq 4] [--inner fsdp2|tp2] [--json]

With fault tolerance: a lighthouse on 127.0.0.1 and ``--groups`` replica groups of 2
ranks (``--inner``: FSDP2 x2 or TP2 inside, float64, the debug model); once every group
has logged step ``--kill-at``, every process of group 1 is killed by SIGKILL and the
group is started again at once with an empty dump folder (its weights can only come from
a heal). It prints per group the steps logged, the heal (step, source, seconds), whether the
step counter ever went back, and the final losses (to stderr with ``--json``).

Without it: the same job as one torchrun of HSDP (``--groups`` replicas of the inner
layout) with a checkpoint every ``--interval`` steps and ``--max-restarts 1``; one worker
is killed by SIGKILL at the same step, torchrun restarts every rank, and all reload the
last checkpoint and train again the steps since.

Each way also runs once without a kill: the reference column. The wall time lost is the
killed run's wall time less that run's, both to the last step; the fault-tolerant row's
is compared against the torchrun restart's row below it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from composer.testing.harness import ROOT, descendants, kill_tree, launch_env
from composer.testing.report import bench_parser, emit

PARITY = ["--training.dtype", "float64", "--data.seq_len", "32", "--metrics.log_freq", "1",
          "--metrics.enable_tensorboard", "false", "--metrics.step_anatomy", "false",
          "--lr_scheduler.warmup_steps", "2", "--training.local_batch_size", "2",
          "--parallelism.zero_stage", "3"]
INNER = {"fsdp2": [], "tp2": ["--parallelism.tensor_parallel_degree", "2"]}


def rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line)
            if "loss" in r]


def torchrun(nproc: int, port: int, args: list[str], log: Path,
             restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--max-restarts", str(restarts), "-m", "composer.train", *PARITY, *args]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(done, procs, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit("a run failed or hung: see its log under --folder")
        time.sleep(0.1)


def say(args, line: str) -> None:
    """A line about a run: with --json, stdout holds the JSON alone."""
    print(line, file=sys.stderr if args.json else sys.stdout)


def fault_tolerant(args, base: Path, kill: bool) -> float:
    """The wall seconds of a fault-tolerant run to its last step (the kill's, with one)."""
    base.mkdir(parents=True)
    lighthouse = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "1",
                                   "--join_timeout_ms", "2000", "--heartbeat_timeout_ms",
                                   "2000", "--bind", "[::]:29590"],
                                  stdout=open(base / "lighthouse.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def group(g: int) -> subprocess.Popen:
        return torchrun(2, 29800 + g, [
            *INNER[args.inner], "--training.steps", str(args.steps),
            "--job.dump_folder", str(base / f"g{g}"),
            "--fault_tolerance.enable", "true", "--fault_tolerance.replica_id", str(g),
            "--fault_tolerance.group_size", str(args.groups),
            "--fault_tolerance.lighthouse", "http://127.0.0.1:29590",
            "--fault_tolerance.timeout_s", "30", "--validation.freq", str(args.val_freq),
            "--validation.steps", "1"], base / f"g{g}.log")
    start = time.monotonic()
    procs = {g: group(g) for g in range(args.groups)}
    try:
        if kill:
            wait_for(lambda: all(len(rows(base / f"g{g}")) >= args.kill_at
                                 for g in range(args.groups)), procs.values())
            kill_tree(procs[1].pid)
            procs[1].wait()
            subprocess.run(["rm", "-rf", str(base / "g1")], check=True)
            procs[1] = group(1)
        codes = {g: p.wait(timeout=900) for g, p in procs.items()}
    finally:
        lighthouse.kill()
    wall = time.monotonic() - start
    say(args, f"fault tolerant, {'a group killed' if kill else 'no kill'}: exit codes {codes}, "
        f"wall {wall:.1f} s")
    finals = {}
    for g in range(args.groups):
        r = rows(base / f"g{g}")
        steps = [x["step"] for x in r]
        record = json.loads((base / f"g{g}" / "run.json").read_text())["fault_tolerance"]
        finals[g] = r[-1]["loss"]
        say(args, f"  group {g}: steps {steps[0]}..{steps[-1]} ({len(steps)} logged), never "
            f"back {all(b > a for a, b in zip(steps, steps[1:]))}, heals {record['heals']}, "
            f"windows {record['windows_trained']}, missed {record['steps_missed']}")
    say(args, f"  final losses {finals}")
    return wall


def restarted(args, base: Path, kill: bool) -> float:
    """The wall seconds of one torchrun of HSDP to its last step: with a kill, torchrun
    restarts every rank and all resume from the last checkpoint."""
    base.mkdir(parents=True)
    start = time.monotonic()
    proc = torchrun(2 * args.groups, 29700, [
        *INNER[args.inner], "--training.steps", str(args.steps),
        "--job.dump_folder", str(base / "job"),
        "--parallelism.data_parallel_replicate_degree", str(args.groups),
        "--checkpoint.enable", "--checkpoint.interval", str(args.interval),
        "--validation.freq", str(args.val_freq), "--validation.steps", "1"],
        base / "job.log", restarts=1)
    try:
        if kill:
            wait_for(lambda: len(rows(base / "job")) >= args.kill_at, [proc])
            worker = max(descendants(proc.pid))  # one of the workers, not the agent
            os.kill(worker, signal.SIGKILL)
        code = proc.wait(timeout=900)
    finally:
        kill_tree(proc.pid)
    wall = time.monotonic() - start
    say(args, f"torchrun restart, {'a worker killed' if kill else 'no kill'}: exit {code}, wall "
        f"{wall:.1f} s, last step {rows(base / 'job')[-1]['step']}")
    return wall


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--val-freq", type=int, default=4, help="validate every N steps")
    parser.add_argument("--interval", type=int, default=10,
                        help="checkpoint interval of the torchrun-restart run")
    parser.add_argument("--inner", choices=INNER, default="fsdp2",
                        help="each group's layout: FSDP2 x2, or TP2")
    parser.add_argument("--folder", default="/tmp/composer_ft_kill_heal")
    args = parser.parse_args(argv)
    base = Path(args.folder)
    subprocess.run(["rm", "-rf", str(base)], check=True)
    walls = {(way.__name__, kill): way(args, base / f"{way.__name__}_{kill}", kill)
             for way in (fault_tolerant, restarted) for kill in (False, True)}
    table = [{"way": way, "wall, no kill (s)": walls[way, False],
              "wall, one kill (s)": walls[way, True],
              "lost (s)": walls[way, True] - walls[way, False]}
             for way in ("fault_tolerant", "restarted")]
    if not args.json:
        print()
    emit(table, ["way", "wall, no kill (s)", "wall, one kill (s)", "lost (s)"], args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
