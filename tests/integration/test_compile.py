"""torch.compile per block (inductor on CPU): the same losses as eager.

Compiled kernels fuse and reorder float32 arithmetic, so the comparison is to
float32 tolerance (measured: relative 1.4e-7 on the first step), over three
steps, on one process, on FSDP2 x2 with full activation checkpointing, under
TP2 + SP and under context parallel (both methods).
"""
from __future__ import annotations

import pytest

from composer.testing.harness import Run, run_jobs, train

RUN = ["--training.steps", "3", "--data.seq_len", "64", "--training.local_batch_size", "4",
       "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
       "--validation.enable", "false"]
COMPILE = ["--compile.enable", "--compile.loss"]
FLOAT32 = 1e-5


def losses(rows: list[dict]) -> list[float]:
    assert [r["step"] for r in rows] == [1, 2, 3]
    return [r["loss"] for r in rows]


CASES = {
    "one_process": (1, []),
    "fsdp2_x2_ac_full": (2, ["--activation_checkpoint.mode", "full"]),
    # TP compiles each block's sub-modules (see composer/parallel/compile.py)
    "tp2_sp": (2, ["--parallelism.tensor_parallel_degree", "2", "--compile.backend", "aot_eager"]),
    # context parallel: the all-gather of K/V (an autograd function) compiles into the block
    "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "cp2_alltoall": (2, ["--parallelism.context_parallel_degree", "2",
                         "--parallelism.context_parallel_method", "alltoall",
                         "--compile.backend", "aot_eager"]),
    # MoE blocks compile with graph breaks at the data-dependent routing
    "moe": (1, ["--model.name", "moe", "--compile.backend", "aot_eager"]),
    # QLoRA: FSDP2 gathers the NF4 base, the compiled block dequantizes it
    "qlora_fsdp2": (2, ["--model.converters", "qlora", "--model.flavor", "debug256",
                        "--optimizer.lr", "3e-2", "--compile.backend", "aot_eager"]),
}


def jobs(case: str) -> dict[str, Run]:
    nproc, extra = CASES[case]
    return {f"{case}_eager": Run(nproc, RUN + extra),
            f"{case}_compiled": Run(nproc, RUN + extra + COMPILE)}


# the inner tier's case, run on its own; the others share one launch (its start-up paid once)
ALONE = "moe"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The slow tier's cases, eager and compiled, in one launch."""
    return run_jobs({name: run for case in CASES if case != ALONE
                     for name, run in jobs(case).items()}, tmp_path_factory.mktemp("compile_runs"))


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == ALONE else pytest.mark.slow)
                                  for c in CASES])
def test_compiled_losses_match_eager(case, request, tmp_path):
    if case == ALONE:
        rows = {name: train(tmp_path / name, 1, run.args) for name, run in jobs(case).items()}
    else:
        rows = {name: request.getfixturevalue("runs")[name].rows() for name in jobs(case)}
    eager, compiled = losses(rows[f"{case}_eager"]), losses(rows[f"{case}_compiled"])
    assert compiled == pytest.approx(eager, rel=FLOAT32, abs=0)
    assert len(set(compiled)) == 3  # it trains
    if CASES[case][0] > 1:  # without comm_stats the anatomy times no collective: only waits
        for mode in ("eager", "compiled"):
            last = rows[f"{case}_{mode}"][-1]
            assert last["comm_s"] is None and last["comm_dims_s"] == {}
            assert last["comm_exposed_s"] >= 0
