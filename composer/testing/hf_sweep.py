"""Every causal LM transformers lists, trained through ``model.name = "hf"`` on each
layout: a tiny random folder per architecture (``hf_tiny``), the jobs of many
architectures in one launch (``run_jobs``) with a short collective timeout, and each cell
held to its reference: the one-process run's step-1 loss to transformers' own loss on the
same tokens, every other layout's losses and gradient norms over its steps to the
one-process run's (LoRA's to LoRA's on one process), float64, relative 1e-9; or the one
line it was refused with.

``benchmarks/hf_sweep.py`` runs it (all, or a part) and writes the JSON that
docs/hf_models.md's table is rendered from (``hf_table``); the suite runs ``SUBSET``'s
one-process, FSDP2 and TP2 cells.
"""
from __future__ import annotations

import datetime
import json
import traceback
from pathlib import Path

import torch

from composer.testing import hf_tiny
from composer.testing.harness import Job, Run, run_jobs
from composer.testing.parity import layout
from composer.testing.sweep import error_line, worst_error

TOLERANCE = 1e-9
FLOAT32_TOLERANCE = 2e-5  # where transformers forces float32 in an op, named in the cell
SEQ, STEPS = 32, 3
COMMON = ["--model.name", "hf", "--training.dtype", "float64", "--training.steps", str(STEPS),
          "--data.seq_len", str(SEQ), "--data.document_mask", "false", "--metrics.log_freq", "1",
          "--metrics.enable_tensorboard", "false", "--metrics.step_anatomy", "false",
          "--validation.enable", "false", "--checkpoint.enable", "false",
          "--lr_scheduler.warmup_steps", "1", "--job.collective_timeout_s", "30"]
LORA = ["--model.converters", "lora", "--lora.rank", "4", "--optimizer.lr", "3e-2"]
# name -> (ranks, arguments, the layout it is held to)
LAYOUTS = {
    "1 process": (*layout(1, zero=3, local=8), None),
    "FSDP2 x2": (*layout(2, zero=3, local=4), "1 process"),
    # sequence parallel as a user gets it: on where the model's plan can cut the stream
    "TP2": (*layout(2, zero=3, local=8, tp=2, sp="auto"), "1 process"),
    "LoRA 1 process": (*layout(1, zero=3, local=8), None),
    "LoRA FSDP2 x2": (*layout(2, zero=3, local=4), "LoRA 1 process"),
    "PP2": (*layout(2, zero=3, local=8, pp=2), "1 process"),
    "CP2": (*layout(2, zero=3, local=8, cp=2), "1 process"),
    "EP2": (*layout(2, zero=3, local=4, extra=("--parallelism.expert_parallel_degree", "2")),
            "1 process"),
}
SHOWN = ["1 process", "FSDP2 x2", "TP2", "LoRA FSDP2 x2", "PP2", "CP2", "EP2"]
EVERY = ["1 process", "FSDP2 x2", "TP2", "LoRA FSDP2 x2"]  # every architecture
SUBSET_ONLY = ["PP2", "CP2", "EP2"]  # the representative subset's
# one architecture per distinct attention / norm / MLP / MoE / positional form of the
# built models (``benchmarks/hf_sweep.py --choose`` picks it from the sweep's classes)
SUBSET = ["ergo", "gpt2", "gpt_bigcode", "jetmoe", "kimi_linear", "lfm3", "mpt", "phi3",
          "vaultgemma"]


def lora_targets(model: torch.nn.Module) -> list[str]:
    """The attention projections: the last names of the linears the attention modules
    hold (``q_proj``, ``c_attn``, ``query_key_value``, ...)."""
    from composer.models.hf.model import attention_modules
    names = {name.rpartition(".")[2] for module in attention_modules(model)
             for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names)


def arch_jobs(arch: str, folder: Path, layouts: list[str], lora: list[str]) -> dict[str, Run]:
    """The training jobs of one architecture's ``layouts`` (with their references)."""
    wanted = {name for name in layouts}
    wanted |= {LAYOUTS[name][2] for name in layouts if LAYOUTS[name][2]}
    jobs = {}
    for name in LAYOUTS:
        if name in wanted:
            nproc, args, _ = LAYOUTS[name]
            extra = [*LORA, "--lora.target_modules", ",".join(lora)] if "LoRA" in name else []
            jobs[f"{arch}/{name}"] = Run(nproc, [*COMMON, *args, *extra,
                                                 "--model.hf_path", str(folder)])
    return jobs


def first_batch(local: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch a one-process job's first step reads."""
    from composer.data import DataLoader, build_tokenizer
    loader = DataLoader("tinyshakespeare", build_tokenizer("byte"), SEQ, local, 0, 1,
                        split="train", val_fraction=0.05, document_mask=False)
    return loader.next_batch()[:2]


def reference_loss(folder: Path) -> tuple[float, list[str]]:
    """transformers' own loss on the first batch (float64, from the folder) and the ops
    in which it forces float32 (``<module class>: <op>``)."""
    from composer.testing.float32_ops import Float32Ops
    model = _built(folder)
    inputs, targets = first_batch()
    with torch.no_grad(), Float32Ops() as ops:
        logits = model(inputs, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), targets.flatten())
    return loss.item(), ops.names()


def _failed(job: Job) -> dict | None:
    if job.code == 2:
        return {"result": "refused", "line": error_line(job)}
    if job.code != 0:
        return {"result": "failed", "line": error_line(job)}
    printed = "".join(p.read_text() for p in sorted(job.logs.glob("rank*.log")))
    if "Traceback (most recent call last)" in printed:
        return {"result": "failed", "line": "a traceback on the console"}
    return None


