"""Context parallel's memory: each rank keeps about 1/cp of the activations
(``metrics.memory_breakdown``, which is deterministic on CPU), with packed documents
and with causal attention, for both methods: no rank holds a mask of its queries x
the sequence. A tiny model at a long sequence, so a mask would show (scripts/
bench_cp_memory.py runs this at 16384 too). Its exactness is in the parity matrix,
its traffic in test_parity.py's communication tests."""
from __future__ import annotations

import pytest

from benchmarks.bench_cp_memory import LAYOUTS, LIMIT, args
from composer.testing.harness import Run, run_jobs

SEQ_LEN = 8192


def activations(rows: list[dict]) -> float:
    """The largest rank's activation memory at the peak of the last step."""
    return max(rank["activations"] for rank in rows[-1]["memory"])


@pytest.mark.slow
def test_activation_memory_per_rank_falls_as_one_over_cp(tmp_path):
    jobs = run_jobs({f"{name} {masked}": Run(cp, args(SEQ_LEN, masked, cp, method))
                     for masked in (True, False) for name, (cp, method) in LAYOUTS.items()},
                    tmp_path)
    for masked in (True, False):
        alone = activations(jobs[f"cp1 {masked}"].rows())
        for name, (cp, _) in LAYOUTS.items():
            share = activations(jobs[f"{name} {masked}"].rows()) / alone
            label = f"{name}, {'documents' if masked else 'causal'}"
            assert share <= LIMIT / cp, f"{label}: {share:.3f} of the one-process activations"
            assert share > 0.8 / cp, f"{label}: {share:.3f}, less than the sequence cut explains"
