"""Your own model, however you wrote it: every style of examples/own_models.py (a plain
loop over an nn.ModuleList, an nn.Sequential trunk, an nn.ModuleDict, a tied head, GPT-2,
parallel attention and MLP, grouped-query attention, a router of its own, a forward taking
keyword arguments), with the spec a user would write, trained through ``--model.name
module:attribute`` on FSDP2 x2, TP2, PP2 and CP2 (float64, 4 steps, all in one launch), the
planner's peak with no shape given, and the dry run on TP2.

Reference: each layout beside the one-process run (its worst relative error of loss and
gradient norm over the steps; ``pass`` at <= 1e-9), or the one line it was refused with;
the planner's peak beside ``metrics.memory_breakdown``'s measured one (flavor ``small``,
seq 256, micro-batch 4, float32, one process) and their ratio; the dry run's traced peak
beside the planner's for the same TP2 job.

    OMP_NUM_THREADS=1 python benchmarks/bench_own_models.py [--json] [STYLE ...]
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from composer.config.parse import import_from_here
from composer.testing.report import bench_parser, emit_tables
from composer.testing.sweep import LAYOUTS, REFERENCE, dry_run, planned, sweep

MODULE = "examples.own_models"  # run from the repository's root

SWEPT = [name for name in LAYOUTS if name != REFERENCE]
TP2 = ["--data.seq_len", "256", "--training.local_batch_size", "4", "--model.flavor", "small",
       "--training.dtype", "float32", "--parallelism.tensor_parallel_degree", "2"]


def cell(out: dict) -> str:
    if out["result"] == "pass":
        return f"pass ({out['error']:.1e})"
    return f"{out['result']}: {out.get('line', out.get('error'))}"


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("styles", nargs="*", help="default: every style of " + MODULE)
    args = parser.parse_args(argv)
    styles = args.styles or import_from_here(MODULE).STYLES
    models = {style: f"{MODULE}:{style}" for style in styles}
    with tempfile.TemporaryDirectory() as folder:
        out = sweep({model: SWEPT for model in models.values()}, Path(folder),
                    memory=list(models.values()))
    layouts, memory, refusals = [], [], {}
    for style, model in models.items():
        row = {"style": style}
        for name, result in out[model]["layouts"].items():
            if result["result"] == "refused":  # the same line for many: said once, below
                key = result["line"].replace(f"'{style}'", "'<style>'")
                refusals.setdefault(key, len(refusals) + 1)
                row[name] = f"refused ({refusals[key]})"
            else:
                row[name] = cell(result)
        layouts.append(row)
        m = out[model]["memory"]
        traced = dry_run(model, 2, TP2)
        plan = planned(model, [*TP2, "--world-size", "2"])
        memory.append({"style": style, "planned peak GiB": m.get("planned"),
                       "measured peak GiB": m.get("measured"), "planned / measured": m.get("ratio"),
                       "dry run TP2 traced GiB": traced.get("peak"),
                       "planner TP2 GiB": plan.get("memory_gib", {}).get("peak"),
                       "note": m.get("line") or traced.get("line") or plan.get("line", "")})
    lines = [{"n": n, "line": line} for line, n in refusals.items()]
    emit_tables([
        ("Each layout against one process (worst relative error)", layouts, ["style", *SWEPT]),
        ("Refusals", lines, ["n", "line"]),
        ("The planner with no shape given, and the dry run", memory,
         ["style", "planned peak GiB", "measured peak GiB", "planned / measured",
          "dry run TP2 traced GiB", "planner TP2 GiB", "note"]),
    ], args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
