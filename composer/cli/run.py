"""The command line: arguments -> plan -> process groups -> Trainer -> exit status.

    torchrun --nproc_per_node=4 -m composer.train --config train_configs/debug_model.toml
    composer-train --config train_configs/debug_model.toml --validate
    WORLD_SIZE=64 composer-train --config llama3_70b --validate [--cluster h100-80gb]
    WORLD_SIZE=64 composer-train --config train_configs/llama3_70b.toml --dry-run [--json]

Everything that can be wrong with the input is found in ``plan_job``, before any
process group exists, so bad input ends with one line and exit status 2 on
every rank instead of a hang; a fault ends with its one line and its class's
status (``composer.faults.diagnosis``); any other exception, in the model, a pass, the
optimizer or a checkpoint, ends with one line naming where (status 10; 2 for what the
build refuses), its traceback in ``<job.dump_folder>/logs/rank<R>.log``. ``run_argv``
is the one entry: the console script,
``python -m composer.train`` and the tests' job runner all call it.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from composer.checkpoint.dcp import last_complete
from composer.cli.help import print_help, wants_help
from composer.cli.launch import launch, split
from composer.config import ConfigError, JobConfig, parse_args, to_toml
from composer.faults.diagnosis import (
    BUILD,
    TERMINATED,
    Doing,
    SigtermStop,
    Terminated,
    announce,
    diagnose,
    internal_error,
    layout_of,
    terminate_requested,
)
from composer.faults.recovery import RecoveryError
from composer.job.groups import init_distributed
from composer.job.plan import Plan, plan_job
from composer.job.preflight import clear_records
from composer.planner.predict import configured_cluster, planned_peak, validation_report
from composer.tools import dry_run
from composer.torch_compat import pending_collectives, release_meshes, untested_torch
from composer.trainer.trainer import Trainer

log = logging.getLogger("composer")


def setup_logging(rank: int, stream=None) -> None:
    """Rank 0 logs its progress, the others their warnings, to ``stream`` (stdout)."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=stream or sys.stdout, force=True)


def run(plan: Plan, world_size: int, store: dist.Store | None = None,
        estimate: Callable[[], str] | None = None) -> int:
    """Train the planned job; returns the exit status: 0, 130 when interrupted (Ctrl-C),
    143 when SIGTERM stopped it (after saving the step, where checkpoints are on), 3
    when recovery gave up, a fault's class (composer.faults.diagnosis) with its one line;
    any other exception is one line too (10, or 2 for what the build refuses), its
    traceback in the rank's log file. ``estimate``: the planner's peak in words, for an
    out-of-memory line."""
    store = init_distributed(plan, world_size, store)
    cfg = plan.cfg
    folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    doing = Doing(folder=folder, timeout_s=cfg.job.collective_timeout_s,
                  groups=plan.dims.groups() if dist.is_initialized() else None, estimate=estimate,
                  last_step=functools.partial(last_complete, folder))
    trainer = None
    if plan.rank == 0:
        clear_records(cfg, plan.resume)
    try:
        trainer = Trainer(plan, doing, stops=SigtermStop(store))
        trainer.fit()
        return 0
    except KeyboardInterrupt:  # one line for the job: every rank had the signal
        if plan.rank == 0:
            log.warning("interrupted at step %d; stopping", trainer.step if trainer else 0)
        return 130
    except Terminated as e:
        saved = f"; saved {folder / f'step-{e}'}" if trainer.saves and trainer.replicas.saves \
            else ""
        log.warning("SIGTERM: stopped after step %s%s", e, saved)
        return TERMINATED
    except ConfigError as e:  # found once the data is read: the same on every rank
        if plan.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except RecoveryError as e:
        if plan.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 3
    except (Exception, CheckpointException) as e:
        fault = diagnose(e, doing) or internal_error(
            e, doing, plan.rank, layout_of(plan.dims), log_file(cfg, plan.rank),
            trainer.parts if trainer is not None else [])
        announce(plan.rank, fault.line)
        return fault.code
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
            release_meshes()  # so that the groups end with the run (at the next collection)


def build_failed(e: Exception, cfg: JobConfig, rank: int) -> int:
    """One line for an exception the model's own code raised while the job was checked
    (built on the meta device, before any layout is made): exit 2 or 10."""
    fault = internal_error(e, Doing(phase=BUILD), rank, "not yet made",
                           log_file(cfg, rank), [])
    announce(rank, fault.line)
    return fault.code


def log_file(cfg: JobConfig, rank: int) -> Path:
    """Where a rank's run appends the traceback of an exception it ends with."""
    return Path(cfg.job.dump_folder) / "logs" / f"rank{rank}.log"


def log_prediction(cfg: JobConfig, world_size: int, device: torch.device) -> None:
    """The planner's prediction for the validated job; one that will not fit warns."""
    try:
        line, warnings = validation_report(cfg, world_size, device)
    except ValueError as e:
        log.info("no prediction: %s", e)
        return
    log.info(line)
    for warning in warnings:
        log.warning(warning)


