"""How much does composer's trainer cost over a plain PyTorch loop?

Trains the debug model on the built-in corpus with ``composer.train`` (one
process, in this process; with its step anatomy on, the default, and off) and
with a hand-written loop over the same model,
data, optimizer and clipping, alternating the two several times so that both
see the same machine noise; measures tokens/s of each (median over the rounds).

    OMP_NUM_THREADS=1 python benchmarks/bench_overhead.py --steps 30 --rounds 3 [--json]

Reference column: the plain PyTorch loop for ``composer.train`` (the ratio's target
is >= 0.97), and ``composer.train`` with its step anatomy off for the anatomy's cost.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from composer.cli.run import run_argv as composer_main
from composer.data import DataLoader, build_tokenizer
from composer.models.llama import Transformer, flavors
from composer.testing.report import bench_parser, emit


def plain_loop(steps: int, warmup: int, batch: int, seq_len: int, lr: float) -> float:
    """The reference: the loop a user would write by hand. Returns tokens/s after warmup."""
    torch.manual_seed(0)
    model = Transformer(flavors["debug"])
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    # documents masked, as composer.train does by default
    data = DataLoader("tinyshakespeare", build_tokenizer("byte"), seq_len, batch, 0, 1,
                      document_mask=True)
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        inputs, targets, documents = data.next_batch()
        logits = model(inputs, documents=documents)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * batch * seq_len / (time.perf_counter() - start)


def composer_run(steps: int, warmup: int, batch: int, seq_len: int, lr: float,
                 anatomy: bool = True) -> float:
    """composer.train over warmup + steps; tokens/s of the windows after warmup.
    ``anatomy``: metrics.step_anatomy (each logged step timed phase by phase)."""
    with tempfile.TemporaryDirectory() as folder:
        code = composer_main([
            "--job.dump_folder", folder, "--training.steps", str(warmup + steps),
            "--training.local_batch_size", str(batch), "--data.seq_len", str(seq_len),
            "--optimizer.lr", str(lr), "--lr_scheduler.decay_type", "constant",
            "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", str(warmup),
            "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
            "--metrics.step_anatomy", str(anatomy).lower()])
        assert code == 0
        rows = [json.loads(line) for line in open(Path(folder) / "metrics.jsonl")]
    timed = rows[1:]  # the first window holds the warmup steps
    seconds = sum(r["step_time_s"] * warmup for r in timed)
    return len(timed) * warmup * batch * seq_len / seconds


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--steps", type=int, default=30,
                   help="timed steps per run (multiple of --warmup)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if a.steps % a.warmup:
        p.error("--steps must be a multiple of --warmup (metrics windows are warmup steps long)")
    torch.set_num_threads(a.threads)
    # composer.train logs to stdout: with --json, stdout holds the JSON alone
    quiet = contextlib.redirect_stdout(sys.stderr) if a.json else contextlib.nullcontext()
    plain, ours, bare = [], [], []
    with quiet:
        for _ in range(a.rounds):
            plain.append(plain_loop(a.steps, a.warmup, a.batch, a.seq_len, 1e-3))
            ours.append(composer_run(a.steps, a.warmup, a.batch, a.seq_len, 1e-3))
            bare.append(composer_run(a.steps, a.warmup, a.batch, a.seq_len, 1e-3,
                                     anatomy=False))
    p_med, c_med, b_med = (statistics.median(x) for x in (plain, ours, bare))
    rows = [{"run": "composer.train", "tokens/s": round(c_med),
             "reference": "plain PyTorch loop", "reference tokens/s": round(p_med),
             "ratio": c_med / p_med, "target": ">= 0.97",
             "rounds": [round(x) for x in ours], "reference rounds": [round(x) for x in plain]},
            {"run": "composer.train, anatomy on", "tokens/s": round(c_med),
             "reference": "composer.train, anatomy off", "reference tokens/s": round(b_med),
             "ratio": c_med / b_med,
             "rounds": [round(x) for x in ours], "reference rounds": [round(x) for x in bare]}]
    if not a.json:
        print(f"\ndebug model, batch {a.batch} x seq {a.seq_len}, {a.steps} timed steps, "
              f"{a.rounds} alternating rounds, {a.threads} thread(s), a row every {a.warmup} "
              "steps; tokens/s are medians over the rounds\n")
    emit(rows, ["run", "tokens/s", "reference", "reference tokens/s", "ratio", "target",
                "rounds", "reference rounds"], a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
