"""What the tools that run a trained model share (``generate``, ``eval``): their own
options beside training's, the job planned for answering, and the model built on its
layout with its weights loaded."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

import torch.distributed as dist
from torch import nn

from composer.config import ConfigError, JobConfig, parse_args
from composer.inference.decode import INFERENCE, checkpoint_args, dcp_step, load_weights
from composer.job.groups import init_distributed
from composer.job.plan import Plan, plan_job
from composer.torch_compat import release_meshes
from composer.trainer.build import build_model


def setup_logging(rank: int) -> None:
    """Logs to stderr (rank 0 its progress, the others their warnings): stdout is the
    tool's output."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S",
                        force=True)


def start(argv: list[str] | None, doc: str, flags: tuple[str, ...]
          ) -> tuple[list[str], dict[str, bool], int, int] | None:
    """A tool's command line read: (training's arguments, which of ``flags`` are set,
    rank, world size) with logging set up; None where it asked for ``--help`` (printed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(doc)
        return None
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    setup_logging(rank)
    return [a for a in argv if a not in flags], {f: f in argv for f in flags}, rank, world_size


def take_options(argv: list[str], options: dict[str, str | None]) -> dict[str, str | None]:
    """The tool's own options (name -> default), removed from ``argv`` (what stays is
    training's)."""
    out = dict(options)
    for name in options:
        while name in argv:
            i = argv.index(name)
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value")
            out[name] = argv[i + 1]
            del argv[i:i + 2]
    return out


def number(options: dict, name: str, kind: type, low: float, high: float | None = None,
           above: bool = False):
    """The option as a number in its range; ConfigError naming it otherwise."""
    text = options[name]
    try:
        value = kind(text)
    except (TypeError, ValueError):
        value = None
    fits = value is not None and (value > low if above else value >= low) and (
        high is None or value <= high)
    if not fits:
        span = f"{'(' if above else '['}{low}, {high if high is not None else 'inf'}]"
        raise ConfigError(f"{name} {text}: allowed: a{'' if kind is float else ' whole'} "
                          f"number in {span}")
    return value


def check_layout(cfg: JobConfig) -> None:
    """A model that answers runs whole sequences through one model: no pipeline
    stages, no sequence cut over context-parallel ranks."""
    p = cfg.parallelism
    for key, value in (("pipeline_parallel_degree", p.pipeline_parallel_degree),
                       ("context_parallel_degree", p.context_parallel_degree)):
        if value > 1:
            raise ConfigError(f"parallelism.{key}={value}: generation runs the whole model on "
                              f"whole sequences; allowed: 1")


def plan_answering(argv: list[str], checkpoint: str | None, rank: int, world_size: int
                   ) -> tuple[Plan, Path | None]:
    """The checked job (training's config and overrides, less what answering does not
    need) and the DCP step to load; ConfigError for bad input."""
    cfg, _ = parse_args([*argv, *INFERENCE, *checkpoint_args(checkpoint)])
    check_layout(cfg)
    plan = plan_job(cfg, rank, world_size)
    try:
        return plan, dcp_step(checkpoint)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@contextlib.contextmanager
def loaded_model(plan: Plan, step: Path | None, world_size: int) -> Iterator[nn.Module]:
    """The model on the plan's layout, weights loaded, in eval mode; the process groups
    end after."""
    init_distributed(plan, world_size)
    try:
        parts = build_model(plan)
        load_weights(plan, parts, step)
        yield parts[0].eval()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            release_meshes()