def cluster_flag(argv: list[str]) -> list[str]:
    """``argv`` with ``--cluster NAME|FILE`` (the cluster ``--validate`` predicts for)
    written as the override ``--planner.cluster=NAME|FILE``."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--cluster":
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError("--cluster: give a built-in cluster's name or a cluster "
                                  "TOML file")
            out.append(f"--planner.cluster={argv[i + 1]}")
            i += 2
            continue
        out.append("--planner.cluster=" + arg[len("--cluster="):]
                   if arg.startswith("--cluster=") else arg)
        i += 1
    return out


def _stop_on_sigterm(signum, frame):
    terminate_requested()


@contextlib.contextmanager
def _sigterm_stops():
    """SIGTERM (a scheduler's preemption, a launcher stopping the job) stops the run at
    the end of the step every rank is in: it saves that step where checkpoints are on,
    then exits 143. A rank waiting on a dead peer never gets there; its launcher kills it
    after its grace period, as before. Only where this thread can set signal handlers;
    the handler before is put back after."""
    terminate_requested(False)
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_argv(argv: list[str], *, rank: int | None = None, world_size: int | None = None,
             store: dist.Store | None = None) -> int:
    """Run the command line ``argv`` as this rank (``rank``, ``world_size``:
    torchrun's RANK and WORLD_SIZE unless given; ``store``: the job's own store,
    where one launch runs several jobs); returns the exit status."""
    if wants_help(argv):  # --help [SECTION]: the usage, the sections, a section's keys
        return print_help(argv)
    untested = untested_torch()
    if untested:
        print(untested, file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if "--dry-run" in argv:  # one rank of the world in this process; stdout is its report
        setup_logging(0, sys.stderr)
        try:
            return dry_run.run(argv, world_size)
        except ValueError as e:  # ConfigError, and the planner's own
            print(f"error: {e}", file=sys.stderr)
            return 2
    setup_logging(rank)
    cfg = None
    try:
        cfg, show = parse_args(cluster_flag([a for a in argv if a != "--validate"]))
        if show:
            print(to_toml(cfg), end="")
            return 0
        configured_cluster(cfg)  # a wrong name ends here, before the model is built
        plan = plan_job(cfg, rank, world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return getattr(e, "code", 2)  # a folder the run cannot write: faults.diagnosis.FOLDER
    except Exception as e:  # the model's own code, built on meta to check the job
        if cfg is None:
            raise
        return build_failed(e, cfg, rank)
    if "--validate" in argv:
        log.info("config ok for %d rank(s)", world_size)
        if rank == 0:
            log_prediction(cfg, world_size, plan.device)
        return 0
    with _sigterm_stops():
        return run(plan, world_size, store,
                   estimate=functools.partial(planned_peak, cfg, world_size, plan.device))


def _nodes(launcher: list[str]) -> int | None:
    """The nodes torchrun's options ask for (None: an elastic range)."""
    for i, arg in enumerate(launcher):
        if arg.split("=", 1)[0] == "--nnodes":
            value = arg.split("=", 1)[1] if "=" in arg else launcher[i + 1]
            return int(value) if value.isdigit() else None
    return 1


def check_launch(argv: list[str]) -> int:
    """Before composer's launcher starts a rank: the job checked for the world it will
    be, in this process, so a config error is one line at once (0: go on; its logs are
    the ranks' to print)."""
    cfg = None
    try:
        nproc, launcher, ours = split(argv)
        nodes = _nodes(launcher)
        if nodes is None or {"--dry-run", "--print-config"} & set(ours):
            return 0
        logging.disable(logging.WARNING)
        cfg, _ = parse_args(cluster_flag([a for a in ours if a != "--validate"]))
        configured_cluster(cfg)
        plan_job(cfg, 0, nproc * nodes)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "code", 2)
    except Exception as e:  # the model's own code, built on meta to check the job
        if cfg is None:
            raise
        return build_failed(e, cfg, 0)
    finally:
        logging.disable(logging.NOTSET)


def cli() -> None:
    """The console script ``composer-train``."""
    argv = sys.argv[1:]
    launching = any(a == "--nproc" or a.startswith("--nproc=") for a in argv) and not (
        {"-h", "--help"} & set(argv))
    code = (check_launch(argv) or launch(argv)) if launching else run_argv(argv)
    finish(code)


def finish(code: int) -> None:
    """End the process with ``code``. FSDP's modules hold reference cycles, so the run's
    sharded tensors, and through them its process groups, live on until a cyclic
    collection. Left to interpreter teardown, a gloo group's worker threads can be
    destroyed there and abort the process ("terminate called without an active
    exception") after a good run."""
    gc.collect()
    if code and pending_collectives():
        # A step stopped midway (Ctrl-C, a fault) leaves collectives in flight that can
        # never be waited for: their peers stopped too. torch leaks them at exit anyway,
        # after a multi-line warning from a static destructor under the run's one line;
        # ending here, with everything of ours closed and flushed, skips only that.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
