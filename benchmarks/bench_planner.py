"""The planner's prediction beside what training measures, layout by layout.

Two model shapes: the debug Llama (train_configs/debug_model.toml, sequence 128,
float32) and a tiny untied Qwen3 whose head_dim (32) is not dim / heads (128 / 8),
at sequence 512; the MoE debug model for the expert rows. Every layout trains a
global batch of 8 sequences (``composer.testing.parity.layout``, as the parity tests do), on
1, 2 or 4 CPU ranks, each rank count in one launch of ``composer.testing.harness.run_jobs``.

1. Memory: step 2 of a run with ``metrics.memory_breakdown`` and
   ``metrics.comm_stats``, the rank with the largest peak, by category (MiB),
   next to ``composer.planner.predict``'s pipeline rank with the largest peak.
   A category outside 15% is marked ``*``, a peak outside 10% too. Pipeline and
   accumulation rows have no measured memory (``memory_refused`` says why).
2. Communication: rank 0's collectives of the same step, per mesh dim and kind
   summed over phases, next to the planner's; ``*`` where bytes are outside 2%
   or the counts differ, ``~`` where the difference is a known one (notes below
   the table).
3. Step time: the predicted step beside the median ``step_time_s`` of steps 3-8
   of another run without observers (they slow the step), and the cores other
   processes kept busy during that launch (/proc/stat less this script's
   children): a busy machine makes the ratios meaningless. The predicted step's
   terms follow (seconds: matmuls, attention, element-wise ops, the optimizer step,
   host overhead, exposed communication; the bubble stretches their sum), so a ratio
   that is off points at the term to check. The efficiency constants (the cpu profile,
   whose matmul curve benchmarks/bench_gemm.py fits on GEMMs alone, and the ops and bytes
   the planner's trace counts in the model's own step) are checked here, not fitted.

    OMP_NUM_THREADS=1 python benchmarks/bench_planner.py [--quick] [--cluster cpu|FILE]
                                                         [--out OUT] [--json]

Reference column: the planner's prediction (``composer.planner.predict``) in all three
tables, each measured figure beside it with the ratio predicted / measured. ``--json``
prints the three tables' rows as one list (each row's ``table``: memory, comm or time);
``--out`` writes every prediction and measured row to a file.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from composer.config import parse_args
from composer.planner.cluster import Cluster, load_cluster
from composer.planner.layout import layout_of, load_model
from composer.planner.predict import label, predict
from composer.testing.harness import Run, run_jobs
from composer.testing.parity import A2A, AC, EP, LORA, MOE, QWEN3, layout
from composer.testing.parity import LAYOUTS as PARITY_LAYOUTS
from composer.testing.report import bench_parser, emit

COMMON = ["--config", "train_configs/debug_model.toml", "--validation.enable", "false",
          "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1",
          "--metrics.log_freq", "1"]
OBSERVED = ["--training.steps", "2", "--metrics.comm_stats"]  # step 2: AdamW state exists
MEMORY = ["--metrics.memory_breakdown", "true"]
TIMED = ["--training.steps", "8", "--metrics.step_anatomy", "false"]  # no observer at all
TIMED_STEPS = range(3, 9)  # the first two steps warm up (allocator, AdamW's state)
QWEN = (*QWEN3, "--model.flavor", "debug", "--data.seq_len", "512")
NO_LOSS_PARALLEL = ("--parallelism.loss_parallel", "false")
# the parity matrix's data-parallel rows (their observers dropped: see ``unobserved``)
DATA_PARALLEL = ("ddp_x2", "zero1_x2", "zero2_x2", "zero3_x2", "hsdp_2x2", "zero3_x2_accumulate2")
OBSERVERS = ("--metrics.memory_breakdown", "--metrics.comm_stats")


def unobserved(row: tuple[int, list[str]]) -> tuple[int, list[str]]:
    """A parity row without the observers it carries for its tests (they slow every step
    they watch: the timed run must not have them; the observed run adds its own)."""
    nproc, args = row
    kept, flag = [], False
    for arg in args:
        if not (flag and arg in ("true", "false")) and arg not in OBSERVERS:
            kept.append(arg)
        flag = arg in OBSERVERS
    return nproc, kept


LAYOUTS = {
    "single": layout(1, zero=3, local=8),
    **{name: unobserved(PARITY_LAYOUTS[name]) for name in DATA_PARALLEL},
    "tp2": layout(2, zero=3, local=8, tp=2, sp=False, extra=NO_LOSS_PARALLEL),
    "tp2_sp": layout(2, zero=3, local=8, tp=2),
    "fsdp2_tp2": layout(4, zero=3, local=4, tp=2),
    "pp2_1f1b": layout(2, zero=3, local=8, pp=2),
    "pp2_gpipe": layout(2, zero=3, local=8, pp=2, schedule="GPipe"),
    "cp2": layout(2, zero=3, local=8, cp=2),
    "cp2_alltoall": layout(2, zero=3, local=8, cp=2, extra=(A2A,)),
    "ac_full": layout(1, zero=3, local=8, extra=(AC, "full")),
    "ac_selective_op": layout(1, zero=3, local=8, extra=(AC, "selective_op")),
    "ac_selective_layer": layout(1, zero=3, local=8, extra=(AC, "selective_layer")),
    "float8_x2": layout(2, zero=3, local=4, extra=("--model.converters", "float8")),
    "lora_x2": layout(2, zero=3, local=4, extra=LORA),
    "moe_x2": layout(2, zero=3, local=4, extra=MOE),
    "moe_ep2": layout(2, zero=3, local=4, extra=(*MOE, EP, "2")),
    "qwen3_single": layout(1, zero=3, local=8, extra=QWEN),
    "qwen3_zero3_x2": layout(2, zero=3, local=4, extra=QWEN),
    "qwen3_tp2_sp": layout(2, zero=3, local=8, tp=2, extra=QWEN),
    "qwen3_ac_full": layout(1, zero=3, local=8, extra=(*QWEN, AC, "full")),
    "qwen3_ddp_x2": layout(2, zero=0, local=4, extra=QWEN),
}
QUICK = ("single", "zero3_x2", "tp2_sp", "pp2_1f1b", "moe_ep2", "qwen3_single")
CATEGORIES = ("params", "grads", "optimizer", "activations", "other", "peak")
CATEGORY_TOL, PEAK_TOL, COMM_TOL = 0.15, 0.10, 0.02
MIB = 1024  # GiB -> MiB
# differences the planner knowingly leaves: (layout, dim, kind) -> why
KNOWN = {("moe_ep2", "ep", "all_to_all"): "the planner assumes balanced routing; the measured "
         "bytes follow the step's real routing",
         ("zero1_x2", "dp_shard", "broadcast"): "ZeRO-1's two small forward broadcasts "
         "are not modelled"}


def memory_refused(args: list[str]) -> str | None:
    """Why metrics.memory_breakdown cannot measure this layout on CPU, if it cannot."""
    if args[args.index("--parallelism.pipeline_parallel_degree") + 1] != "1":
        return "not measured: the tracker is refused with pipeline parallel on CPU"
    if "--training.global_batch_size" in args:
        return ("not measured: the tracker is refused with gradient accumulation on CPU "
                "(it follows one forward per step)")
    return None


def jobs_by_ranks(names: list[str]) -> dict[int, dict[str, Run]]:
    """Per rank count, an observed and a timed job per layout (one launch each)."""
    groups: dict[int, dict[str, Run]] = {}
    for name in names:
        nproc, args = LAYOUTS[name]
        observed = OBSERVED + ([] if memory_refused(args) else MEMORY)
        jobs = groups.setdefault(nproc, {})
        jobs[f"{name}.observed"] = Run(nproc, COMMON + observed + args)
        jobs[f"{name}.timed"] = Run(nproc, COMMON + TIMED + args)
    return groups


def measure(names: list[str], folder: Path) -> dict[str, dict]:
    """Per layout: the observed run's step-2 row, the timed run's rows, and the
    cores other processes kept busy during its launch."""
    out: dict[str, dict] = {}
    for nproc, jobs in sorted(jobs_by_ranks(names).items()):
        start, before = time.perf_counter(), cpu_seconds()
        done = run_jobs(jobs, folder / f"ranks{nproc}", timeout=3600)
        seconds, after = time.perf_counter() - start, cpu_seconds()
        others = ((after[0] - before[0]) - (after[1] - before[1])) / seconds
        print(f"{nproc} rank(s): {len(jobs)} jobs in {seconds:.0f} s; other processes kept "
              f"{others:.2f} of {os.cpu_count()} cores busy", file=sys.stderr)
        for name in (n for n in names if LAYOUTS[n][0] == nproc):
            out[name] = {"observed": step_row(done[f"{name}.observed"], 2),
                         "timed": [step_row(done[f"{name}.timed"], s) for s in TIMED_STEPS],
                         "other_cores": others}
    return out


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the machine has been busy, those of this process's ended children):
    step times are only comparable when the difference stays near zero."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, usage.ru_utime + usage.ru_stime


def step_row(job, step: int) -> dict:
    if job.code != 0:  # shown, not raised: the other layouts still compare
        return {"error": job.log()[-2000:]}
    return next(r for r in job.rows() if r.get("step") == step and "loss" in r)


def prediction(name: str, cluster: Cluster):
    nproc, args = LAYOUTS[name]
    cfg, _ = parse_args(COMMON + TIMED + args)  # observers change no prediction
    return predict(layout_of(cfg, load_model(cfg), nproc, "cpu"), cluster)


MEMORY_COLUMNS = ["layout", "planner label", *CATEGORIES, "peak ratio", "predicted moment",
                  "note"]


def memory_table(preds: dict, meas: dict) -> tuple[list[dict], list[str]]:
    """(rows, summary lines): each category's cell "predicted / measured" MiB."""
    rows, peaks_ok, cats_ok, layouts = [], 0, 0, 0
    for name, p in preds.items():
        row = meas[name]["observed"]
        if "memory" not in row:
            why = "failed" if "error" in row else memory_refused(LAYOUTS[name][1])
            rows.append({"layout": name, "planner label": label(p.layout), "note": why})
            continue
        top = max(row["memory"], key=lambda r: r["peak"])
        pm = {k: v * MIB for k, v in p.peak.gib().items()}
        mm = {k: top[k] * MIB for k in CATEGORIES}
        ok = {k: abs(pm[k] - mm[k]) <= (PEAK_TOL if k == "peak" else CATEGORY_TOL) * mm[k]
              for k in CATEGORIES}
        rows.append({"layout": name, "planner label": label(p.layout),
                     **{k: f"{pm[k]:.2f} / {mm[k]:.2f}{'' if ok[k] else ' *'}"
                        for k in CATEGORIES},
                     "peak ratio": pm["peak"] / mm["peak"],
                     "predicted moment": p.peak.peak.name,
                     "predicted MiB": {k: pm[k] for k in CATEGORIES},
                     "measured MiB": {k: mm[k] for k in CATEGORIES},
                     "within tolerance": ok})
        layouts += 1
        peaks_ok += ok["peak"]
        cats_ok += sum(ok[k] for k in CATEGORIES[:-1])
    return rows, [f"peak within {PEAK_TOL:.0%}: {peaks_ok} of {layouts} layouts; categories "
                  f"within {CATEGORY_TOL:.0%}: {cats_ok} of {5 * layouts}"]


