"""Context parallel's memory: each rank keeps about 1/cp of the activations
(``metrics.memory_breakdown``, which is deterministic on CPU). Its exactness is
in the parity matrix, its traffic in test_parity.py's communication tests."""
from __future__ import annotations

import pytest

from tests.harness import Run, run_jobs

SEQ_LEN = 256
LIMIT = 1.15  # activations per rank at most LIMIT / cp of the one-process figure


def activations(rows: list[dict]) -> float:
    """The largest rank's activation memory at the peak of the last step."""
    return max(rank["activations"] for rank in rows[-1]["memory"])


@pytest.mark.slow
def test_activation_memory_per_rank_falls_as_one_over_cp(tmp_path):
    common = ["--data.seq_len", str(SEQ_LEN), "--training.local_batch_size", "2",
              "--training.steps", "2", "--metrics.memory_breakdown", "--metrics.log_freq", "1",
              "--metrics.enable_tensorboard", "false", "--validation.enable", "false"]
    layouts = {"cp1": (1, "allgather"), **{f"cp{cp}_{method}": (cp, method) for cp in (2, 4)
                                           for method in ("allgather", "alltoall")}}
    jobs = run_jobs({name: Run(cp, [*common, "--parallelism.context_parallel_degree", str(cp),
                                    "--parallelism.context_parallel_method", method])
                     for name, (cp, method) in layouts.items()}, tmp_path)
    alone = activations(jobs["cp1"].rows())
    for name, (cp, _) in layouts.items():
        share = activations(jobs[name].rows()) / alone
        assert share <= LIMIT / cp, f"{name}: {share:.3f} of the one-process activations"
        assert share > 0.8 / cp, f"{name}: {share:.3f}, less than the sequence cut explains"
