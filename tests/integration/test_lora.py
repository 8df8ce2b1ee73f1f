"""LoRA: a fresh adapter is the base model, only adapters train, the SFT loss
counts response tokens only, merged weights give the adapted logits (ours and
transformers'), adapter-only checkpoints resume exactly and composer-merge-lora
merges what the run merges. The sharded layouts are rows of the parity matrix.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from composer.checkpoint.hf import export_hf, hf_names, open_hf
from composer.config import parse_args
from composer.converters.lora import (
    Lora,
    convert_lora,
    init_with_adapters,
    is_adapter,
    merged_state_dict,
    merged_tensors,
)
from composer.data import ByteTokenizer
from composer.job.plan import plan_job
from composer.models import llama
from composer.models.common import rope_inv_freq
from composer.observe.memory import MemoryObserver
from composer.parallel.materialize import materialize
from composer.testing.harness import ROOT, launch, train
from composer.trainer.build import default_dtype
from composer.trainer.trainer import Trainer
from tests.integration.test_hf import SMALL, build, lift_float32, save_model_hf

SFT = str(ROOT / "tests" / "data" / "sft_tiny.jsonl")
ALL = "wq,wk,wv,wo,w1,w2,w3,output"


def trainer(folder, *args: str) -> Trainer:
    """A one-process trainer of the debug model, in this process."""
    cfg, _ = parse_args(["--config", str(ROOT / "train_configs" / "debug_model.toml"),
                         "--job.dump_folder", str(folder), "--data.seq_len", "32",
                         "--training.local_batch_size", "4", "--training.steps", "3",
                         "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
                         *args])
    return Trainer(plan_job(cfg, 0, 1))


BASES = {"float64": ("", "float64"), "bfloat16": ("", "bfloat16"), "float8": ("float8", "float32")}


@pytest.mark.parametrize("base", BASES)
def test_step_0_is_the_base_model_and_only_adapters_train(tmp_path, base):
    converter, dtype = BASES[base]
    plain = trainer(tmp_path / "plain", "--training.dtype", dtype, "--model.converters", converter)
    lora = trainer(tmp_path / "lora", "--training.dtype", dtype, "--model.converters",
                   ",".join(filter(None, (converter, "lora"))), "--lora.target_modules", ALL)
    model = lora.parts[0]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses = [lora.train_step()["loss"] for _ in range(3)]
    assert losses[0] == plain.train_step()["loss"]  # B = 0: exactly the base
    adapters = [name for name in before if is_adapter(name)]
    assert len(adapters) == 2 * 29  # 7 linears in each of 4 blocks, and the output
    for name, p in model.named_parameters():
        if is_adapter(name):
            assert p.requires_grad and not torch.equal(p, before[name]), name
        else:
            assert not p.requires_grad and torch.equal(p, before[name]), name
    trainable = sum(p.numel() for group in lora.optimizers[0].param_groups for p in group["params"])
    args = lora.plan.args
    sizes = [(args.dim, args.dim)] * 2 + [(args.dim, args.n_kv_heads * args.head_dim)] * 2 + \
        [(args.dim, args.ffn_hidden_dim)] * 3
    per_block = sum(8 * (a + b) for a, b in sizes)  # rank 8 x (in + out)
    assert trainable == args.n_layers * per_block + 8 * (args.dim + args.vocab_size)


def test_memory_breakdown_holds_optimizer_state_for_the_adapters_only(tmp_path):
    t = trainer(tmp_path, "--model.converters", "lora", "--metrics.memory_breakdown", "true")
    for _ in range(2):
        t.train_step()
    every = sum(p.numel() for p in t.parts[0].parameters())
    trainable = sum(p.numel() for p in t.params)
    last = next(o.meter.last for o in t.observers.observers if isinstance(o, MemoryObserver))
    assert last["params"] == 4 * every
    # AdamW: two float32 moments and one float32 step counter per adapter matrix
    assert last["optimizer"] == 8 * trainable + 4 * len(t.params)


def test_sft_loss_is_the_mean_over_response_tokens_only(tmp_path):
    t = trainer(tmp_path, "--training.dtype", "float64", "--model.converters", "lora",
                "--data.format", "sft", "--data.dataset", SFT, "--training.local_batch_size", "8")
    tokenizer = ByteTokenizer()
    # the first batch: rows 0-7 are training rows
    rows = [json.loads(line) for line in open(SFT)][:8]
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            prompt = [tokenizer.bos_id, *tokenizer.encode(row["prompt"])]
            tokens = torch.tensor(prompt + tokenizer.encode(row["response"]) + [tokenizer.eos_id])
            logp = t.parts[0](tokens[None, :-1])[0].log_softmax(-1)
            # position i predicts token i + 1: the response starts at len(prompt)
            for i in range(len(prompt) - 1, len(tokens) - 1):
                total -= logp[i, tokens[i + 1]].item()
                count += 1
    assert t.train_step()["loss"] == pytest.approx(total / count, rel=1e-12)


def lora_model(args, cfg: Lora) -> torch.nn.Module:
    """A float64 model with adapters, seeded, B drawn too (a trained adapter)."""
    with default_dtype(torch.float64):
        model = llama.spec.build_meta(args)
    convert_lora(model, cfg, llama.spec.adapters.lora_targets)
    materialize(model, lambda: None, torch.device("cpu"), seed=0, init=init_with_adapters)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(std=0.05)
    return model


def test_merged_weights_give_the_adapted_logits_here_and_in_transformers(tmp_path):
    from transformers import LlamaForCausalLM
    model = lora_model(SMALL, Lora(rank=4, alpha=8.0, target_modules=ALL.split(",")))
    tokens = torch.randint(0, SMALL.vocab_size, (2, SMALL.max_seq_len),
                           generator=torch.Generator().manual_seed(1))
    plain = build(SMALL, torch.float64)
    plain.load_state_dict(merged_state_dict(model))
    with torch.no_grad():
        adapted = model(tokens)
        scale = adapted.abs().max().item()
        base = build(SMALL, torch.float64)(tokens)
        merged = plain(tokens)
    assert (adapted - base).abs().max() > 1e-2 * scale  # the adapters matter
    torch.testing.assert_close(merged, adapted, rtol=1e-9, atol=1e-9 * scale)
    export_hf(model, tmp_path, llama.spec, SMALL, torch.float64, tensors=merged_tensors(model))
    assert not any("lora" in name for name in hf_names(tmp_path))
    theirs = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    lift_float32(theirs, rope_inv_freq(SMALL))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, adapted, rtol=1e-9, atol=1e-9 * scale)


def test_dropout_acts_in_training_only():
    model = lora_model(SMALL, Lora(rank=4, alpha=8.0, dropout=0.5))
    plain = build(SMALL, torch.float64)
    plain.load_state_dict(merged_state_dict(model))
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        trained = model.train()(tokens)
        evaluated = model.eval()(tokens)
        torch.testing.assert_close(evaluated, plain(tokens), rtol=1e-9, atol=1e-9)
        assert (trained - evaluated).abs().max() > 1e-3


def test_adapter_only_checkpoints_resume_exactly_and_merge_like_the_run(tmp_path):
    base = tmp_path / "base_hf"
    base_state = save_model_hf(base, llama.flavors["debug"])
    common = ["--data.format", "sft", "--data.dataset", SFT, "--data.seq_len", "32",
              "--training.local_batch_size", "4", "--model.converters", "lora",
              "--lora.target_modules", ALL, "--checkpoint.enable", "--checkpoint.interval", "2",
              "--checkpoint.initial_load_path", str(base), "--metrics.log_freq", "1",
              "--metrics.enable_tensorboard", "false", "--validation.freq", "2"]
    whole = train(tmp_path / "whole", 1, [*common, "--training.steps", "4",
                                          "--lora.merge_on_export"])
    train(tmp_path / "split", 1, [*common, "--training.steps", "2"])
    split = train(tmp_path / "split", 1, [*common, "--training.steps", "4"])
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    for ours, ref in zip(split, whole):
        assert (ours["loss"], ours["grad_norm"]) == (ref["loss"], ref["grad_norm"])
    step = tmp_path / "split" / "checkpoint" / "step-2"
    saved = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(is_adapter(k) for k in model_keys)
    saved_elements = sum(saved[k].size.numel() for k in model_keys)
    assert saved_elements < 0.1 * sum(t.numel() for t in base_state.values())
    out = tmp_path / "merged"
    result = launch(["--config", str(ROOT / "train_configs" / "debug_model.toml"), *common,
                     "--adapters", str(tmp_path / "split" / "checkpoint" / "step-4"),
                     "--out", str(out), "--dtype", "float32"], program="composer.tools.merge_lora")
    assert result.returncode == 0, result.stderr[-3000:]
    _, ours = open_hf(out)
    _, run = open_hf(tmp_path / "whole" / "checkpoint" / "step-4-hf")
    names = hf_names(out)
    assert sorted(names) == sorted(hf_names(tmp_path / "whole" / "checkpoint" / "step-4-hf"))
    assert all(torch.equal(ours(n), run(n)) for n in names)
    _, original = open_hf(base)
    assert not torch.equal(ours("model.layers.0.self_attn.q_proj.weight"),
                           original("model.layers.0.self_attn.q_proj.weight"))


@pytest.mark.parametrize("argv,message", [
    (["--adapters", "/no/such/step"], "--adapters /no/such/step: not a complete checkpoint step"),
    (["--model.converters", "", "--adapters", "."], "model.converters has no 'lora' or 'qlora'"),
])
def test_merge_script_bad_input_exits_2_with_one_line(tmp_path, argv, message):
    result = launch(["--config", str(ROOT / "train_configs" / "debug_model.toml"),
                     "--model.converters", "lora", "--out", str(tmp_path / "out"), *argv],
                    program="composer.tools.merge_lora")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "out").exists()
