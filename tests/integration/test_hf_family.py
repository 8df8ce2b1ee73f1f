"""Any Hugging Face causal LM, as it is (``model.name = "hf"``, ``model.hf_path``):
tiny random folders transformers itself writes (tests/support/hf_folders.py) train through
composer, and transformers is the reference: the first step's loss is transformers'
own loss on the same tokens, and what composer exports loads back in transformers."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from composer.data import DataLoader, build_tokenizer
from composer.testing.harness import train
from tests.support.hf_folders import make

transformers = pytest.importorskip("transformers")

ARCHS = ("llama", "qwen2", "mistral", "qwen3_moe")
STEP = ["--model.name", "hf", "--training.dtype", "float64", "--data.seq_len", "64",
        "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
        "--data.document_mask", "false"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    here = tmp_path_factory.mktemp("hf_folders")
    return {arch: make(arch, here / arch) for arch in ARCHS}


def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The batch composer's first step reads with STEP's settings."""
    loader = DataLoader("tinyshakespeare", build_tokenizer("byte"), 64, 4, 0, 1, split="train",
                        val_fraction=0.05, document_mask=False)
    inputs, targets = loader.next_batch()[:2]
    return inputs, targets


@pytest.mark.parametrize("arch", ARCHS)
def test_the_first_step_is_transformers_own_loss(arch, folders, tmp_path):
    """Composer's step-1 loss from the folder equals the cross-entropy of transformers'
    logits on the same tokens (float64, relative 1e-9); the export after a step loads
    in transformers and gives composer's logits. Qwen3-MoE's experts are stored one
    tensor each and held packed: transformers' own conversion maps them both ways."""
    rows = train(tmp_path / "run", 1, [*STEP, "--model.hf_path", str(folders[arch]),
                                       "--training.steps", "1", "--checkpoint.enable",
                                       "--checkpoint.last_save_in_hf",
                                       "--checkpoint.export_dtype", "float64"])
    eager = {"experts_implementation": "eager"}  # torch's grouped matmul takes no float64
    reference = transformers.AutoModelForCausalLM.from_pretrained(folders[arch],
                                                                   dtype=torch.float64, **eager)
    inputs, targets = first_batch()
    with torch.no_grad():
        logits = reference(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert rows[0]["loss"] == pytest.approx(loss.item(), rel=1e-9, abs=0)
    export = tmp_path / "run" / "checkpoint" / "step-1-hf"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == arch and "attn_implementation" not in config
    trained = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float64,
                                                                 **eager)
    assert not torch.equal(trained.lm_head.weight, reference.lm_head.weight)  # it trained
    from composer.checkpoint.hf import hf_names
    assert sorted(hf_names(export)) == sorted(hf_names(folders[arch]))  # the folder's layout
    from composer.checkpoint.hf import load_hf_into
    from composer.config import parse_args
    from composer.job.plan import resolve_model
    from composer.models.hf import HFLayout
    cfg, _ = parse_args(["--model.name", "hf", "--model.hf_path", str(export)])
    spec, args = resolve_model(cfg)
    torch.set_default_dtype(torch.float64)
    try:
        ours = spec.build_meta(args).to_empty(device="cpu")
        ours.init_weights()  # the buffers (rotary tables); the weights come from the folder
    finally:
        torch.set_default_dtype(torch.float32)
    load_hf_into(ours, export, HFLayout(args))
    with torch.no_grad():
        torch.testing.assert_close(ours(inputs), trained(inputs).logits, rtol=1e-9, atol=1e-12)


