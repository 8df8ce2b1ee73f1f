"""What a run reports: one log line per ``metrics.log_freq`` steps,
``metrics.jsonl`` and TensorBoard event files, written by rank 0.

Throughput is per device. MFU divides achieved FLOP/s by the accelerator's
peak for the compute dtype; where the peak is unknown (CPUs) it is null.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from composer.observe.base import Observer, StepInfo

log = logging.getLogger(__name__)

# Dense peak TFLOP/s (no sparsity) by the substring of the device name.
PEAK_TFLOPS = {
    "H200": {torch.bfloat16: 989.5, torch.float32: 494.7, torch.float64: 66.9},
    "H100": {torch.bfloat16: 989.5, torch.float32: 494.7, torch.float64: 66.9},
    "A100": {torch.bfloat16: 312.0, torch.float32: 156.0, torch.float64: 19.5},
    "B200": {torch.bfloat16: 2250.0, torch.float32: 1125.0, torch.float64: 40.0},
    "L40S": {torch.bfloat16: 362.0, torch.float32: 183.0},
}


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak for ``dtype`` (float32 means TF32 tensor cores), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():
        if key in name:
            return table.get(dtype)
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _step_of(line: str) -> float:
    """A row's step; a line a killed run left half-written counts as past every step."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


class MetricsLogger(Observer):
    """Throughput, and reported rows as log lines, metrics.jsonl rows and TB scalars.
    ``summaries(row)``: the other observers' parts of the log line."""

    def __init__(self, folder: str, enabled: bool, tensorboard: bool, total_steps: int,
                 flops_per_token: float, peak: float | None, device: torch.device,
                 append: bool = False, summaries: Callable[[dict], str | None] = lambda row: None,
                 step: Callable[[], int] = lambda: 0, outputs: tuple = ()):
        """``append``: a resumed run adds to the rows of the run it continues;
        ``step``: the trainer's step, read when the run restarts from a checkpoint;
        ``outputs``: (what, folder) the end-of-run summary names beside the metrics."""
        self.summary_of_others, self.trainer_step = summaries, step
        self.enabled, self.total_steps, self.tensorboard = enabled, total_steps, tensorboard
        self.flops_per_token, self.peak, self.device = flops_per_token, peak, device
        self.tokens, self.steps, self.start = 0, 0, time.perf_counter()
        self.began, self.all_tokens, self.last_step, self.final = self.start, 0, 0, {}
        self.outputs = outputs
        # a progress bar where stdout is a terminal; log lines elsewhere
        self.terminal = sys.stdout if enabled and sys.stdout.isatty() else None
        self.drawn = 0
        self.path = Path(folder) / "metrics.jsonl"
        self.jsonl = self.writer = None
        if enabled:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.jsonl = open(self.path, "a" if append else "w")
            self._open_tensorboard()

    def _open_tensorboard(self, purge_step: int | None = None) -> None:
        """``purge_step``: TensorBoard hides the events from that step on (a restart's)."""
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(self.path.parent / "tb"), purge_step=purge_step)

    def restarted(self) -> None:
        """The run goes on from an earlier step: the rows past it are dropped
        (written again as the steps are retaken), so each step appears once, and
        an event row says where the run restarted."""
        if not self.enabled:
            return
        step = self.trainer_step()
        self.jsonl.close()
        rows = [line for line in self.path.read_text().splitlines() if _step_of(line) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in rows))
        os.replace(tmp, self.path)
        self.jsonl = open(self.path, "a")
        if self.writer is not None:
            self.writer.close()
            self._open_tensorboard(purge_step=step + 1)
        self.report(step, {"event": "restarted"})

    def count(self, tokens: int) -> None:
        """Record one finished step that processed ``tokens`` tokens on this device."""
        self.tokens += tokens
        self.steps += 1
        self.all_tokens += tokens

    def throughput(self) -> dict:
        """Averages since the last report, then restart the window."""
        elapsed = time.perf_counter() - self.start
        tps = self.tokens / elapsed if elapsed > 0 else 0.0
        tflops = tps * self.flops_per_token / 1e12 if self.flops_per_token else None
        row = {"tokens_per_second": tps, "tflops": tflops,
               "mfu": tflops / self.peak if self.peak and tflops is not None else None,
               "memory_gib": memory_gib(self.device),
               "step_time_s": elapsed / max(self.steps, 1)}
        self.tokens, self.steps, self.start = 0, 0, time.perf_counter()
        return row

    def row(self, info: StepInfo) -> dict:
        self.count(info.tokens_per_device)
        return self.throughput() if info.logged else {}

    def report(self, step: int, row: dict) -> None:
        """Write one row (must hold ``step``) everywhere, and a log line."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, **row}) + "\n")
        self.jsonl.flush()
        if "event" in row:
            self._end_bar()
            log.info("step %d: %s", step, row["event"])
            return
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        self._remember(step, row)
        if self.terminal is not None and "val_loss" not in row:
            self._bar(step, row)
        else:
            self._end_bar()
            log.info(self._line(step, row))

    def _line(self, step: int, row: dict) -> str:
        """At most about 100 characters (the full figures are in metrics.jsonl)."""
        parts = [f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}"]
        for key, fmt in (("loss", "loss {:.4f}"), ("val_loss", "val {:.4f}"),
                         ("grad_norm", "gnorm {:.2f}"), ("lr", "lr {:.1e}"),
                         ("tokens_per_second", "{:,.0f} tok/s"), ("mfu", "mfu {:.0%}"),
                         ("memory_gib", "mem {:.2f}G")):
            if row.get(key) is not None:
                parts.append(fmt.format(row[key]))
        parts += [part] if (part := self.summary_of_others(row)) else []
        if "step_time_s" in row:
            eta = row["step_time_s"] * (self.total_steps - step)
            parts.append(f"eta {datetime.timedelta(seconds=round(eta))}")
        return "  ".join(parts)

    def _remember(self, step: int, row: dict) -> None:
        """What the end-of-run summary says."""
        self.last_step = step
        if row.get("loss") is not None:
            self.final["loss"] = row["loss"]
        if row.get("val_loss") is not None:
            self.final["val_loss"] = row["val_loss"]
            if row["val_loss"] < self.final.get("best_val", (float("inf"),))[0]:
                self.final["best_val"] = (row["val_loss"], step)

    def _bar(self, step: int, row: dict) -> None:
        """One line redrawn in place (a terminal): the step, loss, tokens/s and ETA."""
        width, done = 24, step / max(self.total_steps, 1)
        fill = "#" * round(width * done) + "." * (width - round(width * done))
        eta = row.get("step_time_s", 0.0) * (self.total_steps - step)
        text = (f"step {step}/{self.total_steps} [{fill}] loss {row.get('loss', float('nan')):.4f}"
                f"  {row.get('tokens_per_second', 0.0):,.0f} tok/s"
                f"  eta {datetime.timedelta(seconds=round(eta))}")
        self.terminal.write("\r" + text.ljust(self.drawn))
        self.terminal.flush()
        self.drawn = len(text)

    def _end_bar(self) -> None:
        if self.drawn:
            self.terminal.write("\n")
            self.terminal.flush()
            self.drawn = 0

    def summary_lines(self) -> list[str]:
        """Steps, tokens, time, the final and best losses; then where the outputs went."""
        took = datetime.timedelta(seconds=round(time.perf_counter() - self.began))
        head = [f"done: {self.last_step} steps, {int(self.all_tokens):,} tokens a device, {took}"]
        if "loss" in self.final:
            head.append(f"loss {self.final['loss']:.4f}")
        if "val_loss" in self.final:
            best, at = self.final["best_val"]
            head.append(f"val {self.final['val_loss']:.4f} (best {best:.4f} at step {at})")
        return ["; ".join(head), f"  metrics: {self.path}",
                *(f"  {what}: {where}" for what, where in self.outputs)]

    def close(self) -> None:
        self._end_bar()
        if self.enabled and self.last_step >= self.total_steps:
            for line in self.summary_lines():
                log.info(line)
        if self.jsonl is not None:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def metrics_observer(view) -> MetricsLogger:
    plan, cfg = view.plan, view.cfg
    param_dtype = plan.mixed_dtype(cfg.training.mixed_precision_param)
    return MetricsLogger(
        cfg.job.dump_folder, plan.rank == 0, cfg.metrics.enable_tensorboard, cfg.training.steps,
        plan.spec.training.flops_per_token(plan.args, cfg.data.seq_len),
        peak_tflops(plan.device, param_dtype),
        plan.device, append=plan.resume is not None,
        summaries=view.summary, step=view.step, outputs=outputs(cfg))


def outputs(cfg) -> tuple:
    """(what, folder) a run writes beside its metrics, for the summary."""
    dump = Path(cfg.job.dump_folder)
    out = [("checkpoints", dump / cfg.checkpoint.folder)] if cfg.checkpoint.enable else []
    if cfg.metrics.enable_tensorboard:
        out.append(("TensorBoard events", dump / "tb"))
    return tuple(out)
