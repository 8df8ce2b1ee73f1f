"""The dry run (``composer.train --dry-run``): one rank of a world traced on fake tensors
in this process, beside the planner. Its figures are held against two parity rows' real
2- and 4-rank ``metrics.memory_breakdown`` and ``comm_stats``; the big configs' dry runs
are ``benchmarks/bench_dry_run.py``'s."""
from __future__ import annotations

import json

import pytest

from composer.cli.run import run_argv
from composer.observe.memory import CATEGORIES
from composer.testing.harness import PARITY
from composer.testing.parity import LAYOUTS, QLORA

CONFIG = ["--config", "train_configs/debug_model.toml"]  # the smallest shipped config

def dry_run(capsys, world: int, args: list[str]) -> dict:
    capsys.readouterr()
    code = run_argv(["--dry-run", "--json", *args], world_size=world)
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def counts(comm: dict) -> dict:
    """{(phase, dim, kind): (count, bytes)}"""
    return {(p, d, k): (c["count"], c["bytes"]) for p, dims in comm.items()
            for d, kinds in dims.items() for k, c in kinds.items()}


def test_dry_run_of_the_smallest_config_agrees_with_the_planner(capsys):
    # its intended world, 4 ranks, accumulating 2 microbatches of 8: FSDP2 reduce-scatters
    # each one, so the gradients held between them are sharded, as the planner counts
    out = dry_run(capsys, 4, [*CONFIG, "--training.global_batch_size", "64"])
    traced, planned = out["traced"], out["planned"]
    assert set(traced["memory_gib"]) == set(CATEGORIES)
    assert traced["memory_gib"]["grads"] > 0
    assert traced["memory_gib"]["grads"] == pytest.approx(planned["memory_gib"]["grads"], rel=0.01)
    ratio = planned["memory_gib"]["peak"] / traced["memory_gib"]["peak"]
    assert 0.9 <= ratio <= 1.1, (traced["memory_gib"], planned["memory_gib"])
    assert counts(traced["comm"]) == counts(planned["comm"])
    # its packed documents are traced as causal attention: the one thing left out
    assert [line.split(":")[0] for line in out["skipped"]] == ["documents"]
    assert out["seconds"] > 0


def test_the_middle_microbatches_run_once_and_count_for_all(capsys, monkeypatch):
    """Of 6 microbatches the dry run runs the first, the second and the last; the second's
    collectives count for the 4 middle ones. Running all 6 gives the same figures."""
    from composer.tools import dry_run as tool
    from composer.trainer.trainer import Trainer
    ran = []
    run_batch = Trainer.run_batch
    monkeypatch.setattr(Trainer, "run_batch", lambda self, *a: ran.append(1) or run_batch(self, *a))
    args = [*CONFIG, "--training.global_batch_size", "192"]
    once = dry_run(capsys, 4, args)["traced"]
    assert len(ran) == 3
    monkeypatch.setattr(tool, "_middle_once", lambda run_batch, counter, microbatches: run_batch)
    every = dry_run(capsys, 4, args)["traced"]
    assert len(ran) == 3 + 6
    assert once == every


def test_qloras_base_is_quantized_on_fake_tensors_and_sharded(capsys, monkeypatch):
    """QLoRA quantizes the base after the build: in the dry run on fake weights (real NF4
    codes of a 70B base filled 24 GB), and each rank keeps its shard of the codes only
    (torchao's chunk is a view of the whole weight's): the traced parameters are the
    planner's, NF4's bytes over 2 ranks."""
    from composer.converters import qlora
    codes = []

    def quantized(w):
        nf4 = quantize(w)
        codes.append(nf4.to_local().quantized_data)
        return nf4
    quantize = qlora.quantized
    monkeypatch.setattr(qlora, "quantized", quantized)
    out = dry_run(capsys, 2, [*CONFIG, *QLORA])
    # every block linear of the 2 blocks, each quantized from a fake tensor (it has a mode)
    assert len(codes) == 2 * 7 and all(getattr(c, "fake_mode", None) for c in codes)
    traced, planned = out["traced"]["memory_gib"], out["planned"]["memory_gib"]
    assert traced["params"] == pytest.approx(planned["params"], rel=0.01)


