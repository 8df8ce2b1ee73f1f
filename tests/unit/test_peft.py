"""LoRA adapters as a PEFT folder (``lora.export = "peft"``), with peft as the reference:
after a few steps (so lora_B is not zero), ``peft.PeftModel.from_pretrained`` of the
base folder and the exported adapters gives composer's logits (float32), for the
built-in Llama (whose q/k rows the Hugging Face layout reorders, lora_B's with them)
and for a transformers model (``model.name = "hf"``)."""
from __future__ import annotations

import json

import pytest
import torch

from composer.models import llama
from composer.trainer.saves import export_at_end
from tests.integration.test_hf import save_model_hf
from tests.integration.test_lora import SFT, trainer
from tests.support.hf_folders import make

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = ["--model.converters", "lora", "--lora.export", "peft", "--lora.rank", "4",
        "--training.dtype", "float32", "--optimizer.lr", "3e-2", "--data.format", "sft",
        "--data.dataset", SFT]


def trained_and_exported(tmp_path, base, *args: str):
    """A LoRA run from the folder ``base``, 3 steps, its adapters exported as PEFT."""
    run = trainer(tmp_path / "run", "--model.hf_path", str(base), *LORA, *args)
    for _ in range(3):
        run.train_step()
    export_at_end(run.plan, run.parts, 3)
    return run, tmp_path / "run" / "checkpoint" / "step-3-peft"


def peft_logits(base, folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(model, folder).eval()(tokens).logits


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "hf"])
def test_peft_loads_the_adapters_and_gives_composers_logits(tmp_path, family):
    base = tmp_path / "base"
    if family == "llama3":
        save_model_hf(base, llama.flavors["debug"])
        args = ["--model.name", "llama3", "--lora.target_modules", "wq,wk,wv,wo,w2"]
        names = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    else:
        make("llama", base)
        args = ["--model.name", "hf"]
        names = ["q_proj", "k_proj", "v_proj", "o_proj"]
    run, folder = trained_and_exported(tmp_path, base, *args)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 16.0)
    assert config["target_modules"] == sorted(names)
    assert config["base_model_name_or_path"] == str(base)
    assert (folder / "generation_config.json").is_file()
    b = [m.lora_b for m in run.parts[0].modules() if hasattr(m, "lora_b")]
    assert all(t.abs().max() > 0 for t in b)  # trained: the adapters change the logits
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = run.parts[0].eval()(tokens).float()
    theirs = peft_logits(base, folder, tokens)
    assert (ours - theirs).abs().max() <= 1e-5 * ours.abs().max()
    without = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        assert (without(tokens).logits - ours).abs().max() > 1e-3  # the adapters count
    # a run that starts from the folder starts with those adapters
    again = trainer(tmp_path / "again", "--model.hf_path", str(base), *LORA, *args,
                    "--lora.initial_adapter", str(folder))
    with torch.no_grad():
        assert torch.equal(again.parts[0].eval()(tokens), ours)


def test_a_folder_that_is_no_matching_adapter_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                     capsys):
    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", "1")
    folder = tmp_path / "adapter"
    folder.mkdir()
    argv = ["--validate", *LORA, "--lora.initial_adapter", str(folder)]
    assert run_argv(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: lora.initial_adapter={str(folder)!r}: no adapter_config.json and "
        f"adapter_model.safetensors there; allowed: a PEFT LoRA folder")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                            "lora_alpha": 16}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    assert run_argv(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: lora.initial_adapter={str(folder)!r}: its peft_type, r and lora_alpha are "
        f"('LORA', 8, 16); the run's are ('LORA', 4, 16.0) (lora.rank, lora.alpha)")
