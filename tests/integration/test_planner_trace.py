"""The planner's traced path (composer/planner/trace.py): a model whose spec gives no
TransformerShape is measured on fake tensors. Against the formula path on the shipped
families, on the command line with the example model (whose spec has no shape), a
model it cannot follow, and against what training measures (metrics.memory_breakdown)."""
from __future__ import annotations

import dataclasses
import functools
import json

import pytest
from torch import nn

from composer.config import parse_args
from composer.models import llama, moe, qwen3
from composer.planner.cli import main as plan_main
from composer.planner.cluster import load_cluster
from composer.planner.layout import layout_of, load_model
from composer.planner.predict import predict
from composer.spec import ModelSpec
from composer.testing.harness import Run, run_jobs


def without_shape(spec: ModelSpec) -> ModelSpec:
    """A copy of ``spec`` that gives the planner no shape (the registry's stays as it is)."""
    return dataclasses.replace(spec, training=dataclasses.replace(spec.training, shape=None))


# the shipped families as a user's spec without a shape would name them
LLAMA3, QWEN3, MOE = (without_shape(s) for s in (llama.spec, qwen3.spec, moe.spec))
TRACED = {"llama3": "LLAMA3", "qwen3": "QWEN3", "moe": "MOE"}

JOB = ["--data.seq_len", "512", "--training.local_batch_size", "4"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
# (ranks, arguments) of the layouts each family is checked on
LAYOUTS = {"one process": (1, []), "fsdp2": (2, []),
           "tp2 sp": (2, [*TP2, "--parallelism.sequence_parallel", "true"]),
           "tp2 loss parallel": (2, [*TP2, "--parallelism.loss_parallel", "true"]),
           "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
           "bf16 compute": (2, ["--training.mixed_precision_param", "bfloat16"]),
           "ac selective_op": (2, ["--activation_checkpoint.mode", "selective_op"]),
           "ac full": (2, ["--activation_checkpoint.mode", "full"]),
           "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
           "ep2": (2, ["--parallelism.expert_parallel_degree", "2"])}
FAMILIES = {("llama3", "debug"): ("one process", "fsdp2", "tp2 sp", "tp2 loss parallel", "cp2",
                                  "ac selective_op", "ac full", "pp2"),
            ("llama3", "8B"): ("one process", "tp2 sp", "cp2", "bf16 compute", "ac full", "pp2"),
            ("qwen3", "debug"): ("one process", "fsdp2", "tp2 sp", "cp2", "bf16 compute",
                                 "ac selective_op", "ac full"),
            ("moe", "debug"): ("one process", "fsdp2", "tp2 sp", "cp2", "bf16 compute", "ep2")}
SIZES = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "n_experts",
         "top_k")
CATEGORIES = ("params", "grads", "optimizer", "activations", "other", "peak")


@functools.cache
def models(family: str, flavor: str, dtype: str = "auto") -> dict:
    """The family's model through the formula path and through the traced one (traced at
    the job's compute dtype ``dtype``, the mixed-precision parameter dtype)."""
    out = {}
    for path, name in (("formula", family), ("traced", f"tests.integration.test_planner_trace:"
                                                        f"{TRACED[family]}")):
        cfg, _ = parse_args(["--model.name", name, "--model.flavor", flavor, *JOB,
                             "--training.mixed_precision_param", dtype])
        out[path] = (name, load_model(cfg))
    return out


def peak(name: str, model, flavor: str, layout: str) -> dict:
    world, extra = LAYOUTS[layout]
    cfg, _ = parse_args(["--model.name", name, "--model.flavor", flavor, *JOB, *extra])
    return predict(layout_of(cfg, model, world, "cpu"), load_cluster("cpu")).peak.gib()


@pytest.mark.parametrize("family,flavor", [
    pytest.param(*key, marks=() if key == ("llama3", "debug") else pytest.mark.slow)
    for key in FAMILIES])