def by_dim_kind(table: dict) -> dict[tuple[str, str], list[int]]:
    """{phase: {dim: {kind: {count, bytes}}}} summed over phases: (dim, kind) -> [count, bytes]."""
    out: dict[tuple[str, str], list[int]] = {}
    for kinds, dim in ((kinds, dim) for dims in table.values() for dim, kinds in dims.items()):
        for kind, c in kinds.items():
            entry = out.setdefault((dim, kind), [0, 0])
            entry[0], entry[1] = entry[0] + c["count"], entry[1] + c["bytes"]
    return out


COMM_COLUMNS = ["layout", "dim", "kind", "count predicted", "count measured",
                "bytes predicted", "bytes measured", "ratio", "mark", "note"]


def comm_table(preds: dict, meas: dict) -> tuple[list[dict], list[str]]:
    """(rows, summary lines): per layout, (dim, kind) and its count and bytes."""
    rows, notes, off = [], [], 0
    for name, p in preds.items():
        row = meas[name]["observed"]
        if "error" in row:
            rows.append({"layout": name, "note": "failed"})
            continue
        pt, mt = by_dim_kind(p.comm), by_dim_kind(row.get("comm", {}))
        if not pt | mt:
            rows.append({"layout": name, "note": "no collectives, predicted or measured"})
        for key in sorted(pt.keys() | mt.keys()):
            (pc, pb), (mc, mb) = pt.get(key, [0, 0]), mt.get(key, [0, 0])
            ratio = pb / mb if mb else float("inf") if pb else 1.0
            good = pc == mc and abs(ratio - 1) <= COMM_TOL
            mark = "" if good else "~" if (name, *key) in KNOWN else "*"
            off += mark == "*"
            if mark == "~":
                notes.append(f"- {name} {key[0]} {key[1]}: {KNOWN[(name, *key)]} "
                             f"(count {pc} / {mc}, bytes ratio {ratio:.3f})")
            rows.append({"layout": name, "dim": key[0], "kind": key[1], "count predicted": pc,
                         "count measured": mc, "bytes predicted": pb, "bytes measured": mb,
                         "ratio": ratio if mb or not pb else None,  # None: measured none
                         "mark": mark, "note": KNOWN.get((name, *key)) if mark == "~" else None})
    return rows, [f"{off} (dim, kind) entries outside {COMM_TOL:.0%} or with other counts, "
                  "besides the known differences:", "\n".join(notes) or "- none"]


