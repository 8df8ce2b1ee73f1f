"""``composer-train --nproc N``: the multi-rank launch, torch's launcher run in this process.

    composer-train --nproc 4 --config train_configs/debug_model.toml
    composer-train --nproc 8 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id JOB --config train_configs/llama3_8b.toml

Every torchrun option passes through (``--nnodes``, ``--rdzv-*``, ``--max-restarts``, ...,
as ``--opt VALUE`` or ``--opt=VALUE``); the rest is composer's command line, which each
rank runs as ``python -m composer.train`` would. What this adds to plain torchrun is the
output: the launcher's own log lines and its failure report are not printed, so a config
error or a fault is composer's one line (rank 0's) and its exit status; Ctrl-C stops the
ranks (each ends its step and says nothing but rank 0's one line) and exits 130; SIGTERM
(a scheduler's preemption) reaches the ranks, which save the step they are in where
checkpoints are on and exit 143, and so does the launcher.
"""
from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from composer.config import ConfigError
from composer.faults.diagnosis import TERMINATED

INTERRUPTED = 130
LAUNCHER_LOGS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
OURS = ("--nproc-per-node", "--nproc_per_node", "-m", "--module", "--no-python", "--no_python",
        "--run-path", "--run_path", "-h", "--help")


def _torchrun_options() -> dict[str, bool]:
    """torchrun's options this launcher passes through: {option: takes a value}."""
    return {opt: action.nargs != 0 for action in get_args_parser()._actions
            for opt in action.option_strings if opt not in OURS}


def split(argv: list[str]) -> tuple[int, list[str], list[str]]:
    """(ranks per node, torchrun's options, composer's arguments) of ``argv``; ConfigError
    for an ``--nproc`` that is not a positive integer."""
    options, ours, nproc, i = _torchrun_options(), [], None, 0
    launcher: list[str] = []
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name == "--nproc":
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv)
                                                             else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--nproc {value!r}: the ranks to start on this node; "
                                  f"allowed: an integer >= 1")
            nproc = int(value)
            continue
        if name in options:
            takes = options[name] and "=" not in arg
            launcher += argv[i:i + 1 + takes]
            i += 1 + takes
            continue
        ours.append(arg)
        i += 1
    return nproc, launcher, ours


def _quiet_launcher() -> None:
    """torch's launcher logs its own lines (the rendezvous, OMP_NUM_THREADS, each failed
    worker and a report of it): a failure is said once, by the rank that had it. Its
    modules give each logger a level of its own, so each is set, not only their parent."""
    names = [name for name in logging.root.manager.loggerDict if name.startswith(LAUNCHER_LOGS)]
    for name in (*LAUNCHER_LOGS, *names):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(argv: list[str]) -> int:
    """Run composer's command line in ``argv`` on ``--nproc`` ranks; the exit status."""
    try:
        nproc, launcher, ours = split(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = get_args_parser().parse_args(
        [*launcher, "--nproc-per-node", str(nproc), "-m", "composer.train", *ours])
    _quiet_launcher()
    try:
        run(args)
        return 0
    except ChildFailedError as e:
        # a rank's own status first (the launcher SIGTERMs the others once one has ended),
        # the lowest rank's; else the signal that killed one: 128 + S
        codes = sorted((f.exitcode <= 0, f.local_rank, f.exitcode) for f in e.failures.values())
        code = codes[0][2]
        return code if code > 0 else 128 - code
    except SignalException as e:
        return INTERRUPTED if e.sigval == signal.SIGINT else TERMINATED
    except KeyboardInterrupt:
        return INTERRUPTED
