"""What the document mask costs: step time of the debug model with packed
documents masked beside the same run attending causally across them, and, on
CUDA, FlexAttention's block-causal output beside SDPA's with the explicit mask.

On CUDA the sequence is 8192 (the debug model's max_seq_len raised) and the
mask goes through FlexAttention; on CPU it is 2048 through SDPA with an
additive mask. One process, real ``composer.train`` runs, median step time of
steps 2 and on.

Reference: the causal run (same model, data and steps, no document mask); each
row's step time sits beside the causal one and their ratio. On CUDA the
FlexAttention output is compared against float32 SDPA with the explicit mask
(largest absolute difference).

    OMP_NUM_THREADS=1 python benchmarks/bench_documents.py [--steps 8] [--json]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from composer.models.common import CausalAttention, DocumentMask, document_mask
from composer.testing.harness import ROOT
from composer.testing.report import bench_parser, emit

COLUMNS = ["attention", "step time (s)", "tokens/s", "causal step time (s)", "ratio to causal"]


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


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=8,
                        help="training steps of each run; the median of steps 2 and on counts")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    seq_len = 8192 if cuda else 2048
    device = torch.cuda.get_device_name() if cuda else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        causal = median_step(Path(tmp) / "causal", seq_len, False, args.steps)
        masked = median_step(Path(tmp) / "masked", seq_len, True, args.steps)
    rows = [{"attention": name, "step time (s)": step, "tokens/s": round(seq_len / step),
             "causal step time (s)": causal, "ratio to causal": step / causal,
             "seq_len": seq_len, "device": device}
            for name, step in (("causal across documents", causal), ("documents masked", masked))]
    difference = flex_against_sdpa(seq_len) if cuda else None
    if difference is not None:
        rows[-1]["flex vs sdpa max abs difference"] = difference
    if not args.json:
        print(f"debug model, seq_len {seq_len}, 1 sequence, {device}")
    emit(rows, COLUMNS, args.json)
    if difference is not None and not args.json:
        print(f"\nFlexAttention vs SDPA with the explicit mask (bf16 vs float32), "
              f"max abs difference: {difference:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
