"""The HF architecture sweep's representative subset (``composer.testing.hf_sweep.SUBSET``:
one architecture per distinct attention / norm / MLP / MoE / positional form the sweep
found), each trained on 1 process, FSDP2 x2 and TP2 in one launch, against transformers'
own loss and the one-process run (float64, relative 1e-9; 2e-5 where transformers forces
float32 in an op, named): each cell ends as the committed sweep says
(benchmarks/hf_sweep.json), the refusals with the same line."""
from __future__ import annotations

import json

import pytest

from composer.testing import hf_sweep
from composer.testing.harness import ROOT

pytest.importorskip("transformers")
LAYOUTS = ["1 process", "FSDP2 x2", "TP2"]
COMMITTED = {row["arch"]: row for row in
             json.loads((ROOT / "benchmarks" / "hf_sweep.json").read_text())["rows"]}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    rows = hf_sweep.sweep(hf_sweep.SUBSET, tmp_path_factory.mktemp("hf_sweep"), LAYOUTS,
                          subset=[], per_launch=len(hf_sweep.SUBSET))
    return {row["arch"]: row for row in rows}


@pytest.mark.slow
@pytest.mark.parametrize("arch", hf_sweep.SUBSET)
def test_the_subset_trains_as_the_committed_sweep_says(arch, swept):
    want = {name: cell for name, cell in COMMITTED[arch]["cells"].items() if name in LAYOUTS}
    got = swept[arch]["cells"]
    assert sorted(got) == sorted(want)
    for name, cell in got.items():
        assert cell["result"] == want[name]["result"], (name, cell)
        if cell["result"] == "pass":
            bound = hf_sweep.FLOAT32_TOLERANCE if "float32" in cell else hf_sweep.TOLERANCE
            assert cell["error"] <= bound
        else:
            assert cell["line"] == want[name]["line"]
