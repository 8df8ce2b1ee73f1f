"""The examples' own loops, run as shipped, reproduce their one-process runs in
float64: docs/your_own_model.md's custom model under TP2 x FSDP2, and examples/parallel_loop.py
(public names only) under PP2 x FSDP2, CP2 x FSDP2 and EP2 x FSDP2, and resumed
under CP2 x FSDP2 from a PP2 x FSDP2 checkpoint."""
from __future__ import annotations

import json

import pytest

from composer.testing.harness import ROOT, launch

EXAMPLE = "examples/custom_model.py"
MOE = ["--experts", "4"]


def loop_layouts(checkpoint: str) -> dict[str, tuple[int, list[str], str | None]]:
    """name -> (ranks, arguments, the one-process run it must reproduce), in order."""
    return {
        "one": (1, [], None),
        "one_moe": (1, MOE, None),
        "pp2_fsdp2": (4, ["--pp", "2"], "one"),
        "cp2_fsdp2": (4, ["--cp", "2"], "one"),
        # each rank of an ep pair holds 2 of the 4 experts, FSDP-sharded over the 2
        # pairs (the rest of the model over all 4 ranks)
        "ep2_fsdp2": (4, [*MOE, "--ep", "2"], "one_moe"),
        "pp2_fsdp2_saves": (4, ["--pp", "2", "--steps", "2", "--checkpoint", checkpoint], "one"),
        "cp2_fsdp2_resumes": (4, ["--cp", "2", "--checkpoint", checkpoint], "one"),
    }


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


def test_the_guide_shows_the_example_as_shipped():
    code = (ROOT / EXAMPLE).read_text()
    assert f"```python\n{code}```" in (ROOT / "docs" / "your_own_model.md").read_text()


def worst_relative_error(rows: list[dict], reference: list[dict]) -> float:
    """Over the steps ``rows`` hold, of their loss and gradient norm."""
    by_step = {r["step"]: r for r in reference}
    return max(abs(a[key] - by_step[a["step"]][key]) / abs(by_step[a["step"]][key])
               for a in rows for key in ("loss", "grad_norm"))


@pytest.mark.slow
def test_the_public_loop_reproduces_one_process_on_every_layout(tmp_path):
    layouts = loop_layouts(str(tmp_path / "checkpoint"))
    plan = {name: [nproc, argv] for name, (nproc, argv, _) in layouts.items()}
    result = launch([str(tmp_path), json.dumps(plan)], 4, program="tests/support/loop_layouts.py")
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in layouts}
    steps = {name: [r["step"] for r in rows[name]] for name in layouts}
    assert steps == {**dict.fromkeys(layouts, [1, 2, 3, 4]), "pp2_fsdp2_saves": [1, 2],
                     "cp2_fsdp2_resumes": [3, 4]}
    assert rows["one"][-1]["loss"] < rows["one"][0]["loss"]
    assert rows["one_moe"][0]["loss"] != rows["one"][0]["loss"]  # the experts take part
    errors = {name: worst_relative_error(rows[name], rows[reference])
              for name, (_, _, reference) in layouts.items() if reference}
    assert max(errors.values()) < 1e-9, errors
