"""Every causal LM transformers lists (its own auto mapping, in the installed version),
as a tiny random model built from its config class on CPU, trained through
``model.name = "hf"`` on each layout: 1 process (its step-1 loss against transformers'
own loss on the same tokens), FSDP2 x2, TP2 (where the config has a tensor-parallel
plan) and LoRA under FSDP2 x2 (adapters on the attention projections) for every
architecture; PP2, CP2 and EP2 (MoE) for the representative subset. float64, 3 steps,
relative 1e-9 (2e-5 where transformers forces float32 in an op, named in the cell).

Reference: each cell beside its reference run (transformers' own loss for 1 process,
the 1-process run for the others, LoRA on 1 process for LoRA); or the one line it was
refused with. Writes the rows (``--out``, each stamped with its date and the transformers
version) that ``--render`` turns into docs/hf_models.md's support table.

    OMP_NUM_THREADS=1 python benchmarks/hf_sweep.py --shard 1/4 --out part1.json
    python benchmarks/hf_sweep.py --merge part*.json --out benchmarks/hf_sweep.json --render
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from composer.testing import hf_sweep, hf_table, hf_tiny
from composer.testing.report import bench_parser

RESULTS = Path(__file__).with_name("hf_sweep.json")


def merged(parts: list[list[dict]]) -> list[dict]:
    """One row per architecture: a later part's over an earlier part's, its cells added to
    the earlier ones (the subset's layouts swept after the others), the seconds of both."""
    rows: dict[str, dict] = {}
    for part in parts:
        for row in part:
            before = rows.get(row["arch"], {})
            rows[row["arch"]] = {**row, "cells": {**before.get("cells", {}), **row["cells"]}}
            if "seconds" in row or "seconds" in before:
                rows[row["arch"]]["seconds"] = round(before.get("seconds", 0)
                                                     + row.get("seconds", 0), 1)
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--arch", action="append", help="an architecture (model type); "
                        "repeatable; default: every one transformers lists")
    parser.add_argument("--layouts", default=",".join(hf_sweep.EVERY + hf_sweep.SUBSET_ONLY),
                        help="comma-separated, of: " + ", ".join(hf_sweep.SHOWN))
    parser.add_argument("--shard", default="1/1", help="i/n: the i-th of n equal parts")
    parser.add_argument("--out", type=Path, help="write the rows here (JSON)")
    parser.add_argument("--merge", nargs="*", type=Path, help="merge these rows' files "
                        "instead of sweeping")
    parser.add_argument("--render", action="store_true", help="render the rows into "
                        "docs/hf_models.md's table")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (the "
                        "tiny models, each job's logs); default: a temporary one")
    parser.add_argument("--choose", action="store_true", help="print the representative "
                        "subset the rows' classes give")
    args = parser.parse_args(argv)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in hf_sweep.LAYOUTS]
    if unknown:
        parser.error(f"--layouts: {unknown[0]!r}; allowed: {', '.join(hf_sweep.SHOWN)}")
    if args.merge is not None:
        rows = merged([json.loads(path.read_text())["rows"] for path in args.merge])
        seconds = sum(json.loads(path.read_text())["seconds"] for path in args.merge)
    else:
        index, parts = (int(x) for x in args.shard.split("/"))
        archs = args.arch or hf_tiny.causal_lm_types()
        archs = archs[index - 1::parts]
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as folder:
            rows = hf_sweep.sweep(archs, args.keep or Path(folder), layouts)
        seconds = time.monotonic() - start
    result = {"rows": sorted(rows, key=lambda r: r["arch"]), "seconds": round(seconds)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.choose:
        print("SUBSET =", hf_table.choose_subset(rows))
    if args.render:
        hf_table.write_page(result)
    if args.json:
        print(json.dumps(result["rows"], indent=1))
    else:
        print(hf_table.summary(result))
        print(hf_table.table(result["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
