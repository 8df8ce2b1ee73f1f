"""Check that the docs cannot go stale: every command they show still parses, and the
figures the small walk-throughs quote are still what their commands print.

1. Commands. Every line of every ```bash block in README.md and docs/*.md, run from a
   scratch folder that sees the repository's train_configs/, scripts/, tests/ and
   examples/: a training command (``composer-train``, ``python -m composer.train``, under
   ``torchrun`` or with ``--nproc``) has its job planned for the world it starts
   (``composer.job.plan.plan_job``: the config, every override, the layout for that many
   ranks, the data and the checkpoint paths; a key renamed or removed fails here); a
   planner command runs; ``composer-tiny-hf`` runs (later lines read its folder);
   any other script a line names exists. A block whose first line says what it needs
   (``# needs GPUs``, ``# needs a cluster``, ``# needs ...``) is skipped (counted); a block
   whose first line is ``# refused`` must fail; a line of another program (pip, pytest,
   sbatch, ...) is counted as not composer's.
2. Figures. Each entry of ``FIGURES`` runs its command (at the size the page states) and
   finds the quoted figure in the page and the printed one in the output, by regular
   expression; a relative difference beyond its tolerance fails.

    OMP_NUM_THREADS=1 python scripts/check_docs.py [--no-figures]

Exit status 0 when everything holds, 1 with one line per problem otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from composer.cli.launch import split
from composer.cli.run import cluster_flag
from composer.config import ConfigError, parse_args
from composer.job.plan import plan_job
from composer.planner.cli import main as plan

ROOT = Path(__file__).resolve().parents[1]

SKIP_MARKS = ("# needs ",)  # "# needs GPUs", "# needs a cluster", "# needs tiny.py (above)"
TRAIN = ("composer-train", "composer.train")
PLAN = ("composer-plan", "composer.planner")
# flags the entry points take beside the config's keys (composer.cli, composer.tools.dry_run)
ENTRY_FLAGS = {"--validate": 0, "--dry-run": 0, "--json": 0, "--print-config": 0,
               "--dry-run-rank": 1, "--cluster": 1, "--help": 0}


@dataclass
class Figure:
    """A figure ``page`` quotes (``quoted``: a regex whose group 1 is the number) and
    the command that prints it (``printed``: a regex on its output)."""

    page: str
    command: list[str]
    quoted: str
    printed: str
    rel_tol: float
    cwd: str = str(ROOT)  # "{tmp}": a scratch folder the figures' commands share, in order


QUICK = [sys.executable, "-m", "composer.train", "--config", "train_configs/debug_model.toml",
         "--training.steps", "20", "--job.dump_folder", "{tmp}/quick"]
PLAN_70B = [sys.executable, "-m", "composer.planner", "--config", "train_configs/llama3_70b.toml",
            "--cluster", "h100-80gb", "--nodes", "8", "--search", "--top", "3"]
TOP_70B = r"\n  1  pp4 shard4 cp2 tp2 zero2 ac:selective_op mbs32 +"  # its peak GiB, step s
S7 = ("dim=4096,n_layers=32,n_heads=32,n_kv_heads=32,vocab_size=32000,multiple_of=256,"
      "ffn_dim_multiplier=1.0")
PLAN_7B = [sys.executable, "-m", "composer.planner", "--config", "train_configs/llama3_8b.toml",
           "--model.overrides", S7, "--data.seq_len", "4096", "--training.global_batch_size",
           "32", "--parallelism.zero_stage", "0", "--cluster", "a100-80gb"]
ONE_NODE = [sys.executable, "-m", "composer.planner", "--cluster", "h100-80gb", "--nodes", "1"]
PRETRAIN = [sys.executable, "-m", "composer.train", "--config",
            str(ROOT / "train_configs" / "debug_model.toml"), "--checkpoint.enable",
            "--checkpoint.last_save_in_hf"]
LORA = [sys.executable, "-m", "composer.train", "--nproc", "2", "--config",
        str(ROOT / "train_configs" / "debug_lora.toml")]
FIGURES = [
    # CPU float32 in one process: the same machine gives the same bits; another CPU's
    # kernels may round differently
    Figure("README.md", QUICK, r"step 20/20  loss (\d+\.\d+)", r"step 20/20  loss (\d+\.\d+)",
           0.02),
    Figure("README.md", QUICK, r"step 20/20  loss \S+  val (\d+\.\d+)",
           r"step 20/20  loss \S+  val (\d+\.\d+)", 0.02),
    # the planner is arithmetic: a change of its model shows here
    Figure("README.md", PLAN_70B, TOP_70B + r"(\d+\.\d+)", TOP_70B + r"(\d+\.\d+)", 0.01),
    Figure("README.md", PLAN_70B, TOP_70B + r"\S+ +(\d+\.\d+)", TOP_70B + r"\S+ +(\d+\.\d+)",
           0.01),
    # docs/fine_tuning.md's LoRA walk-through, steps 1 and 2, in a scratch folder (step 2
    # starts from step 1's export, outputs/debug_model/checkpoint/step-200-hf)
    Figure("docs/fine_tuning.md", PRETRAIN, r"loss (\d+\.\d+) at step 200",
           r"step 200/200  loss (\d+\.\d+)", 0.02, "{tmp}"),
    Figure("docs/fine_tuning.md", LORA, r"-> (\d+\.\d+)\n#\s+\(step 300\)",
           r"step 300/300  loss (\d+\.\d+)", 0.03, "{tmp}"),
    Figure("docs/fine_tuning.md", LORA, r"-> (\d+\.\d+) \(step 300\)",
           r"step 300/300  loss \S+  val (\d+\.\d+)", 0.03, "{tmp}"),
    # docs/planner.md's walk-throughs: 7B on one A100 and on four; 70B on one node
    Figure("docs/planner.md", [*PLAN_7B, "--world-size", "1"],
           r"peak (\d+\.\d+) of 78.50 usable: DOES NOT FIT", r"peak (\d+\.\d+) of", 0.01),
    Figure("docs/planner.md", [*PLAN_7B, "--world-size", "4", "--search", "--top", "3"],
           r"\n  1  shard4 zero2 ac:selective_op mbs2x4 +(\d+\.\d+)",
           r"\n  1  shard4 zero2 ac:selective_op mbs2x4 +(\d+\.\d+)", 0.01),
    Figure("docs/planner.md", [*ONE_NODE, "--config", "train_configs/llama3_70b.toml", "--search"],
           r"needs (\d+\.\d+) GiB per rank of 78.1 usable", r"needs (\d+\.\d+) GiB", 0.01),
    Figure("docs/planner.md", [*ONE_NODE, "--config", "train_configs/llama3_70b_lora.toml"],
           r"peak (\d+\.\d+) of 78.10 usable: fits", r"peak (\d+\.\d+) of", 0.01),
]


def blocks(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, lines) of each ```bash block, continuation lines joined."""
    out, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() in ("```bash", "```sh"):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            joined = "\n".join(body).replace("\\\n", " ")
            out.append((start + 1, joined.splitlines()))
        i += 1
    return out


