"""The dry run (``composer.train --dry-run``) of every shipped config at its intended world
size, beside the planner: traced peak, planned peak, their ratio, whether the collectives
agree (count and bytes of every phase/dim/kind), the run's wall and CPU seconds (on a busy
machine its wall time is mostly waiting) and its largest resident memory. The world is what
the config's opening comment states (``--nproc_per_node=N``, or N nodes of 8 ranks).
Each config runs in its own process; one whose Hugging Face folder is missing says so
(``composer-tiny-hf`` writes hf_lora_debug's).

Reference: the planner's prediction (``planned``) beside the peak the dry run traced on
fake tensors (``traced``), their ratio planned / traced, and the planner's collectives
beside the traced ones (``comm agrees``).

    OMP_NUM_THREADS=1 python benchmarks/bench_dry_run.py [config-name ...] [--json]
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

from composer.testing.harness import ROOT
from composer.testing.report import bench_parser, emit

COLUMNS = ["config", "world", "traced peak GiB", "planned peak GiB", "planned / traced",
           "comm agrees", "wall s", "cpu s", "RSS GiB", "note"]
RANKS_A_NODE = 8


def intended_world(config: Path) -> int:
    """The world size the config's opening comment states."""
    opening = "".join(line for line in config.read_text().splitlines(keepends=True)
                      if line.startswith("#"))
    found = re.search(r"nproc_per_node=(\d+)", opening)
    if found:
        return int(found.group(1))
    found = re.search(r"(\d+|one) nodes? of 8", opening)
    if found is None:
        raise ValueError(f"{config.name}: its opening comment states no world size")
    return RANKS_A_NODE * (1 if found.group(1) == "one" else int(found.group(1)))


def comm_rows(comm: dict) -> dict:
    return {(p, d, k): (c["count"], c["bytes"]) for p, dims in comm.items()
            for d, kinds in dims.items() for k, c in kinds.items()}


def dry_run(config: Path, world: int) -> dict:
    """One config's dry run in a process of its own: its JSON, with its CPU seconds and
    largest resident set (GiB)."""
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "composer.train", "--dry-run", "--json",
                                 "--config", str(config)], cwd=ROOT, env=env, stdout=out,
                                stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own resource usage
        out.seek(0), err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:  # the kernel's out-of-memory killer sends 9
            return {"error": f"killed by signal {-code} at {usage.ru_maxrss / 2**20:.1f} GiB "
                             "resident"}
        if code != 0:
            return {"error": (err.read().strip().splitlines() or ["?"])[-1]}
        result = json.loads(out.read())
    result["rss_gib"] = usage.ru_maxrss / 2**20
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    return result


def row(config: Path) -> dict:
    world = intended_world(config)
    entry = {"config": config.stem, "world": world}
    folder = tomllib.loads(config.read_text()).get("model", {}).get("hf_path")
    if folder and not (ROOT / folder).is_dir():
        return {**entry, "note": f"needs {folder}, a Hugging Face folder"}
    result = dry_run(config, world)
    if "error" in result:
        return {**entry, "note": f"error: {result['error']}"}
    if result["traced"] is None:
        return {**entry, "note": f"not traced: {'; '.join(result['skipped'])}"}
    traced = result["traced"]["memory_gib"]["peak"]
    planned = result["planned"]["memory_gib"]["peak"]
    same = comm_rows(result["traced"]["comm"]) == comm_rows(result["planned"]["comm"])
    skipped = f"skipped: {'; '.join(result['skipped'])}" if result["skipped"] else None
    return {**entry, "traced peak GiB": traced, "planned peak GiB": planned,
            "planned / traced": planned / traced, "comm agrees": "yes" if same else "NO",
            "wall s": result["seconds"], "cpu s": result["cpu_s"], "RSS GiB": result["rss_gib"],
            "note": skipped}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("names", nargs="*", metavar="config-name",
                        help="configs of train_configs/ by name (no .toml); all when none")
    args = parser.parse_args(argv)
    configs = sorted((ROOT / "train_configs").glob("*.toml"))
    if args.names:
        configs = [c for c in configs if c.stem in args.names]
    rows = []
    for config in configs:
        rows.append(row(config))
        print(f"{config.stem}: done", file=sys.stderr, flush=True)  # progress; stdout is the table
    emit(rows, COLUMNS, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
