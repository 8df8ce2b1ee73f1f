"""What went wrong, in one line, and the exit status of its class.

A run on a cluster meets a few kinds of fault: a full disk, a folder that cannot
be written, a peer that stops answering (a collective's timeout), device
memory, a data source that goes away. ``diagnose`` names the fault from the
exception (and its causes) and from what the run was doing (``Doing``);
``composer.cli.run`` prints the line on every rank that sees it and returns
the class's status. An exception it does not know is an internal error
(``internal_error``): one line naming the phase, the module it was raised in and
the layout, its traceback in the rank's log file.
"""
from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import signal
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

# exit statuses of python -m composer.train (docs/faults_and_recovery.md: exit codes)
NO_SPACE, FOLDER, TIMEOUT, OUT_OF_MEMORY, DATA, UNREADABLE_STEP = 4, 5, 6, 7, 8, 9
UNSUPPORTED, INTERNAL = 2, 10  # found while building the model; any other exception
TERMINATED = 143  # 128 + SIGTERM: a scheduler's stop (SLURM requeues on it); Ctrl-C stays 130
RANK_ZERO_LEAD_S = 0.2  # how long the other ranks let rank 0 print first
SAVE_FAULTS = (NO_SPACE, FOLDER)  # those checkpoint.on_save_error = "continue" rides out
PEER_WORDS = ("timed out", "timeout", "connection closed by peer", "connection reset by peer",
              "broken pipe")
DATA_PHASES = ("data", "validation")  # validation reads its batches as it goes
OOM_WORDS = ("out of memory", "can't allocate memory")  # CUDA's, the CPU allocator's
CORRUPT_WORDS = ("corrupt", "pytorchstreamreader", "unpickl", "invalid load key")  # torch.load's
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "barrier", "send", "recv", "gather", "scatter", "wait")


_SIGTERM = threading.Event()  # set by the CLI's SIGTERM handler, cleared for each run


class Terminated(Exception):
    """SIGTERM stopped the run at a step's end, after its save where checkpoints are on."""


def terminate_requested(seen: bool = True) -> None:
    """Note that this process had SIGTERM (``seen``), or forget it (a new run)."""
    if seen:
        _SIGTERM.set()
    else:
        _SIGTERM.clear()


class SigtermStop:
    """Whether the run stops after the step just taken because a rank had SIGTERM,
    agreed through the job's store (``None``: one process) with no collective, so that
    every rank stops, and saves, at the same step: the first rank to see the signal at
    the end of step s names s + 1. A rank that ends step s + 1 has met that rank in its
    collectives, after the name was written, so it reads it there and no rank goes past
    it; a rank that stopped alone would leave its peers in the next step's collectives."""

    KEY = "composer/sigterm_stop_after"

    def __init__(self, store=None):
        self.store = store

    def __call__(self, step: int) -> bool:
        if self.store is None:
            return _SIGTERM.is_set()
        if _SIGTERM.is_set():  # an earlier rank's word stands
            self.store.compare_set(self.KEY, "", str(step + 1))
        return self.store.check([self.KEY]) and step >= int(self.store.get(self.KEY))


@dataclass
class Doing:
    """What the run is doing, kept up to date by the trainer."""

    step: int = 0                 # the step being taken (or saved)
    phase: str = "start"          # data, forward, backward, pipeline, optimizer, checkpoint,
    #                               validation, or a start-up's: "loading step-6", ...
    folder: Path | None = None    # the checkpoint folder
    timeout_s: int = 0            # job.collective_timeout_s
    groups: dict | None = None    # mesh dim -> process group
    estimate: Callable[[], str] | None = None  # the planner's peak, in words
    last_step: Callable[[], str] = lambda: "none"  # the newest complete checkpoint step


@dataclass
class Fault:
    code: int
    line: str


def causes(e: BaseException) -> list[BaseException]:
    """``e``, what it was raised from, and a checkpoint's per-rank failures."""
    out, todo = [], [e]
    while todo:
        c = todo.pop()
        if c is None or any(c is seen for seen in out):
            continue
        out.append(c)
        todo += [c.__cause__, c.__context__]
        if isinstance(c, CheckpointException):
            todo += [exc for exc, _ in c.failures.values()]
    return out