def test_a_folder_that_cannot_be_read_is_refused_in_one_line(folders, tmp_path, monkeypatch,
                                                             capsys):
    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", "2")
    llama = str(folders["llama"])
    remote = shutil.copytree(folders["llama"], tmp_path / "remote")
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}}))
    cases = {
        ("--model.hf_path", str(tmp_path)):
            f"error: model.hf_path={str(tmp_path)!r}: no config.json there; allowed: a Hugging "
            f"Face model folder",
        ("--model.hf_path", str(remote)):
            f"error: model.hf_path={str(remote)!r}: its config.json names code of its own "
            f"(auto_map: AutoModelForCausalLM), which runs only with "
            f"model.hf_trust_remote_code = true",
        ("--model.hf_path", llama, "--model.name", "moe"):
            f"error: model.hf_path={llama!r}: model 'moe' has no Hugging Face adapter "
            f"(ModelSpec.adapters.hf_adapter) to read a folder with",
        ("--model.name", "hf"):
            "error: model.name='hf': its spec has no flavors (ModelSpec.flavors: name -> the "
            "arguments build takes); it is built from a Hugging Face folder: set model.hf_path",
    }
    for argv, line in cases.items():
        assert run_argv(["--model.name", "hf", "--validate", *argv]) == 2, argv
        assert capsys.readouterr().err.strip() == line
    assert run_argv(["--model.name", "hf", "--validate", "--model.hf_path", llama,
                     "--model.flavor", "8B"]) == 0
    out = capsys.readouterr().out
    assert "model.flavor='8B' is ignored: the model's sizes come from" in out


def test_architectures_composer_cannot_reach_are_refused_in_one_line(tmp_path, monkeypatch,
                                                                     capsys):
    """Jamba's Mamba layers mix positions outside attention, and Bloom's attention does
    not go through transformers' attention interface: neither a document mask nor context
    parallel reaches them. Documents are off under ``auto`` (saying why), and refused when
    asked for, as is context parallel; without them each validates (GPT-2's decoder layers,
    kept as ``h``, are found)."""
    from transformers import BloomConfig, GPT2Config, JambaConfig

    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", "2")
    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=320, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path / "g")
    JambaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=320, intermediate_size=128, attn_layer_period=2, attn_layer_offset=1,
                num_experts=1, mamba_d_state=8).save_pretrained(tmp_path / "j")
    BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=320).save_pretrained(tmp_path / "b")
    jamba = ["--model.hf_path", str(tmp_path / "j")]
    bloom = "BloomForCausalLM's attention modules do not call transformers' attention interface"
    mamba = ("lm.model.layers.0.mamba.conv1d (JambaMambaDecoderLayer) mixes positions outside "
             "attention")
    cases = {
        ("--model.hf_path", str(tmp_path / "b"), "--parallelism.context_parallel_degree", "2"):
            f"error: parallelism.context_parallel_degree=2: {bloom}; allowed: 1",
        (*jamba, "--data.document_mask", "true"):
            f"error: data.document_mask=true: {mamba}; allowed: false",
        (*jamba, "--parallelism.context_parallel_degree", "2"):
            f"error: parallelism.context_parallel_degree=2: {mamba}; allowed: 1",
    }
    for argv, line in cases.items():
        assert run_argv(["--model.name", "hf", "--validate", *argv]) == 2, argv
        assert capsys.readouterr().err.strip() == line
    for folder, why in (("j", mamba), ("b", bloom), ("g", None)):
        assert run_argv(["--model.name", "hf", "--validate", "--model.hf_path",
                         str(tmp_path / folder)]) == 0
        out = capsys.readouterr().out
        assert (f"data.document_mask=auto: off, {why}" in out) == (why is not None), out


def test_the_built_in_llama_and_transformers_llama_train_alike(folders, tmp_path):
    """From the same folder, composer's own Llama (``model.name = "llama3"``, its rows
    permuted for its rotary layout by its adapter) and transformers' Llama (``hf``)
    give the same losses, validation included (float64, relative 1e-9). The gradient
    norms agree to 1e-7: transformers computes its rotary tables in float32, composer
    in the training dtype."""
    common = [*STEP, "--model.hf_path", str(folders["llama"]), "--training.steps", "3",
              "--data.document_mask", "true", "--validation.enable", "true",
              "--validation.freq", "3"]
    ours = train(tmp_path / "llama3", 1, [*common, "--model.name", "llama3"])
    theirs = train(tmp_path / "hf", 1, common)
    for a, b in zip(ours, theirs, strict=True):
        for key, rel in (("loss", 1e-9), ("val_loss", 1e-9), ("grad_norm", 1e-7)):
            assert (key in a) == (key in b)
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=rel, abs=0), (a["step"], key)