def words(line: str) -> tuple[list[str], int | None]:
    """The command's words (no prompt, comment, or leading VAR=value assignments) and the
    WORLD_SIZE one of those assignments gives."""
    line = line.strip().removeprefix("$ ")
    try:
        parts = shlex.split(line, comments=True)
    except ValueError:
        return [], None
    world = None
    while parts and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", parts[0]):
        name, value = parts.pop(0).split("=", 1)
        world = int(value) if name == "WORLD_SIZE" and value.isdigit() else world
    return parts, world


def _option(args: list[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in names:
            return value or (args[i + 1] if i + 1 < len(args) else None)
    return None


def world_of(parts: list[str], env_world: int | None) -> int:
    """The ranks a training command starts: --nproc or torchrun's per-node count, times
    --nnodes; else WORLD_SIZE=N before it; else 1."""
    per_node = _option(parts, "--nproc", "--nproc_per_node", "--nproc-per-node")
    nodes = _option(parts, "--nnodes")
    if per_node and per_node.isdigit():
        return int(per_node) * (int(nodes) if nodes and nodes.isdigit() else 1)
    return env_world or 1


def _entry_free(args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in ENTRY_FLAGS:
            i += 1 + (ENTRY_FLAGS[name] if "=" not in args[i] else 0)
            continue
        out.append(args[i])
        i += 1
    return out


def check_command(parts: list[str], env_world: int | None = None) -> str | None:
    """What is wrong with one composer command, or None: a training command's job is
    planned for the world it starts (``plan_job``: every check before a process group,
    its dump folder's earlier runs aside); a planner command runs."""
    text = " ".join(parts)
    if any(p.endswith(TRAIN) for p in parts[:6]) or parts[0] == "composer-train":
        at = next(i for i, p in enumerate(parts) if p.endswith(TRAIN))
        args = parts[at + 1:]
        if "--help" in args or "..." in args:
            return None
        if any(a == "--nproc" or a.startswith("--nproc=") for a in args):
            _, _, args = split(args)
        cfg, _ = parse_args(cluster_flag([*_entry_free(args), "--job.overwrite", "true"]))
        plan_job(cfg, 0, world_of(parts, env_world))
        return None
    if any(p.endswith(PLAN) for p in parts[:4]):
        at = next(i for i, p in enumerate(parts) if p.endswith(PLAN))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = plan(parts[at + 1:])
        return None if code == 0 else f"exit {code}: {text}"
    if parts[:1] == ["composer-tiny-hf"]:  # later lines read its folder
        done = subprocess.run([sys.executable, "-m", "composer.tools.tiny_hf", *parts[1:]],
                              capture_output=True, text=True, timeout=300)
        return None if done.returncode == 0 else f"exit {done.returncode}: {text}"
    for p in parts:
        if p.startswith("scripts/") and not (ROOT / p).exists():
            return f"{p} does not exist ({text})"
    return "other"


def check_commands() -> tuple[list[str], dict[str, int]]:
    """In a scratch folder that sees the repository's configs, scripts, tests and examples
    (the docs' relative paths), so what the commands write stays there."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("train_configs", "scripts", "benchmarks", "tests", "examples"):
            (Path(tmp) / name).symlink_to(ROOT / name)
        here = os.getcwd()
        os.chdir(tmp)
        sys.path.insert(0, tmp)  # as `python -m` puts the folder it runs in on the path
        try:
            return _check_commands()
        finally:
            sys.path.remove(tmp)
            os.chdir(here)


def _check_commands() -> tuple[list[str], dict[str, int]]:
    problems, counts = [], {"checked": 0, "marked": 0, "other": 0}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line_no, lines in blocks(page):
            first = next((line.strip() for line in lines if line.strip()), "")
            if first.startswith(SKIP_MARKS):
                counts["marked"] += 1
                continue
            refused = first.startswith("# refused")
            for k, line in enumerate(lines):
                parts, env_world = words(line)
                if not parts:
                    continue
                try:
                    logging.disable(logging.WARNING)
                    verdict = check_command(parts, env_world)
                    verdict = "not refused" if refused and verdict is None else verdict
                except (ConfigError, ValueError) as e:
                    verdict = None if refused else f"{e}"
                finally:
                    logging.disable(logging.NOTSET)
                if verdict == "other":
                    counts["other"] += 1
                elif verdict is None:
                    counts["checked"] += 1
                else:
                    problems.append(f"{page.relative_to(ROOT)}:{line_no + k}: {verdict}")
    return problems, counts


def check_figures(tmp: Path) -> list[str]:
    problems, outputs = [], {}
    for f in FIGURES:
        command = [c.format(tmp=tmp) for c in f.command]
        key = tuple(command)
        if key not in outputs:
            done = subprocess.run(command, cwd=f.cwd.format(tmp=tmp), capture_output=True,
                                  text=True, timeout=900,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            outputs[key] = done.stdout + done.stderr
        page = (ROOT / f.page).read_text()
        quoted, printed = re.search(f.quoted, page), re.search(f.printed, outputs[key])
        if quoted is None or printed is None:
            what = "the page" if quoted is None else "the output"
            problems.append(f"{f.page}: {f.quoted!r} not found in {what} "
                            f"({' '.join(f.command[1:6])} ...)")
            continue
        q, p = float(quoted.group(1)), float(printed.group(1))
        if abs(q - p) > f.rel_tol * abs(p):
            problems.append(f"{f.page}: quotes {q}, the command now prints {p} "
                            f"(tolerance {f.rel_tol:.0%}): {' '.join(f.command[1:6])} ...")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-figures", action="store_true", help="check the commands only")
    opts = parser.parse_args()
    start = time.perf_counter()
    problems, counts = check_commands()
    if not opts.no_figures:
        with tempfile.TemporaryDirectory() as tmp:
            problems += check_figures(Path(tmp))
    for problem in problems:
        print(problem)
    print(f"docs: {counts['checked']} composer commands planned or run, {counts['marked']} blocks "
          f"marked with what they need, {counts['other']} other programs' lines, "
          f"{0 if opts.no_figures else len(FIGURES)} figures re-run; {len(problems)} "
          f"problem(s) in {time.perf_counter() - start:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
