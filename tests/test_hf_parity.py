"""The HF-backed family's parity rows: each architecture's layouts reproduce its
one-process run (float64, per-step loss, gradient norm and validation loss at a
relative 1e-9), one launch per architecture, from the tiny random folders
transformers writes (tests/hf_folders.py)."""
from __future__ import annotations

import pytest

from tests.harness import PARITY, Job, Run, run_jobs
from tests.hf_folders import make
from tests.test_parity import check_parity

pytest.importorskip("transformers")

GLOBAL_BATCH = 8
FSDP2 = (2, ["--training.local_batch_size", "4"])
PP2 = (2, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"])
# tensor parallel x2 with sequence and loss parallel (transformers' plan, translated)
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.sequence_parallel", "true",
       "--parallelism.loss_parallel", "true"]
TP2_SP = (2, [*TP2, "--training.local_batch_size", "8"])
FSDP2_TP2 = (4, [*TP2, "--training.local_batch_size", "4"])
DENSE = {"fsdp2": FSDP2, "tp2_sp": TP2_SP, "fsdp2_tp2": FSDP2_TP2, "pp2": PP2}
# architecture -> row -> (ranks, arguments beyond the folder and PARITY)
ROWS: dict[str, dict[str, tuple[int, list[str]]]] = {
    "llama": dict(DENSE),
    "qwen2": dict(DENSE),
    "mistral": dict(DENSE),
    "qwen3_moe": {"fsdp2": FSDP2},
    "qwen3": {"tp2_sp": TP2_SP},  # replicated_with_grad_allreduce (the per-head q/k norms)
    # colwise_gather_output, rowwise_split_input and packed_colwise
    "phi3_packed": {"tp2_sp": TP2_SP},
}


def jobs(folder: str, rows: dict[str, tuple[int, list[str]]]) -> dict[str, Run]:
    base = [*PARITY, "--model.name", "hf", "--model.hf_path", folder]
    return {"reference": Run(1, [*base, "--training.local_batch_size", str(GLOBAL_BATCH)]),
            **{name: Run(nproc, [*base, *args]) for name, (nproc, args) in rows.items()}}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Each architecture's rows in one launch, run once per session when first asked."""
    done: dict[str, dict[str, Job]] = {}

    def of(arch: str) -> dict[str, Job]:
        if arch not in done:
            here = tmp_path_factory.mktemp(f"hf_{arch}")
            folder = make(arch, here / "folder")
            done[arch] = run_jobs(jobs(str(folder), ROWS[arch]), here)
        return done[arch]
    return of


@pytest.mark.slow
@pytest.mark.parametrize("arch,row", [(arch, row) for arch, rows in ROWS.items() for row in rows])
def test_hf_layout_matches_one_process(arch, row, launches):
    ran = launches(arch)
    check_parity(f"{arch} {row}", ran[row].rows(), ran["reference"].rows())
