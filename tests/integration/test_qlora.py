"""QLoRA: the base is torchao's NF4 of the same weights, bit for bit; step 1 is the
dequantized model's; parameter memory is NF4's formula (measured and planned);
adapter-only steps resume exactly; the merged export loads in transformers with
the model's logits, and composer-merge-lora merges a step as the run does (and
writes its adapters as the PEFT folder the run exports, which peft loads); bad
shapes and combinations are one line and exit 2. The sharded layouts (FSDP2,
ZeRO-2 + AC, HSDP, PP2, PP2 x FSDP2) are rows of the parity matrix."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchao.quantization import NF4Tensor, to_nf4

from composer.checkpoint.hf import hf_names, open_hf
from composer.cli.run import run_argv
from composer.converters.lora import is_adapter
from composer.converters.qlora import _own_storage, nf4_bytes_per_element, quantized_linears
from composer.models import llama
from composer.models.common import rope_inv_freq
from composer.observe.memory import MemoryObserver
from composer.planner.cluster import load_cluster
from composer.planner.predict import predict
from composer.testing.harness import ROOT, launch, train
from composer.tools import merge_lora
from tests.integration.test_hf import lift_float32, save_model_hf
from tests.integration.test_lora import SFT, trainer
from tests.integration.test_planner import layout_for

FLAVOR = ("--model.flavor", "debug256")
TARGETS = ("--lora.target_modules", "wq,wv,wo,w1,w2")
QLORA = ("--model.converters", "qlora", *FLAVOR, *TARGETS)
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def test_the_base_is_nf4_of_the_same_weights_and_step_1_its_dequantized_models(tmp_path):
    lora = trainer(tmp_path / "lora", "--model.converters", "lora", *FLAVOR, *TARGETS)
    qlora = trainer(tmp_path / "qlora", *QLORA)
    ours, theirs = qlora.parts[0], lora.parts[0]
    linears = quantized_linears(ours)
    assert len(linears) == 2 * 7  # every linear of both blocks; the output head stays
    assert (type(ours.output.weight) is torch.nn.Parameter
            and not isinstance(ours.output.weight.data, NF4Tensor))
    with torch.no_grad():
        for fqn, m in linears.items():
            original = theirs.get_submodule(fqn).weight
            expected = to_nf4(original.detach(), 64, 256)
            assert isinstance(m.weight, NF4Tensor) and not m.weight.requires_grad
            for name in INNER:
                assert torch.equal(getattr(m.weight, name), getattr(expected, name)), (fqn, name)
            original.copy_(m.weight.get_original_weight())  # the LoRA run gets the dequantized base
    assert qlora.train_step()["loss"] == pytest.approx(lora.train_step()["loss"], rel=1e-6)


def test_parameter_memory_is_nf4s_formula_measured_and_planned(tmp_path):
    t = trainer(tmp_path, *QLORA, "--metrics.memory_breakdown", "true")
    for _ in range(2):
        t.train_step()
    measured = next(o.meter.last for o in t.observers.observers if isinstance(o, MemoryObserver))
    model = t.parts[0]
    nf4 = sum(m.weight.numel() for m in quantized_linears(model).values())
    plain = sum(p.numel() for p in model.parameters()) - nf4
    formula = nf4 * nf4_bytes_per_element(4) + 4 * plain
    assert measured["params"] == pytest.approx(formula, rel=0.05)
    planned = predict(layout_for(["--model.name", "llama3", *QLORA], 1), load_cluster("cpu"))
    assert planned.peak.gib()["params"] * 2**30 == pytest.approx(formula, rel=0.05)


def test_a_ranks_shard_of_the_base_keeps_only_its_own_codes_and_scales():
    """torchao's chunk of an NF4 weight is a view into the whole weight's codes (each
    FSDP2 rank kept the whole base: the 70B config's dry run traced 8x the planned NF4
    bytes); the shard copies its rows out, with the same values."""
    whole = to_nf4(torch.randn(512, 256), 64, 256)
    rows = whole.get_original_weight()
    for i, chunk in enumerate(torch.chunk(whole, 4)):
        own = _own_storage(chunk)
        assert torch.equal(own.get_original_weight(), rows[128 * i:128 * (i + 1)])
        for name in ("quantized_data", "quantized_scalers"):
            inner = getattr(own, name)
            assert inner.untyped_storage().nbytes() == inner.numel() * inner.element_size()
            assert getattr(chunk, name).untyped_storage().nbytes() == 4 * inner.numel()


def test_adapter_only_steps_resume_exactly_and_the_merged_export_loads_in_transformers(tmp_path):
    from transformers import LlamaForCausalLM
    args = dataclasses.replace(llama.flavors["debug256"])
    save_model_hf(tmp_path / "base", args)
    common = [*QLORA, "--data.format", "sft", "--data.dataset", SFT, "--data.seq_len", "32",
              "--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval",
              "2", "--checkpoint.initial_load_path", str(tmp_path / "base"), "--metrics.log_freq",
              "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
              "--optimizer.lr", "3e-2"]
    whole = train(tmp_path / "whole", 1, [*common, "--training.steps", "4"])
    train(tmp_path / "split", 1, [*common, "--training.steps", "2"])
    split = train(tmp_path / "split", 1, [*common, "--training.steps", "4"])
    assert ([(r["loss"], r["grad_norm"]) for r in split]
            == [(r["loss"], r["grad_norm"]) for r in whole])
    saved = dcp.FileSystemReader(str(tmp_path / "split" / "checkpoint" / "step-2")).read_metadata()
    keys = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert keys and all(is_adapter(k) for k in keys)

    t = trainer(tmp_path / "export", *common, "--training.steps", "2", "--lora.merge_on_export",
                "--lora.export", "peft")
    t.fit()
    export = tmp_path / "export" / "checkpoint" / "step-2-hf"
    result = launch(["--config", str(ROOT / "train_configs" / "debug_model.toml"), *common,
                     "--adapters", str(tmp_path / "export" / "checkpoint" / "step-2"),
                     "--out", str(tmp_path / "merged"), "--dtype", "float32"],
                    program="composer.tools.merge_lora")
    assert result.returncode == 0, result.stderr[-3000:]
    _, merged = open_hf(tmp_path / "merged")
    _, run = open_hf(export)
    assert sorted(hf_names(tmp_path / "merged")) == sorted(hf_names(export))
    assert all(torch.equal(merged(n), run(n)) for n in hf_names(export))  # the run's own merge
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    theirs = LlamaForCausalLM.from_pretrained(export, dtype=torch.float32)
    lift_float32(theirs, rope_inv_freq(args))
    with torch.no_grad():
        ours = t.parts[0].eval()(tokens)
        scale = ours.abs().max().item()
        torch.testing.assert_close(theirs(tokens).logits, ours, rtol=1e-5, atol=1e-5 * scale)
    # the adapters as PEFT, at the run's end and from its DCP step by the script: the same
    # tensors, and peft itself puts each one in its place (none stays at its zero init)
    merge_lora.merge(["--config", str(ROOT / "train_configs" / "debug_model.toml"), *common,
                     "--adapters", str(tmp_path / "export" / "checkpoint" / "step-2"),
                     "--out", str(tmp_path / "peft"), "--dtype", "float32", "--peft"])
    from peft import PeftModel
    from safetensors.torch import load_file
    ran = load_file(tmp_path / "export" / "checkpoint" / "step-2-peft"
                    / "adapter_model.safetensors")
    converted = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert ran.keys() == converted.keys() and all(torch.equal(ran[k], converted[k]) for k in ran)
    peft_model = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32), tmp_path / "peft")
    loaded = {k: v for k, v in peft_model.state_dict().items() if "lora_B" in k}
    assert len(loaded) == sum("lora_B" in k for k in ran) > 0
    assert all(v.abs().max() > 0 for v in loaded.values())


def test_a_dcp_step_as_the_base_is_quantized_from_its_weights(tmp_path):
    plain = [*FLAVOR, "--training.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "1",
             "--metrics.enable_tensorboard", "false", "--validation.enable", "false"]
    train(tmp_path / "plain", 1, plain)
    step = tmp_path / "plain" / "checkpoint" / "step-1"
    saved = {k: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata.items()
             if k.startswith("model.")}
    dcp.load(saved, checkpoint_id=str(step), no_dist=True)
    t = trainer(tmp_path / "qlora", *QLORA, "--checkpoint.initial_load_path", str(step))
    for fqn, m in quantized_linears(t.parts[0]).items():
        expected = to_nf4(saved[f"model.{fqn}.weight"], 64, 256)
        assert all(torch.equal(getattr(m.weight, n), getattr(expected, n)) for n in INNER), fqn


def test_the_70b_config_validates_for_one_node_and_fits(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert run_argv(["--config", "train_configs/llama3_70b_qlora.toml", "--job.dump_folder",
                 str(tmp_path), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "config ok for 8 rank(s)" in out and "predicted for 8 x h100-80gb: peak" in out
    assert "does not fit" not in out
    planned = predict(layout_for(["--config", "train_configs/llama3_70b_qlora.toml"], 8, "cuda"),
                      load_cluster("h100-80gb"))
    # the base: 4.6 GiB + the root gathered
    assert planned.fits and planned.peak.gib()["params"] < 9


def test_the_output_head_is_nf4_when_asked(tmp_path):
    t = trainer(tmp_path, *QLORA, "--lora.quantize_output", "true")
    assert isinstance(t.parts[0].output.weight, NF4Tensor)
    assert len(quantized_linears(t.parts[0])) == 2 * 7 + 1
    losses = [t.train_step()["loss"] for _ in range(2)]
    assert all(loss == loss for loss in losses) and losses[1] != losses[0]


@pytest.mark.parametrize("world,argv,message", [
    (1, ["--model.converters", "qlora"],
     "model.converters=['qlora']: layers.0.attention.wk.weight [64, 128] of llama3/debug cannot be "
     "stored in NF4: its 8,192 elements must divide into blocks of 64 x 256 = 16,384; choose a "
     "flavor whose linears do (llama3: 'debug256' and up)"),
    (4, [*QLORA],
     "model.converters=['qlora']: layers.0.attention.wk.weight [128, 256] of llama3/debug256 "
     "cannot be stored in NF4: its 32,768 elements, and over 4 FSDP2 shards 128 rows and each "
     "shard's must divide into blocks of 64 x 256 = 16,384"),
    (1, [*QLORA, "--model.converters", "float8,qlora"],
     "model.converters=['float8', 'qlora']: 'qlora' is LoRA on an NF4 base and takes no 'float8' "
     "beside it"),
    (2, [*QLORA, "--parallelism.tensor_parallel_degree", "2"],
     "parallelism.tensor_parallel_degree=2 with qlora: torchao's NF4 weights cannot be cut by "
     "tensor parallel"),
    (2, [*QLORA, "--parallelism.zero_stage", "1"],
     "parallelism.zero_stage=1 with qlora on 2 data-parallel ranks: DDP would broadcast the NF4 "
     "base, which torchao cannot; allowed: 2, 3 (FSDP2)"),
    (1, [*QLORA, "--model.overrides", "tie_embeddings=true", "--lora.quantize_output", "true"],
     "lora.quantize_output=true: the output head of debug256 is tied to the embedding, which "
     "cannot look up NF4 rows; allowed: false"),
])
def test_bad_input_is_one_line_and_exit_2(world, argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    code = run_argv(["--config", str(ROOT / "train_configs" / "debug_model.toml"), *argv,
                 "--job.dump_folder", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()