def test_tp_x_fsdp2_in_bf16_issues_the_planned_collectives(capsys):
    """Under TP x FSDP2 the norms' partial gradients are all-reduced whole before the
    reduce-scatter, in the compute dtype (bf16 here: the float64 parity rows cannot tell
    it from the storage dtype; llama3_8b_128k's dry run found the planner at 2x)."""
    out = dry_run(capsys, 4, [*CONFIG, "--parallelism.tensor_parallel_degree", "2",
                              "--training.mixed_precision_param", "bfloat16"])
    traced = counts(out["traced"]["comm"])
    assert traced[("backward", "tp", "all_reduce")][0] > 0
    assert traced == counts(out["planned"]["comm"])


@pytest.mark.slow
def test_a_block_heavy_job_peaks_where_the_planner_says(capsys):
    """llama3 8B's blocks over 4 ranks with a small vocabulary, short sequences and full AC:
    the peak is the end of block 0's backward, its bf16 gradients whole beside block 1's
    reduce-scatter input (fp32), which FSDP2 keeps until the next reduce-scatter; not
    activations. Traced 3.27 GiB; the planner without these moments said 2.61."""
    args = ["--config", "train_configs/llama3_8b.toml", "--model.converters=",
            "--float8.fsdp_float8_all_gather", "false", "--compile.enable", "false",
            "--data.seq_len", "256", "--training.global_batch_size", "4",
            "--model.overrides", "n_layers=2,vocab_size=4096",
            "--activation_checkpoint.mode", "full"]
    out = dry_run(capsys, 4, args)
    assert out["planned"]["peak_moment"] == "backward of block 0"
    ratio = out["planned"]["memory_gib"]["peak"] / out["traced"]["memory_gib"]["peak"]
    assert 0.95 <= ratio <= 1.1, (out["traced"]["memory_gib"], out["planned"]["memory_gib"])


def test_a_pass_that_cannot_run_under_fake_tensors_is_one_line_beside_the_plan(capsys):
    """Pipeline parallel's stages swap their shapes through the process group at the
    first step, which the fake group cannot serve: the dry run names the pass, traces
    nothing, and still answers with the planner's figures, status 0."""
    out = dry_run(capsys, 4, [*CONFIG, "--parallelism.pipeline_parallel_degree", "2"])
    assert out["traced"] is None and out["planned"]["memory_gib"]["peak"] > 0
    [line] = out["skipped"]
    assert line.startswith("pipelining: PipeliningMetadataError: ") and "nothing was traced" in line


@pytest.mark.parametrize("args, says", [
    (["--dry-run-rank", "4"], "--dry-run-rank='4': must be a rank of the world, 0..3"),
    (["--dry-run-rank", "x"], "--dry-run-rank='x': must be a rank of the world"),
    (["--training.stepz", "2"], "training.stepz"),
])
def test_bad_input_ends_in_one_line_and_status_2(capsys, args, says):
    assert run_argv(["--dry-run", *CONFIG, *args], world_size=4) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3_x2", "hsdp_2x2"])
def test_traced_peak_and_collectives_match_real_runs(name, capsys, layout_rows):
    """Two parity rows' real runs (2 and 4 ranks; rank 0 of the second step: optimizer
    state exists) against the dry run of the same job: every category within 5% and the
    same collectives."""
    nproc, args = LAYOUTS[name]
    row = layout_rows(name)[1]
    traced = dry_run(capsys, nproc, [*PARITY, *args])["traced"]
    for k in CATEGORIES:
        assert traced["memory_gib"][k] == pytest.approx(
            row["memory"][0][k], rel=0.05, abs=2**-14), (k, traced["memory_gib"], row["memory"])
    assert counts(traced["comm"]) == counts(row["comm"])
    with capsys.disabled():  # the figures, for a closing note (pytest -s)
        print(f"\n{name}: measured {row['memory'][0]} traced {traced['memory_gib']}")
