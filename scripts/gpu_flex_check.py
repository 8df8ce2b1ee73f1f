"""FlexAttention against SDPA on CUDA, and context parallel over two GPUs.

    python scripts/gpu_flex_check.py [--seq 8192]   # one GPU: flex vs SDPA, one JSON line
    python scripts/gpu_flex_check.py --cp2          # two GPUs: CP2 (flex) vs one GPU's losses

The first: the model's attention core (``CausalAttention``) at sequence ``--seq`` in
bf16, 32 query heads over 8 kv heads of 128 features, causal and with packed documents,
once as SDPA (causal kernel; per-document spans) and once as FlexAttention (its block
masks): the outputs' and gradients' largest difference over the SDPA output's largest
value, the median forward + backward time of each, the bytes the mask holds and the
peak memory each call adds. The second: the debug model in float32 with documents for
6 steps under ``torchrun --nproc_per_node 2`` with context parallel x2 and one GPU
alone, both under FlexAttention: their per-step losses. Both print one JSON line; no
CUDA (or fewer than two GPUs for ``--cp2``): one line saying so, exit 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from composer.models.common import CausalAttention, DocumentMask

ROOT = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DOCUMENTS = 8
REPEATS = 5


def documents_of(seq: int, device) -> torch.Tensor:
    """[1, seq]: ``DOCUMENTS`` documents of uneven lengths, numbered in order."""
    cuts = torch.linspace(0, 1, DOCUMENTS + 1)[1:-1] ** 1.5 * seq
    return torch.bucketize(torch.arange(seq), cuts.long(), right=True)[None].to(device)


def mask_bytes(mask) -> int:
    """The bytes of the tensors a mask holds (a BlockMask's block indices; spans: none)."""
    if isinstance(mask, torch.Tensor):
        return mask.numel() * mask.element_size()
    held = vars(mask).values() if hasattr(mask, "__dict__") else ()
    return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))


def attend(flex: bool, q, k, v, documents) -> dict:
    """One backend's output, gradients, time and memory."""
    core = CausalAttention(flex=flex)
    mask = DocumentMask(flex=flex)(documents, q) if documents is not None else None
    grad = torch.ones_like(q)
    times = []
    for _ in range(REPEATS + 1):
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = core(q, k, v, mask)
        out.backward(grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return {"out": out.detach(), "grads": [t.grad.clone() for t in (q, k, v)],
            "seconds": statistics.median(times[1:]), "mask_bytes": mask_bytes(mask),
            "added_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def compare(seq: int) -> dict:
    torch.manual_seed(0)
    device = torch.device("cuda")
    q = torch.randn(1, HEADS, seq, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, KV_HEADS, seq, HEAD_DIM, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_(True)
    report = {"seq": seq}
    for name, documents in (("causal", None), ("documents", documents_of(seq, device))):
        sdpa, flex = attend(False, q, k, v, documents), attend(True, q, k, v, documents)
        scale = sdpa["out"].abs().max().item()
        worst = max((a.float() - b.float()).abs().max().item() for a, b in
                    zip([sdpa["out"], *sdpa["grads"]], [flex["out"], *flex["grads"]]))
        report[name] = {"max_rel": worst / scale,
                        **{f"{b}_{key}": r[key] for b, r in (("sdpa", sdpa), ("flex", flex))
                           for key in ("seconds", "mask_bytes", "added_gib")}}
    return report


def losses(nproc: int, extra: list[str]) -> list[float]:
    args = ["--config", "train_configs/debug_model.toml", "--training.dtype", "float32",
            "--training.steps", "6", "--metrics.log_freq", "1", "--validation.enable", "false",
            "--metrics.enable_tensorboard", "false", "--model.attention", "flex",
            "--data.document_mask", "true", *extra]
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", "-m", "composer.train", *args,
                        "--job.dump_folder", folder], cwd=ROOT, check=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = [json.loads(line) for line in open(Path(folder) / "metrics.jsonl")]
    return [r["loss"] for r in rows if "loss" in r]


def cp2() -> dict:
    one = losses(1, [])
    two = losses(2, ["--parallelism.context_parallel_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "1"])
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, two))
    return {"one_gpu": one, "cp2": two, "max_rel": worst}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--cp2", action="store_true", help="context parallel over two GPUs")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < (2 if a.cp2 else 1):
        print(f"skipped: {gpus} CUDA device(s) visible; this check needs "
              f"{2 if a.cp2 else 1}")
        return 0
    print(json.dumps(cp2() if a.cp2 else compare(a.seq)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
