"""The run record: what it takes to reproduce a run from its folder.

At the start rank 0 writes ``config.toml`` (the resolved config: ``--config`` it
to run the job again) and ``run.json`` (versions, the project's git commit,
world size, mesh degrees, hosts and devices, the seed, the NCCL_*/TORCH_*
environment). A resumed run keeps both and adds an entry to ``run.json``'s
``resumes``.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from composer.checkpoint.dcp import STEP
from composer.config import to_toml, tomllib
from composer.observe.base import Observer

ENV_PREFIXES = ("NCCL_", "TORCH_")
log = logging.getLogger("composer")


def versions() -> dict[str, str | None]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name, dist_name in (("composer", "composer-parallel"), ("torchao", "torchao")):
        try:
            out[name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(folder: Path) -> dict | None:
    """The commit of the git checkout holding ``folder`` and whether it has
    uncommitted changes; None outside one (an installed package)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):  # Linux names the CPU model here
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def everyones(value: str) -> list[str]:
    """``value`` from every rank (one small gather at the start)."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class RunRecord(Observer):
    """Writes the record when made (rank 0); holds nothing while the run goes on."""

    def __init__(self, plan, folder: Path):
        dims = plan.dims
        hosts = everyones(socket.gethostname())
        devices = everyones(device_name(plan.device))
        if plan.rank != 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        run = folder / "run.json"
        mesh = {name: getattr(dims, name) for name in
                ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
        where = {"world_size": dims.world_size, "mesh": mesh, "hosts": hosts, "devices": devices}
        if plan.resume is not None and run.is_file():
            record = json.loads(run.read_text())
            step = STEP.match(plan.resume.name)
            changed = config_changes(folder / "config.toml", plan.cfg)
            if changed:
                log.warning("resuming with a changed config: %s", ", ".join(
                    f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items()))
            record.setdefault("resumes", []).append(
                {"time": now(), "step": int(step.group(1)) if step else None,
                 "checkpoint": str(plan.resume), "command": sys.argv, "changed": changed,
                 **where})
        else:
            (folder / "config.toml").write_text(to_toml(plan.cfg))
            record = {"time": now(), "versions": versions(),
                      "git": git_commit(Path(__file__).resolve().parent), **where,
                      "seed": plan.cfg.job.seed, "command": sys.argv,
                      "env": {k: v for k, v in sorted(os.environ.items())
                              if k.startswith(ENV_PREFIXES)},
                      "resumes": []}
        _write(run, record)


def _flat(tables: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tables.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(recorded: Path, cfg) -> dict[str, list]:
    """{key: [recorded value, this run's]} where the resolved config differs from the one
    the run's folder records (None: a key one of them lacks)."""
    if not recorded.is_file():
        return {}
    old, new = (_flat(tomllib.loads(text)) for text in (recorded.read_text(), to_toml(cfg)))
    return {key: [old.get(key), new.get(key)] for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)}


def _write(run: Path, record: dict) -> None:
    """Replace ``run`` whole: a crash leaves the old record or the new one."""
    tmp = run.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, run)


def amend_record(folder: Path, key: str, value) -> None:
    """Set ``run.json``'s ``key`` (e.g. a component's settings and events) in ``folder``."""
    run = folder / "run.json"
    record = json.loads(run.read_text()) if run.is_file() else {}
    _write(run, {**record, key: value})


def record_of(plan) -> Callable[[str, object], None]:
    """``record(key, value)``: set ``key`` of the run's record (rank 0 writes it)."""
    if plan.rank != 0:
        return lambda key, value: None
    return functools.partial(amend_record, Path(plan.cfg.job.dump_folder))


def record_observer(view) -> RunRecord:
    return RunRecord(view.plan, Path(view.cfg.job.dump_folder))
