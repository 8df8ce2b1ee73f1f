"""The README's custom-model example, run exactly as shipped: TP2 x FSDP2 on 4
ranks reproduces the one-process run in float64."""
from __future__ import annotations

import json

import pytest

from tests.harness import ROOT, launch

EXAMPLE = "examples/custom_model.py"


def losses(nproc: int, *args: str) -> list[dict]:
    result = launch(list(args), nproc, program=EXAMPLE)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_tp2_fsdp2_matches_one_process():
    ref, ours = losses(1), losses(4, "--tp", "2")
    assert [r["step"] for r in ours] == [r["step"] for r in ref] == [1, 2, 3, 4]
    assert ref[-1]["loss"] < ref[0]["loss"]
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9, abs=0)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-9, abs=0)


def test_readme_shows_the_example_as_shipped():
    code = (ROOT / EXAMPLE).read_text()
    assert f"```python\n{code}```" in (ROOT / "README.md").read_text()
