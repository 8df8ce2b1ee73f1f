"""Start-up cost: what a rank pays before its first step.

Measures, as medians over ``--runs`` interleaved runs (so that drift hits both sides),
(1) the seconds to import composer.train in a fresh interpreter, and (2) the seconds
from launching the debug model (4 steps, sequence 32) under torchrun with ``--nproc``
CPU ranks to its first logged step.

    OMP_NUM_THREADS=1 python benchmarks/bench_startup.py [--runs 5] [--nproc 4] [--json]

Reference column: for (1) importing torch alone (the floor any rank pays), for (2) a
plain torchrun launch of as many ranks that only joins a gloo process group and
all-reduces once (the floor of a launch); the ratio is the median of the runs' ratios.
The table is followed by the optional packages (datasets, transformers, ...) that
importing composer.train pulls in (``--json``: the import row's ``optional imports``).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from composer.testing.harness import ROOT, launch_env
from composer.testing.report import bench_parser, emit

FLOOR = ("import torch, torch.distributed as d; d.init_process_group('gloo'); "
         "t = torch.ones(1); d.all_reduce(t); d.destroy_process_group()")
HEAVY = ("datasets", "transformers", "safetensors", "tensorboard", "torchao")


def import_seconds(module: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], env=launch_env(), check=True)
    return time.perf_counter() - start


def torchrun(nproc: int, *target: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *target]


def first_step_seconds(nproc: int) -> float:
    """Launch to the first metrics row of a 4-step debug run."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "metrics.jsonl"
        start = time.perf_counter()
        proc = subprocess.Popen(
            torchrun(nproc, "-m", "composer.train", "--job.dump_folder", folder,
                     "--training.steps", "4", "--data.seq_len", "32",
                     "--training.local_batch_size", "2", "--metrics.log_freq", "1",
                     "--metrics.enable_tensorboard", "false", "--validation.enable", "false"),
            cwd=ROOT, env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not (metrics.exists() and metrics.read_text().strip()):
            if proc.poll() is not None:
                raise SystemExit(f"the debug run exited with {proc.returncode} "
                                 "before its first step")
            time.sleep(0.01)
        seconds = time.perf_counter() - start
        proc.wait()
        return seconds


def floor_seconds(nproc: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(FLOOR)
        script.flush()
        start = time.perf_counter()
        subprocess.run(torchrun(nproc, script.name), env=launch_env(), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - start


def heavy_modules() -> list[str]:
    code = (f"import composer.train, sys; print(__import__('json').dumps([m for m in {HEAVY!r} "
            "if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], env=launch_env(),
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--runs", type=int, default=5, help="interleaved runs; medians count")
    parser.add_argument("--nproc", type=int, default=4, help="CPU ranks of the two launches")
    args = parser.parse_args(argv)
    figures = [
        ("import composer.train", lambda: import_seconds("composer.train"), "import torch",
         lambda: import_seconds("torch")),
        (f"launch -> first step, {args.nproc} ranks", lambda: first_step_seconds(args.nproc),
         "torchrun + gloo all-reduce", lambda: floor_seconds(args.nproc)),
    ]
    rows = []
    for name, ours, ref_name, ref in figures:
        pairs = [(ours(), ref()) for _ in range(args.runs)]  # interleaved: drift hits both
        a, b = (statistics.median(p[i] for p in pairs) for i in (0, 1))
        rows.append({"figure (median)": name, "composer (s)": a, "reference": ref_name,
                     "reference (s)": b, "ratio": statistics.median(x / y for x, y in pairs),
                     "runs": args.runs, "each run (s)": pairs})
    heavy = heavy_modules()
    rows[0]["optional imports"] = heavy
    emit(rows, ["figure (median)", "composer (s)", "reference", "reference (s)", "ratio", "runs"],
         args.json)
    if not args.json:
        print(f"\noptional packages imported by composer.train: {heavy or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
