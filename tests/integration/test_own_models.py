"""Your model, however you wrote it (examples/own_models.py: a plain loop over an
nn.ModuleList, an nn.Sequential trunk, an nn.ModuleDict, a tied head, GPT-2, parallel
attention and MLP, grouped-query attention, a router of its own, a forward taking
keyword arguments), each with the spec a user would write: through ``--model.name
module:attribute`` every layout trains equal to one process at 1e-9 (float64) or is
refused in one line naming what the spec must add; the planner, given no shape,
predicts its peak within 10% of ``metrics.memory_breakdown``; ``--dry-run`` traces it.
The whole space runs in one launch; ``benchmarks/bench_own_models.py`` prints its table
(docs/your_own_model.md), dry runs included."""
from __future__ import annotations

import pytest

from composer.testing.sweep import COMBINED, LAYOUTS, REFERENCE, dry_run, planned, sweep
from examples.own_models import STYLES

MODELS = {style: f"examples.own_models:{style}" for style in STYLES}
SWEPT = [name for name in LAYOUTS if name not in COMBINED]  # the benchmark runs those too
# (style, layout) -> what its one line says; "*": every style
REFUSED = {
    ("tied", "PP2"): "tied parameters embed.weight, head.weight would land on stages [0, 1]",
    ("*", "CP2"): "names no attention cores and mask (ModelSpec.parallel.attention_cores, "
                  "attention_mask; its forward then takes positions",
}


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> dict:
    return sweep({model: SWEPT for model in MODELS.values()},
                 tmp_path_factory.mktemp("own_models"), memory=list(MODELS.values()))


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
def test_every_layout_is_one_process_or_one_line(style, swept):
    outcomes = swept[MODELS[style]]["layouts"]
    assert sorted(outcomes) == sorted(name for name in SWEPT if name != REFERENCE)
    for layout, out in outcomes.items():
        refused = REFUSED.get((style, layout)) or REFUSED.get(("*", layout))
        if refused:
            assert out["result"] == "refused" and out["line"].startswith("error: ") and (
                refused in out["line"]), (layout, out)
        else:
            assert out["result"] == "pass", (layout, out)


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
def test_the_planner_predicts_the_peak_with_no_shape(style, swept):
    memory = swept[MODELS[style]]["memory"]
    assert "ratio" in memory, memory
    assert abs(memory["ratio"] - 1) <= 0.10, memory


def test_a_plain_loop_over_a_module_list_is_planned():
    """The case that failed: the tracer set the blocks it skips to None in the model's
    own nn.ModuleList, which its loop then called."""
    plan = planned(MODELS["plain_loop"], ["--data.seq_len", "32"])
    assert plan["memory_gib"]["peak"] > plan["memory_gib"]["activations"] > 0, plan


@pytest.mark.slow
@pytest.mark.parametrize("style, nproc, layout", [
    ("plain_loop", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    ("moe", 2, []),
])
def test_the_dry_run_traces_it(style, nproc, layout):
    out = dry_run(MODELS[style], nproc, ["--data.seq_len", "32", *layout])
    assert out.get("peak", 0) > 0, out
