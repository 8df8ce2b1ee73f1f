"""Your own model gets what composer's own models get: ``examples/my_model.py``
(an OPT-style decoder composer has never seen, named ``module:attribute``) trains
from ``examples/my_model.toml`` through the trainer, with checkpoints and exact
resume, metrics and the step anatomy, validation, recovery, and Hugging Face
weights through its own StateDictAdapter (OPT's layout: transformers is the
reference). Its parity rows are in tests/integration/test_parity.py."""
from __future__ import annotations

import sys

import pytest
import torch

from composer.testing.harness import ROOT, Run, run_jobs, train
from tests.integration.test_checkpoint import assert_resumed_once, load_checkpoint

TOML = ["--config", "examples/my_model.toml", "--training.dtype", "float64",
        "--data.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--validation.freq", "3", "--validation.steps", "1", "--lr_scheduler.warmup_steps", "2"]
RUN = [*TOML, "--training.steps", "6", "--checkpoint.interval", "2",
       "--checkpoint.keep_latest_k", "0", "--checkpoint.last_save_in_hf",
       "--checkpoint.export_dtype", "float64"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The example's multi-rank runs of this file, in one launch, in this order."""
    here = tmp_path_factory.mktemp("my_model_runs")
    export = str(here / "toml" / "checkpoint" / "step-6-hf")
    return here, run_jobs({
        # FSDP2 x2 from the example's TOML; step 6 lost as if the run died after step 5
        "whole": Run(2, RUN),
        "toml": Run(2, RUN),
        "toml_resumed": Run(2, RUN, folder="toml", remove=("toml/checkpoint/step-6",)),
        # TP2 starts from the Hugging Face export; lr 0 keeps the weights as loaded
        "from_hf": Run(2, [*TOML, "--training.steps", "1", "--optimizer.lr", "0",
                           "--parallelism.tensor_parallel_degree", "2",
                           "--checkpoint.initial_load_path", export,
                           "--checkpoint.interval", "1"]),
    }, here)


@pytest.mark.slow
def test_the_example_trains_from_its_toml_and_resumes_exactly(runs):
    here, jobs = runs
    assert jobs["toml"].code == 0 and jobs["toml_resumed"].code == 0, jobs["toml"].log()
    whole = jobs["whole"].rows()  # the uninterrupted run
    assert_resumed_once(here / "toml", whole, 4)
    full = {r["step"]: r for r in jobs["toml_resumed"].rows()}
    assert full[6]["loss"] < full[1]["loss"]
    assert [s for s, r in full.items() if "val_loss" in r] == [3, 6]
    anatomy = ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "comm_s", "slowest_rank")
    assert all(key in full[2] for key in anatomy), sorted(full[2])
    assert full[2]["tflops"] > 0  # the spec's flops_per_token


@pytest.mark.slow
def test_its_hugging_face_export_is_the_checkpoint_and_starts_another_layout(runs):
    """The run's last step, exported through the spec's adapter, holds the DCP step's
    weights bit for bit; a TP2 run started from that folder holds them again."""
    from composer.checkpoint.hf import open_hf, to_hf
    from examples.my_model import OPTLayout, spec
    here, jobs = runs
    step = load_checkpoint(here / "toml" / "checkpoint" / "step-6")
    saved = {k[len("model."):]: v for k, v in step.items() if k.startswith("model.")}
    _, get = open_hf(here / "toml" / "checkpoint" / "step-6-hf")
    for name, tensor in to_hf(saved, OPTLayout(spec.flavors["tiny"])).items():
        assert torch.equal(get(name), tensor), name
    jobs["from_hf"].rows()
    loaded = load_checkpoint(jobs["from_hf"].folder / "checkpoint" / "step-1")
    for key, tensor in saved.items():
        assert torch.equal(loaded[f"model.{key}"], tensor), key


@pytest.mark.parametrize("flavor", ["tiny", pytest.param("tiny_untied", marks=pytest.mark.slow)])
def test_transformers_loads_the_export_with_the_models_logits(flavor, tmp_path):
    """OPTForCausalLM.from_pretrained on the adapter's folder gives our logits, and
    the folder loads back into our model bit for bit."""
    transformers = pytest.importorskip("transformers")
    from composer.checkpoint.hf import export_hf, load_hf_into
    from examples.my_model import OPTLayout, spec
    args = spec.flavors[flavor]
    torch.manual_seed(0)
    model = spec.build(args).double()
    model.init_weights()
    for p in model.parameters():  # biases and norms away from their init, so they count
        p.data.add_(torch.randn_like(p) * 0.02)
    export_hf(model, tmp_path / "hf", spec, args, torch.float64)
    theirs = transformers.OPTForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    tokens = torch.randint(0, args.vocab_size, (2, 48))
    with torch.no_grad():
        ours, reference = model(tokens), theirs(tokens).logits
    torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-12)
    again = spec.build_meta(args).to_empty(device="cpu").double()
    load_hf_into(again, tmp_path / "hf", OPTLayout(args))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_a_loss_spike_rolls_back_on_the_example(tmp_path):
    rows = train(tmp_path, 1, [*TOML, "--training.steps", "6", "--checkpoint.interval", "2",
                               "--recovery.spike_factor", "3", "--recovery.spike_window", "2",
                               "--job.plugins", "tests.support.inject", "--inject.spike_step", "5"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["rollbacks"] == 1 and rows[3]["rollbacks"] == 0


GUIDE = ROOT / "docs" / "your_own_model.md"
ASKED = [["--parallelism.tensor_parallel_degree", "2"],
         ["--parallelism.pipeline_parallel_degree", "2"],
         ["--parallelism.context_parallel_degree", "2"], ["--data.document_mask", "true"],
         ["--parallelism.expert_parallel_degree", "2"], ["--checkpoint.last_save_in_hf"],
         ["--model.converters", "lora"]]


@pytest.fixture
def smallest(tmp_path, monkeypatch):
    """The guide's smallest spec, saved as tiny.py on the Python path."""
    text = GUIDE.read_text()
    (tmp_path / "tiny.py").write_text(text.split("```python\n", 1)[1].split("```", 1)[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    yield text
    sys.modules.pop("tiny", None)


def test_the_guides_smallest_spec_trains_and_its_refusals_are_the_real_ones(smallest, tmp_path,
                                                                            monkeypatch, capsys):
    rows = train(tmp_path / "run", 1, ["--model.name", "tiny:spec", "--training.steps", "3",
                                       "--data.seq_len", "32", "--training.local_batch_size", "4",
                                       "--metrics.log_freq", "1"])
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["val_loss"] > 0
    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", "2")
    for asked in ASKED:
        assert run_argv(["--model.name", "tiny:spec", "--validate", *asked]) == 2, asked
        line = capsys.readouterr().err.strip()
        assert line.partition(" choose from:")[0] in smallest, line


def test_the_conversion_script_takes_your_own_spec(tmp_path):
    """composer-convert-hf --model module:attribute: a DCP step of the example to
    OPT's layout and back, bit for bit."""
    import torch.distributed.checkpoint as dcp

    from composer.tools.convert_hf import main
    from examples.my_model import spec
    from tests.integration.test_checkpoint import load_checkpoint
    model = spec.build(spec.flavors["tiny"])
    model.init_weights()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "step", no_dist=True)
    mine = ["--model", "examples.my_model:spec"]
    assert main(["to-hf", str(tmp_path / "step"), str(tmp_path / "hf"), "--flavor", "tiny",
                 "--dtype", "float32", *mine]) == 0
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back"), *mine]) == 0
    back = load_checkpoint(tmp_path / "back")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[f"model.{name}"], tensor), name