@pytest.mark.slow
def test_the_lora_debug_config_fine_tunes_a_folder_on_two_ranks(tmp_path):
    """train_configs/hf_lora_debug.toml on 2 CPU ranks (FSDP2) against the folder
    composer-tiny-hf writes: the loss falls, and the merged export (base +
    adapters) has the folder's layout and loads with from_pretrained."""
    from composer.testing.harness import Run, run_jobs
    from composer.tools.tiny_hf import make as make_tiny
    make_tiny("llama", str(tmp_path / "tiny"))
    job = run_jobs({"lora": Run(2, ["--config", "train_configs/hf_lora_debug.toml",
                                    "--model.hf_path", str(tmp_path / "tiny")])},
                   tmp_path)["lora"]
    rows = job.rows()
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3 and "val_loss" in rows[-1]
    export = job.folder / "checkpoint" / "step-30-hf"
    from composer.checkpoint.hf import hf_names
    assert sorted(hf_names(export)) == sorted(hf_names(tmp_path / "tiny"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(export)
    # the byte tokenizer's ids, where a generation starts and ends
    assert (merged.generation_config.bos_token_id, merged.generation_config.eos_token_id) == (
        256, 257)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], base.state_dict()[q])  # adapters folded in


def test_without_transformers_the_job_stops_in_one_line_naming_the_extra(folders, tmp_path):
    """A machine without transformers (an import that fails, as it would there)."""
    import subprocess
    import sys

    from composer.testing.harness import ROOT, launch_env
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['transformers'] = None\n")
    env = {**launch_env(), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    result = subprocess.run([sys.executable, "-m", "composer.train", "--model.name", "hf",
                             "--model.hf_path", str(folders["llama"]), "--validate"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: model.hf_path={str(folders['llama'])!r}: the model is transformers' own, and "
        f"transformers is not installed: pip install 'composer-parallel[hf]'"]


@pytest.mark.slow
def test_float8_and_qlora_convert_transformers_own_linears(tmp_path):
    """The converters act on nn.Linears, so they reach a transformers model's: float8 swaps
    every eligible linear but the head; QLoRA's base is torchao's NF4 of the folder's
    weights, and its first step is the LoRA step of the dequantized base."""
    from torchao.quantization import NF4Tensor, to_nf4

    from composer.converters.float8 import Float8, convert_float8
    from composer.converters.qlora import quantized_linears
    from composer.models.hf import HFLayout
    from composer.models.hf import spec as hf_spec
    from tests.integration.test_lora import trainer
    from tests.support.hf_folders import configs

    meta = hf_spec.build_meta(configs()["llama"])
    linears = [n for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * 7 + 1
    assert convert_float8(meta, Float8(), torch.device("cpu"),
                          hf_spec.adapters.logits_modules) == linears[:-1]

    # NF4 quantizes in blocks of 64 x 256 elements: every linear of a 256-wide model divides
    config = configs()["llama"]
    config.update(dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=4, num_hidden_layers=2))
    folder = tmp_path / "wide"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    assert HFLayout.args_from_folder(folder).hidden_size == 256
    run = ["--model.name", "hf", "--model.hf_path", str(folder), "--data.format", "sft",
           "--data.dataset", "tests/data/sft_tiny.jsonl", "--lora.rank", "4"]
    lora = trainer(tmp_path / "lora", *run, "--model.converters", "lora")
    qlora = trainer(tmp_path / "qlora", *run, "--model.converters", "qlora")
    quantized = quantized_linears(qlora.parts[0])
    assert len(quantized) == 2 * 7
    with torch.no_grad():
        for fqn, m in quantized.items():
            original = lora.parts[0].get_submodule(fqn).weight
            assert isinstance(m.weight, NF4Tensor)
            expected = to_nf4(original.detach(), 64, 256)
            assert torch.equal(m.weight.quantized_data, expected.quantized_data), fqn
            original.copy_(m.weight.get_original_weight())
    assert qlora.train_step()["loss"] == pytest.approx(lora.train_step()["loss"], rel=1e-6)