def announce(rank: int, line: str) -> None:
    """Print a fault's line on stderr, rank 0's first: the other ranks wait a
    moment. A launcher's SIGTERM (torchrun stops the others once one has failed)
    is ignored meanwhile, so no rank that saw the fault is stopped before it has
    said so; the process ends right after. Off the main thread (a run started by
    a user's own thread), where Python sets no handler, the line is printed alone."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        if rank and main:
            time.sleep(RANK_ZERO_LEAD_S)
        print(f"error: rank {rank}: {line}", file=sys.stderr, flush=True)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def free_bytes(path: Path | None) -> int | None:
    while path is not None and not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free if path is not None else None
    except OSError:
        return None


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def diagnose(e: BaseException, doing: Doing) -> Fault | None:
    """The fault ``e`` is, or None when it is none of the known ones."""
    found = causes(e)
    text = " | ".join(str(c) for c in found).lower()
    for c in found:
        if isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT):
            return no_space(doing, c.filename)
    if doing.phase == "checkpoint" and "inline_container" in text:  # torch.save's zip writer
        free = free_bytes(doing.folder)
        if free is not None and free < 16 * 2**20:
            return no_space(doing, None)
    oserrors = [c for c in found if isinstance(c, OSError)]
    if doing.phase in DATA_PHASES and oserrors:
        return data_gone(doing, oserrors[0])
    corrupt = [c for c in found if any(w in str(c).lower() for w in CORRUPT_WORDS)]
    if doing.phase.startswith("loading ") and (corrupt or oserrors):
        return unreadable_step(doing, (corrupt or oserrors)[-1])
    for c in oserrors:
        if c.errno in (errno.EACCES, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EPERM,
                       errno.EISDIR):
            return Fault(FOLDER, f"cannot write {c.filename or 'a run folder'} at step "
                                 f"{doing.step} ({doing.phase}): {c.strerror}; job.dump_folder "
                                 f"and checkpoint.folder must stay writable folders")
    if any(isinstance(c, torch.OutOfMemoryError) for c in found) or any(
            words in text for words in OOM_WORDS):
        return out_of_memory(doing)
    unreadable = [c for c in found if isinstance(c, ValueError)]
    if doing.phase == "data" and unreadable:  # e.g. a file that no longer parses
        return data_gone(doing, unreadable[0])
    if any(word in text for word in PEER_WORDS):
        return peer_lost(doing, found)
    return None


def data_gone(doing: Doing, c: BaseException) -> Fault:
    return Fault(DATA, f"the data source went away or turned unreadable at step {doing.step} "
                       f"({doing.phase}): {type(c).__name__}: {c}; data.dataset must stay "
                       f"readable until the run ends")


def first_sentence(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line.split(". ", 1)[0].rstrip(".")


def unreadable_step(doing: Doing, c: BaseException) -> Fault:
    step = doing.phase.removeprefix("loading ")
    return Fault(UNREADABLE_STEP, f"{step} cannot be read ({doing.phase}): {type(c).__name__}: "
                                  f"{first_sentence(str(c))}; remove it or "
                                  f"start from an earlier complete step (checkpoint.load_step)")


def no_space(doing: Doing, filename: str | None) -> Fault:
    where = doing.folder if doing.phase == "checkpoint" else Path(filename or ".").parent
    return Fault(NO_SPACE, f"no space left on device writing {doing.phase} step {doing.step} "
                           f"to {where} ({_size(free_bytes(where))} free); the last complete "
                           f"step is {doing.last_step()}; free space, or keep fewer "
                           f"steps (checkpoint.keep_latest_k)")


def out_of_memory(doing: Doing) -> Fault:
    estimate = f"; {doing.estimate()}" if doing.estimate is not None else ""
    return Fault(OUT_OF_MEMORY, f"out of memory at step {doing.step} ({doing.phase}), peak so "
                                f"far {peak_so_far()}{estimate}; lower it with "
                                f"activation_checkpoint.mode, a smaller "
                                f"training.local_batch_size (global_batch_size keeps the batch), "
                                f"parallelism.zero_stage 3, or more tensor/pipeline parallel ranks")


def peak_so_far() -> str:
    """The device's allocated peak on CUDA; on CPU, the process's resident peak."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB resident"


