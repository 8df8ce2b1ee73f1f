"""What the document mask costs: step time of the debug model with packed
documents masked beside the same run attending causally across them, and, on
CUDA, FlexAttention's block-causal output beside SDPA's with the explicit mask.

On CUDA the sequence is 8192 (the debug model's max_seq_len raised) and the
mask goes through FlexAttention; on CPU it is 2048 through SDPA with an
additive mask. One process, real ``composer.train`` runs, median step time of
steps 2 and on.

    OMP_NUM_THREADS=1 python scripts/bench_documents.py [--steps 8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from composer.models.common import CausalAttention, DocumentMask, document_mask  # noqa: E402


def median_step(folder: Path, seq_len: int, masked: bool, steps: int) -> float:
    cmd = [sys.executable, "-m", "composer.train", "--job.dump_folder", str(folder),
           "--model.overrides", f"max_seq_len={seq_len}", "--data.seq_len", str(seq_len),
           "--training.local_batch_size", "1", "--training.steps", str(steps),
           "--data.document_mask", str(masked).lower(), "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--validation.enable", "false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    times = sorted(r["step_time_s"] for r in rows[1:])
    return times[len(times) // 2]


def flex_against_sdpa(seq_len: int) -> float:
    """Largest difference between FlexAttention's block-causal output (bf16) and
    SDPA's with the explicit mask (float32), on random heads of one batch."""
    torch.manual_seed(0)
    q = torch.randn(1, 8, seq_len, 16, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, seq_len, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    documents = (torch.rand(1, seq_len, device="cuda") < 0.002).cumsum(1)
    ours = CausalAttention()(q, k, v, DocumentMask(flex=True)(documents, q)).float()
    reference = F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1),
        attn_mask=document_mask(documents))
    return (ours - reference).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    seq_len = 8192 if cuda else 2048
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"debug model, seq_len {seq_len}, 1 sequence, {device}")
    print("| attention | step time (s) | tokens/s | ratio to causal |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        causal = median_step(Path(tmp) / "causal", seq_len, False, a.steps)
        masked = median_step(Path(tmp) / "masked", seq_len, True, a.steps)
    for name, step in (("causal across documents", causal), ("documents masked", masked)):
        print(f"| {name} | {step:.3f} | {seq_len / step:,.0f} | {step / causal:.2f} |")
    if cuda:
        print(f"\nFlexAttention vs SDPA with the explicit mask (bf16 vs float32), "
              f"max abs difference: {flex_against_sdpa(seq_len):.2e}")


if __name__ == "__main__":
    main()
