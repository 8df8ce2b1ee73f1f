"""The parity matrix: every data-parallel layout reproduces the one-process run.

float64 everywhere; the same global batch of 8 sequences per step on every
layout; per-step loss and gradient norm must agree to a relative 1e-9.
"""
from __future__ import annotations

import pytest

from tests.harness import PARITY, train

GLOBAL_BATCH = 8
RTOL = 1e-9


def layout(nproc: int, zero: int, local: int, replicate: int = 1, accumulate: bool = False):
    args = ["--parallelism.zero_stage", str(zero), "--training.local_batch_size", str(local),
            "--parallelism.data_parallel_replicate_degree", str(replicate)]
    if accumulate:
        args += ["--training.global_batch_size", str(GLOBAL_BATCH)]
    assert local * nproc * (GLOBAL_BATCH // (local * nproc) if accumulate else 1) == GLOBAL_BATCH
    return nproc, args


LAYOUTS = {
    "ddp_x2": layout(2, zero=0, local=4),
    "zero1_x2": layout(2, zero=1, local=4),
    "zero2_x2": layout(2, zero=2, local=4),
    "zero3_x2": layout(2, zero=3, local=4),
    "zero3_x4": layout(4, zero=3, local=2),
    "hsdp_2x2": layout(4, zero=3, local=2, replicate=2),
    "zero3_x2_accumulate2": layout(2, zero=3, local=2, accumulate=True),
    "ddp_x2_accumulate2": layout(2, zero=0, local=2, accumulate=True),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    rows = train(tmp_path_factory.mktemp("reference"), 1,
                 PARITY + ["--training.local_batch_size", str(GLOBAL_BATCH)])
    losses = [r["loss"] for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert len(set(losses)) == 4 and losses[-1] < losses[0]  # the run actually trains
    return rows


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(name, reference, tmp_path):
    nproc, args = LAYOUTS[name]
    rows = train(tmp_path, nproc, PARITY + args)
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for ours, ref in zip(rows, reference):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=0), (name, ours["step"])
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL, abs=0), (name, ours["step"])
        assert ours["lr"] == ref["lr"]