def _held(error: float, float32: list[str]) -> dict:
    if error <= TOLERANCE:
        return {"result": "pass", "error": error}
    if float32 and error <= FLOAT32_TOLERANCE:
        return {"result": "pass", "error": error, "float32": float32[:3]}
    return {"result": "differs", "error": error, **({"float32": float32[:3]} if float32 else {})}


def cell(jobs: dict[str, Job], arch: str, name: str, reference: tuple[float, list[str]]) -> dict:
    """How one layout of ``arch`` ended, against its reference."""
    job = jobs[f"{arch}/{name}"]
    failed = _failed(job)
    if failed:
        return failed
    rows = job.rows()
    held_to = LAYOUTS[name][2]
    if held_to is None:
        return _held(abs(rows[0]["loss"] - reference[0]) / abs(reference[0]), reference[1])
    base = jobs[f"{arch}/{held_to}"]
    if base.code != 0:
        return {"result": "failed", "line": f"its reference ({held_to}) failed"}
    if [r["step"] for r in rows] != [r["step"] for r in base.rows()]:
        return {"result": "failed", "line": f"steps {[r['step'] for r in rows]}"}
    out = _held(worst_error(rows, base.rows()), reference[1])
    config = (job.folder / "config.toml").read_text()
    if name == "TP2" and "sequence_parallel = false" in config:
        out["sequence_parallel"] = False  # auto turned it off: the model's plan cannot cut
    return out


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def prepare(arch: str, folder: Path) -> dict:
    """Build and save ``arch``'s tiny model; its row so far: overrides, classes, the
    reference loss, its LoRA targets, whether it has a tensor-parallel plan and is an MoE;
    or the error transformers or composer gave."""
    row = {"arch": arch, "date": datetime.date.today().isoformat(),
           "transformers": _transformers_version(), "cells": {}}
    try:
        config, row["overrides"] = hf_tiny.tiny_config(arch)
        hf_tiny.write_folder(arch, folder)
        model = _built(folder)
        row["class"] = hf_tiny.classify(model)
        row["tp_plan"] = bool(model.tp_plan)
        row["lora"] = lora_targets(model)
        row["reference"] = reference_loss(folder)
    except Exception as e:  # transformers' own code, on a config it may refuse
        row["build"] = _one_line(e)
        (folder.parent / f"{arch}.build.log").write_text(traceback.format_exc())
    return row


def _built(folder: Path) -> torch.nn.Module:
    """transformers' own model from the folder (float64): its auto class, or for a config
    that class does not map the class the folder names (Emu3's, Mllama's text model)."""
    import transformers
    kwargs = dict(dtype=torch.float64, experts_implementation="eager")
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except ValueError as e:
        if not str(e).startswith("Unrecognized configuration class"):
            raise
        config = transformers.AutoConfig.from_pretrained(folder)
        return getattr(transformers, config.architectures[0]).from_pretrained(folder, **kwargs)


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


def layouts_of(row: dict, wanted: list[str], subset: list[str]) -> list[str]:
    """Which of ``wanted`` run for this row: TP2 where it has a plan, LoRA where its
    attention has linears, the subset's layouts for the subset, EP2 for an MoE."""
    out = []
    for name in wanted:
        if name == "TP2" and not row["tp_plan"]:
            continue
        if name.startswith("LoRA") and not row["lora"]:
            continue
        if name in SUBSET_ONLY and row["arch"] not in subset:
            continue
        if name == "EP2" and not row["class"]["moe"].startswith("moe"):
            continue
        out.append(name)
    return out


def sweep(archs: list[str], folder: Path, wanted: list[str] = EVERY + SUBSET_ONLY,
          subset: list[str] | None = None, per_launch: int = 8) -> list[dict]:
    """Every architecture of ``archs`` on ``wanted`` (the subset's layouts for ``subset``,
    default ``SUBSET``), ``per_launch`` architectures a launch; one row each."""
    subset = SUBSET if subset is None else subset
    rows = [prepare(arch, folder / arch) for arch in archs]
    ready = [row for row in rows if "build" not in row]
    for start in range(0, len(ready), per_launch):
        group = ready[start:start + per_launch]
        plan = {row["arch"]: layouts_of(row, wanted, subset) for row in group}
        jobs: dict[str, Run] = {}
        for row in group:
            jobs.update(arch_jobs(row["arch"], folder / row["arch"], plan[row["arch"]],
                                  row["lora"]))
        ended = _run(jobs, folder / f"launch{start // per_launch}")
        for row in group:
            row["cells"] = {name: cell(ended, row["arch"], name, tuple(row["reference"]))
                            for name in plan[row["arch"]]}
            row["seconds"] = round(sum(_seconds(job) for name, job in ended.items()
                                       if name.startswith(f"{row['arch']}/")), 1)
    for row in rows:
        if "build" in row:
            row["cells"] = {"1 process": {"result": "failed", "line": row["build"]}}
        for out in row["cells"].values():  # the same line from any folder
            if "line" in out:  # the same line from any folder; the traceback's file aside
                line = out["line"].replace(str(folder / row["arch"]), "FOLDER")
                out["line"] = line.partition("; traceback in ")[0]
    return rows


def _seconds(job: Job) -> float:
    """How long the job's rank 0 ran (0 for a job that never ended)."""
    ended = job.logs / "exit-rank0.json"
    return json.loads(ended.read_text())["seconds"] if ended.is_file() else 0.0


def _run(jobs: dict[str, Run], folder: Path) -> dict[str, Job]:
    """The launch's jobs; should the launch itself hang or die, each job not ended fails."""
    try:
        return run_jobs(jobs, folder, timeout=60 + 45 * len(jobs))
    except AssertionError as e:  # the harness's timeout
        from composer.testing.harness import jobs_ended, write_plan
        return jobs_ended(write_plan(jobs, folder), str(e)[-2000:])