def waited_in(e: BaseException, groups: dict | None) -> str:
    """The collective the exception came out of, and its mesh dim, from its traceback."""
    names = {id(g): name for name, g in (groups or {}).items()}
    for c in causes(e):
        for frame, _ in reversed(list(traceback.walk_tb(c.__traceback__))):
            name = frame.f_code.co_name.lstrip("_")
            if "torch/distributed" in frame.f_code.co_filename and name.startswith(COLLECTIVES):
                group = frame.f_locals.get("group") or frame.f_locals.get("pg")
                dim = names.get(id(group), "world" if group is None else "a group")
                return f"{name} over {dim}"
    return "a collective"


def peer_lost(doing: Doing, found: list[BaseException]) -> Fault:
    recorder = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")
    flight = (f"; NCCL's flight recorder dumped to {recorder}<rank>"
              if os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") else "")
    return Fault(TIMEOUT, f"a peer stopped answering at step {doing.step} ({doing.phase}): "
                          f"waited in {waited_in(found[0], doing.groups)} (job.collective_timeout_s"
                          f"={doing.timeout_s}); check that every rank is alive (a stopped or hung "
                          f"process, a lost node, the network){flight}")


BUILD = "building the model"
PHASES = {BUILD: "build", "loss": "forward"}  # the trainer's phases as an internal error names them
OURS = Path(__file__).resolve().parents[1]  # the composer package
TORCH = Path(torch.__file__).parent
PYTHON = Path(sysconfig.get_paths()["stdlib"])
PACKAGES = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}


def first_line(e: BaseException) -> str:
    """``Type: the first line of its message`` (the type alone where it has none to give)."""
    try:
        lines = str(e).strip().splitlines()
    except Exception:  # noqa: BLE001 (an exception's own __str__ may fail)
        lines = []
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def layout_of(dims) -> str:
    """A ParallelDims in a few words: ``dp_shard=2 tp=1 pp=1 cp=1`` (dp_replicate, ep where > 1)."""
    words = [f"dp_replicate={dims.dp_replicate}"] if dims.dp_replicate > 1 else []
    words += [f"dp_shard={dims.dp_shard}", f"tp={dims.tp}", f"pp={dims.pp}", f"cp={dims.cp}"]
    return " ".join(words + ([f"ep={dims.ep}"] if dims.ep > 1 else []))


def step_part(phase: str, frames: list) -> str:
    """The part of a step (or of the start) that ``phase`` was: build, forward, backward
    (a pipeline's, from the frames), optimizer, checkpoint (saving, or loading a step),
    or the phase as it is."""
    if phase.startswith("loading "):
        return "checkpoint"
    if phase == "pipeline":
        backward = any(f.f_code.co_name in ("backward", "_engine_run_backward")
                       and Path(f.f_code.co_filename).is_relative_to(TORCH / "autograd")
                       for f in frames)
        return "backward" if backward else "forward"
    return PHASES.get(phase, phase)


def _short(filename: str) -> str:
    """A source file's path from the current folder, or from the folder composer is in."""
    for base in (Path.cwd(), OURS.parent):
        if Path(filename).is_relative_to(base):
            return str(Path(filename).relative_to(base))
    return filename


def _function(frame) -> str:
    code = frame.f_code  # co_qualname: Python 3.11 on
    return f"{_short(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"


def _library(frame) -> bool:
    """Whether ``frame`` runs torch's or Python's own code."""
    file = Path(frame.f_code.co_filename)
    return not file.is_relative_to(OURS) and (file.is_relative_to(TORCH) or (
        file.is_relative_to(PYTHON) and not any(file.is_relative_to(p) for p in PACKAGES)))


def _names(roots: list[nn.Module]) -> dict[int, tuple[str, nn.Module]]:
    """id -> (FQN, module) of every module under ``roots``, the first root's name first."""
    names: dict[int, tuple[str, nn.Module]] = {}
    for root in roots:
        for name, module in root.named_modules():
            names.setdefault(id(module), (name, module))
    return names


