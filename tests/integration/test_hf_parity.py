"""The HF-backed family's parity rows: each architecture's layouts reproduce its
one-process run (float64, per-step loss, gradient norm and validation loss at a
relative 1e-9), from the tiny random folders transformers writes (tests/support/hf_folders.py).
Every architecture's rows run in one launch."""
from __future__ import annotations

import re

import pytest

from composer.testing.harness import PARITY, Job, Run, run_jobs
from tests.integration.test_parity import check_parity, worst_errors
from tests.support.hf_folders import make

pytest.importorskip("transformers")

GLOBAL_BATCH = 8
FSDP2 = (2, ["--training.local_batch_size", "4"])
PP2 = (2, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"])
# tensor parallel x2 with sequence and loss parallel (transformers' plan, translated)
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.sequence_parallel", "true",
       "--parallelism.loss_parallel", "true"]
TP2_SP = (2, [*TP2, "--training.local_batch_size", "8"])
FSDP2_TP2 = (4, [*TP2, "--training.local_batch_size", "4"])
# context parallel with packed documents (data.document_mask is on for this family)
CP2 = (2, ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8"])
CP2_ALLTOALL = (2, [*CP2[1], "--parallelism.context_parallel_method", "alltoall"])
DENSE = {"fsdp2": FSDP2, "tp2_sp": TP2_SP, "fsdp2_tp2": FSDP2_TP2, "pp2": PP2}
# experts spread over the two data-parallel ranks, every block recomputed in backward and
# compiled (the routing breaks its graph)
EP2_AC_COMPILE = (2, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size",
                      "4", "--activation_checkpoint.mode", "full", "--compile.enable", "true",
                      "--compile.backend", "aot_eager"])
# architecture -> row -> (ranks, arguments beyond the folder and PARITY)
ROWS: dict[str, dict[str, tuple[int, list[str]]]] = {
    "llama": {**DENSE, "cp2_alltoall": CP2_ALLTOALL},
    "qwen2": dict(DENSE),
    # the window (16 of PARITY's 32 positions) reaches across the all-gather ranks' chunks
    "mistral": {**DENSE, "cp2": CP2},
    # experts: stacked, packed [gate; up] cut per part by tensor parallel (moe_tp_experts);
    # per-head q/k norms (replicated_with_grad_allreduce)
    "qwen3_moe": {**DENSE, "ep2_ac_compile": EP2_AC_COMPILE},
    # transformers 5.25's plan: the experts whole, the MoE block run on the whole sequence
    "qwen3_moe_whole": {"tp2_sp": TP2_SP},
    # colwise_gather_output, rowwise_split_input and packed_colwise
    "phi3_packed": {"tp2_sp": TP2_SP},
    "gemma2": {"cp2": CP2},  # soft-capping and a window on alternate layers
    "gpt_oss": {"cp2_alltoall": CP2_ALLTOALL},  # sinks, cut to a rank's heads
}
# transformers computes Gemma2's norm weight gradients in float32 (``1 + weight.float()``),
# which two layouts sum in different orders (DDP x2 as well): its gradient norms part by
# about 1e-10 at step 1 and are held to this bound; its losses to 1e-9 like any other
GRAD_NORM_RTOL = {"gemma2": 1e-8}


# what an architecture's every job adds: the MoE's tokens per expert, which every layout
# must route alike
EXTRA = {arch: ["--metrics.expert_load"] for arch in ("qwen3_moe", "qwen3_moe_whole", "gpt_oss")}


def jobs(arch: str, folder: str) -> dict[str, Run]:
    base = [*PARITY, "--model.name", "hf", "--model.hf_path", folder, *EXTRA.get(arch, [])]
    return {f"{arch} reference": Run(1, [*base, "--training.local_batch_size",
                                         str(GLOBAL_BATCH)]),
            **{f"{arch} {name}": Run(nproc, [*base, *args])
               for name, (nproc, args) in ROWS[arch].items()}}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every architecture's rows, in one launch (its start-up, with transformers', paid
    once: 53 s for the file where a launch per architecture took 101 s), run once per
    session when first asked; ``launches(arch)``: its jobs."""
    done: dict[str, Job] = {}

    def of(arch: str) -> dict[str, Job]:
        if not done:
            here = tmp_path_factory.mktemp("hf")
            planned = {}
            for a in ROWS:
                planned.update(jobs(a, str(make(a, here / a))))
            done.update(run_jobs({name.replace(" ", "_"): run for name, run in planned.items()},
                                 here))
        return done
    return of


@pytest.mark.slow
@pytest.mark.parametrize("arch,row", [(arch, row) for arch, rows in ROWS.items() for row in rows])
def test_hf_layout_matches_one_process(arch, row, launches):
    ran = launches(arch)
    rows, reference = ran[f"{arch}_{row}"].rows(), ran[f"{arch}_reference"].rows()
    if arch in GRAD_NORM_RTOL:
        error, step = worst_errors(rows, reference)["grad_norm"]
        assert error <= GRAD_NORM_RTOL[arch], f"{arch} {row}: grad_norm {error:.2e} at {step}"
        rows = [{**ours, "grad_norm": ref["grad_norm"]} for ours, ref in zip(rows, reference)]
    check_parity(f"{arch} {row}", rows, reference)


READ = re.compile(r"read ([\d.]+) MiB of the folder's ([\d.]+) MiB "
                  r"\((\d+) of (\d+) tensors whole\)")


@pytest.mark.slow
@pytest.mark.parametrize("row", ["fsdp2", "tp2_sp"])
def test_each_rank_reads_its_slice_of_the_folder(row, launches):
    """The Llama folder's tensors are stored as they are held: of 2 ranks, FSDP2 (rows)
    or tensor parallel (rows, columns; norms whole), rank 0 (the one that logs) reads
    about half the folder and no tensor whole, as ``load_hf_into`` logs."""
    job = launches("llama")[f"llama_{row}"]
    [(read, size, whole, tensors)] = READ.findall((job.logs / "rank0.log").read_text())
    assert float(read) <= 0.55 * float(size) and whole == "0" and int(tensors) == 39