def terms(t) -> str:
    parts = [t.terms[k] for k in ("matmul", "attention", "elementwise", "optimizer", "host")]
    return " / ".join(f"{v:.3f}" for v in (*parts, t.exposed_comm_s))


TIME_COLUMNS = ["layout", "ranks", "predicted", "measured", "ratio", "other load (cores)",
                "matmul / attention / elementwise / optimizer / host / comm", "note"]


def time_table(preds: dict, meas: dict) -> tuple[list[dict], list[str]]:
    """(rows, summary lines): the predicted step (s) beside the measured median."""
    rows, ratios = [], {}
    for name, p in preds.items():
        times = [r["step_time_s"] for r in meas[name]["timed"] if "step_time_s" in r]
        if not times:
            rows.append({"layout": name, "ranks": LAYOUTS[name][0], "predicted": p.time.step_s,
                         "note": "failed"})
            continue
        step = statistics.median(times)
        ratios.setdefault(LAYOUTS[name][0], []).append(p.time.step_s / step)
        rows.append({"layout": name, "ranks": LAYOUTS[name][0], "predicted": p.time.step_s,
                     "measured": step, "ratio": p.time.step_s / step,
                     "other load (cores)": meas[name]["other_cores"],
                     TIME_COLUMNS[6]: terms(p.time), "measured steps": times})
    every = [r for rs in ratios.values() for r in rs]
    if not every:
        return rows, ["no layout measured a step"]
    return rows, [f"median ratio over {len(every)} layouts: {statistics.median(every):.2f}; by "
                  "rank count: " + ", ".join(f"{n}: {statistics.median(rs):.2f}"
                                             for n, rs in sorted(ratios.items()))]