def test_the_traced_path_gives_the_formulas_memory_and_flops(family, flavor):
    """Each memory category within 3% and the FLOPs within 1% of the formulas', and
    the sizes the traffic and time model read are the shape's."""
    formula, traced = (models(family, flavor)[path][1] for path in ("formula", "traced"))
    assert traced.profile is not None and formula.profile is None
    for size in SIZES:
        assert getattr(traced.shape, size) == getattr(formula.shape, size), size
    layers = range(formula.shape.n_layers)
    assert [traced.shape.is_moe(i) for i in layers] == [formula.shape.is_moe(i) for i in layers]
    flops = traced.flops_per_token(512) / formula.flops_per_token(512) - 1
    assert abs(flops) <= 0.01, flops
    for layout in FAMILIES[(family, flavor)]:
        both = models(family, flavor, "bfloat16" if layout == "bf16 compute" else "auto")
        ours, ref = (peak(*both[path], flavor, layout) for path in ("traced", "formula"))
        for key in CATEGORIES:
            error = abs(ours[key] - ref[key]) / max(ref[key], 1e-9)
            assert error <= 0.03, (layout, key, ours, ref)


def test_the_example_model_without_a_shape_plans_on_the_command_line(capsys):
    """examples/my_model.py's spec gives no shape: --json and --search answer anyway."""
    config = ["--config", "examples/my_model.toml"]
    assert plan_main([*config, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg, _ = parse_args(config)
    expected = predict(layout_of(cfg, load_model(cfg), 1, "cpu"), load_cluster("cpu"))
    assert out["memory_gib"]["peak"] == pytest.approx(expected.peak.gib()["peak"])
    assert out["memory_gib"]["activations"] > out["memory_gib"]["params"] > 0
    assert plan_main([*config, "--world-size", "2", "--search", "--json"]) == 0
    layouts = [row["layout"] for row in json.loads(capsys.readouterr().out)["search"]]
    assert layouts and all(row.startswith(("dp2", "shard2", "tp2", "cp2")) for row in layouts)


class Peeking(nn.Module):
    """A model whose forward reads its data: fake tensors have none."""

    def __init__(self, args):
        super().__init__()
        self.blocks = nn.ModuleDict({"0": nn.Linear(8, 8)})
        self.embed = nn.Embedding(16, 8)

    def forward(self, tokens):
        h = self.blocks["0"](self.embed(tokens))
        return h[h > 0].sum() + h


PEEKING = ModelSpec(name="peeking", flavors={"tiny": None}, build=Peeking,
                    blocks=lambda model: list(model.blocks.values()))


def test_a_model_the_trace_cannot_follow_is_one_line(capsys):
    code = plan_main(["--model.name", "tests.integration.test_planner_trace:PEEKING",
                      "--model.flavor", "tiny", "--data.document_mask", "false"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 2 and errors == [
        "error: model.name='tests.integration.test_planner_trace:PEEKING': its spec gives no "
        "shape and the planner cannot trace it on fake tensors (DynamicOutputShapeException: "
        "aten.nonzero.default); give its ModelSpec.training.shape"]


# The example model at the size, and the layouts its prediction is checked on
EXAMPLE = ["--config", "examples/my_model.toml", "--model.flavor", "small", "--data.seq_len",
           "512", "--training.local_batch_size", "4", "--training.dtype", "float32"]
MEASURED = {"one process": (1, []), "fsdp2": (2, []), "tp2": (2, TP2),
            "cp2": (2, ["--parallelism.context_parallel_degree", "2"])}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """Step 2's memory breakdown of each layout, all in one launch."""
    run = ["--training.steps", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
           "false", "--metrics.memory_breakdown", "--validation.enable", "false",
           "--checkpoint.enable", "false"]
    jobs = run_jobs({name: Run(world, [*EXAMPLE, *extra, *run])
                     for name, (world, extra) in MEASURED.items()},
                    tmp_path_factory.mktemp("example"))
    return {name: max(job.rows()[1]["memory"], key=lambda r: r["peak"])
            for name, job in jobs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", MEASURED)
def test_the_example_models_traced_peak_is_what_training_measures(layout, measured):
    """Within 10% of metrics.memory_breakdown's peak, each category within 15%."""
    world, extra = MEASURED[layout]
    cfg, _ = parse_args([*EXAMPLE, *extra])
    ours = predict(layout_of(cfg, load_model(cfg), world, "cpu"), load_cluster("cpu")).peak.gib()
    theirs = measured[layout]
    assert abs(ours["peak"] / theirs["peak"] - 1) <= 0.10, (ours, theirs)
    for key in CATEGORIES[:-1]:
        error = abs(ours[key] - theirs[key]) / max(theirs[key], 0.05 * theirs["peak"])
        assert error <= 0.15, (key, ours, theirs)