def _module_of(frame) -> nn.Module | None:
    """The module a frame runs for: its ``self`` or, in a pass, its ``module``."""
    for key in ("self", "module"):
        if isinstance(frame.f_locals.get(key), nn.Module):
            return frame.f_locals[key]
    return None


def _calling(function: type, names: dict) -> str | None:
    """The first module whose class's forward calls the autograd Function ``function``."""
    for name, module in names.values():
        code = getattr(getattr(type(module), "forward", None), "__code__", None)
        if name and code is not None and function.__name__ in code.co_names:
            return name
    return None


def _of(name: str, module: nn.Module) -> str:
    return f"of module {name!r}" if name else f"of the root module ({type(module).__name__})"


def raised_in(frames: list, models: list[nn.Module], build: bool) -> str:
    """Where in the model the exception of ``frames`` (innermost first) was raised: the
    innermost of ``models``' modules it went through (a custom autograd Function's
    backward: the module whose forward calls the Function); else the innermost module
    on them, named from the modules the outer frames hold (the model while it is
    built); else the innermost function outside torch and Python. At ``build``, also
    the function of composer's that was building it."""
    named = _names(models)
    for frame in frames:
        module = _module_of(frame)
        if module is not None and id(module) in named:
            return _of(*named[id(module)])
        function = getattr(frame.f_locals.get("ctx"), "_forward_cls", None)
        if isinstance(function, type) and (caller := _calling(function, named)):
            return f"of module {caller!r}"
    held = [m for f in reversed(frames) for m in f.f_locals.values() if isinstance(m, nn.Module)]
    named = _names([*models, *held])
    ours = next((_function(f) for f in frames if Path(f.f_code.co_filename).is_relative_to(OURS)),
                None)
    by = f" by {ours}" if build and ours else ""
    for frame in frames:
        module = _module_of(frame)
        if module is not None:
            return _of(*named[id(module)]) + by
    code = next((f for f in frames if not _library(f)), frames[0] if frames else None)
    return f"at {_function(code)}" if code is not None else "at an unknown place"


def internal_error(e: BaseException, doing: Doing, rank: int, layout: str, log: Path,
                   models: list[nn.Module]) -> Fault:
    """An exception ``diagnose`` does not know, raised in the model, a pass, the optimizer
    or a checkpoint: status 10, or 2 for what building the model refuses (an unsupported
    combination: ValueError, NotImplementedError). The line names the phase, the module
    (``models``: the model's parts, none while it is built), the ``layout`` and the
    exception's first line; its traceback is appended to ``log``, which the line names.
    Diagnosing never fails: where it would, the line says less."""
    build = doing.phase == BUILD
    unsupported = build and isinstance(e, (ValueError, NotImplementedError))
    code = UNSUPPORTED if unsupported else INTERNAL
    try:
        frames = [frame for frame, _ in traceback.walk_tb(e.__traceback__)][::-1]
        part = step_part(doing.phase, frames)
        when = f" at step {doing.step}" if doing.step and not build else ""
        what = "unsupported at build" if unsupported else f"internal error{when} in {part}"
        line = (f"{what} {raised_in(frames, models, build)} (layout {layout}): "
                f"{first_line(e)}")
        return Fault(code, f"{line}; {write_traceback(e, log, f'rank {rank}: {line}')}")
    except Exception:  # noqa: BLE001 (the line must come out whatever the diagnosis meets)
        line = f"internal error ({doing.phase}): {first_line(e)}"
        with contextlib.suppress(Exception):
            line += f"; {write_traceback(e, log, f'rank {rank}: {line}')}"
        return Fault(code, line)


def write_traceback(e: BaseException, log: Path, header: str) -> str:
    """Append ``header`` and ``e``'s traceback to ``log``; the line's words for where it is."""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n"
                    f"{''.join(traceback.format_exception(e))}\n")
        return f"traceback in {log}"
    except OSError as failed:
        return f"its traceback could not be written to {log}: {failed.strerror or failed}"