TABLES = {
    "memory": ("## 1. Memory per rank at step 2 (MiB, predicted / measured)", memory_table,
               MEMORY_COLUMNS),
    "comm": ("## 2. Communication of rank 0 at step 2, summed over phases", comm_table,
             COMM_COLUMNS),
    "time": ("## 3. Step time (s): predicted / median of steps 3-8 without observers",
             time_table, TIME_COLUMNS),
}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--out", type=Path, help="write every prediction and measured row here")
    parser.add_argument("--cluster", default="cpu", help="the profile to judge: the built-in "
                        "cpu, or benchmarks/fit_cpu_profile.py's TOML fitted on this machine")
    opts = parser.parse_args(argv)
    names = list(QUICK if opts.quick else LAYOUTS)
    start = time.perf_counter()
    cluster = load_cluster(opts.cluster)
    log = sys.stderr if opts.json else sys.stdout  # with --json, stdout holds the JSON alone
    print(f"profile: {cluster.name}", file=log)
    # a bad layout fails before any launch
    preds = {name: prediction(name, cluster) for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        meas = measure(names, Path(tmp))
    every = []
    for table, (title, build, columns) in TABLES.items():
        rows, summary = build(preds, meas)
        every += [{"table": table, **row} for row in rows]
        if not opts.json:
            print(f"\n{title}\n")
            emit(rows, columns, False)
            print("\n" + "\n".join(summary))
    if opts.json:
        emit(every, [], True)
    if opts.out:
        opts.out.write_text(json.dumps({name: {
            "nproc": LAYOUTS[name][0], "args": LAYOUTS[name][1], "label": label(p.layout),
            "predicted": p.to_json(), "measured": meas[name]} for name, p in preds.items()},
            indent=1, default=str))
    print(f"\n{len(names)} layouts in {time.perf_counter() - start:.0f} s", file=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
