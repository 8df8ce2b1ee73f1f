"""Preference tuning (DPO): pairs become a chosen and a rejected sequence masked as SFT
masks them, the reference is the model with its adapters off, step 1 from a PEFT adapter
gives the loss transformers + peft give, a short run raises the margin, and bad input
is refused in one line; full fine-tuning trains against a frozen copy of its start. The
sharded layouts are rows of the parity matrix (dpo_*)."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from composer.cli.run import run_argv
from composer.converters.lora import Lora, adapters_off, convert_lora, init_adapters
from composer.data import IGNORE_INDEX, ByteTokenizer, DataLoader
from composer.data.preference import pair_tokens
from composer.data.sft import chat_tokens, prompt_response_tokens
from composer.models import llama
from composer.models.common import rope_inv_freq
from composer.testing.harness import ROOT, train
from composer.trainer.dpo import METRICS
from composer.trainer.objective import sequence_logps
from tests.integration.test_hf import build, lift_float32, save_model_hf
from tests.integration.test_lora import trainer

PAIRS = str(ROOT / "tests" / "data" / "preference_tiny.jsonl")
DPO = ["--model.converters", "lora", "--lora.rank", "4", "--training.objective", "dpo",
       "--data.format", "preference", "--data.dataset", PAIRS]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_each_answer_is_the_sft_example_of_its_prompt_strings_and_chats():
    tok = ByteTokenizer()
    row = {"prompt": "Upper: sword\n", "chosen": "SWORD", "rejected": "sword"}
    assert pair_tokens(row, tok) == (prompt_response_tokens("Upper: sword\n", "SWORD", tok),
                                     prompt_response_tokens("Upper: sword\n", "sword", tok))
    user = [{"role": "user", "content": "hi"}]
    chosen, rejected = ([{"role": "assistant", "content": x}] for x in ("hello", "go away"))
    expected = chat_tokens(user + chosen, tok), chat_tokens(user + rejected, tok)
    for prompt in (user, "hi"):  # messages, or a string read as one user message
        assert pair_tokens({"prompt": prompt, "chosen": chosen, "rejected": rejected},
                           tok) == expected
    # no prompt: each answer is a whole chat
    assert pair_tokens({"chosen": user + chosen, "rejected": user + rejected}, tok) == expected
    with pytest.raises(ValueError, match=r"the row has fields \['chosen', 'prompt'\]"):
        pair_tokens({"prompt": "p", "chosen": "c"}, tok)


def test_a_batch_is_the_pairs_chosen_then_rejected_learning_the_answers(tmp_path):
    rows = [{"prompt": f"Q{i}:", "chosen": "y" * (1 + i), "rejected": "n" * (3 - i)}
            for i in range(3)]
    loader = DataLoader(write_jsonl(tmp_path / "p.jsonl", rows), ByteTokenizer(), 12, 2, 1, 2,
                        val_fraction=0, format="preference")
    x, y = loader.next_batch()  # rank 1 of 2 takes pairs 2 and 0 (the next epoch's)
    eos = ByteTokenizer.eos_id
    answers = [b"yyy", b"y", b"n", b"nnn"]  # chosen 2, chosen 0, rejected 2, rejected 0
    assert x.shape == y.shape == (4, 12)
    for i, (pair, answer) in enumerate(zip([2, 0, 2, 0], answers)):
        tokens, _ = prompt_response_tokens(f"Q{pair}:", answer.decode(), ByteTokenizer())
        assert x[i, :len(tokens)].tolist() == tokens
        assert y[i][y[i] != IGNORE_INDEX].tolist() == [*answer, eos]
    assert loader.windows_consumed == 4  # pairs of both ranks, not sequences


def test_full_fine_tuning_trains_against_a_frozen_copy_of_its_start(tmp_path):
    """Without adapters the reference is a copy of the model as the run started it, laid
    out like the policy and frozen: step 1 is ln 2 (the two are one model), then the
    policy moves and the copy stays."""
    run = trainer(tmp_path, *DPO, "--model.converters", "", "--lora.rank", "8",  # rank: default
                  "--training.dtype", "float64", "--optimizer.lr", "1e-3")
    start = {k: v.clone() for k, v in run.parts[0].state_dict().items()}
    rows = [run.train_step() for _ in range(3)]
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-12) and rows[0]["dpo_margin"] == 0
    assert rows[2]["dpo_margin"] > 0 and rows[2]["loss"] < rows[0]["loss"]
    frozen = run.objective.frozen[0]
    assert not any(p.requires_grad for p in frozen.parameters())
    assert all(torch.equal(v, start[k]) for k, v in frozen.state_dict().items())
    assert not all(torch.equal(v, start[k]) for k, v in run.parts[0].state_dict().items())


def test_adapters_off_is_the_base_model():
    args = llama.flavors["debug"]
    base = build(args)
    model = copy.deepcopy(base)
    convert_lora(model, Lora(rank=4, target_modules=["wq", "wv", "w2"]))
    init_adapters(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.1)
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        adapted = model(tokens)
        with adapters_off([model]):
            off = model(tokens)
        assert torch.equal(off, base(tokens))
        assert not torch.equal(adapted, off)
        assert torch.equal(model(tokens), adapted)  # back on after the context


def test_sequence_logps_sum_the_learned_targets_log_probabilities():
    logits = torch.randn(2, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([[1, 2, IGNORE_INDEX, 3, IGNORE_INDEX], [IGNORE_INDEX] * 4 + [6]])
    logp = logits.log_softmax(-1)
    expected = [logp[0, 0, 1] + logp[0, 1, 2] + logp[0, 3, 3], logp[1, 4, 6]]
    assert torch.allclose(sequence_logps(logits, targets), torch.stack(expected), rtol=1e-12)


def peft_adapter(base, folder, names):
    """A PEFT LoRA folder made by peft itself on the transformers model of ``base``, its
    lora_B drawn non-zero (so the adapted model is not the base); returns the PeftModel,
    in float64 (its RMSNorm and rotary tables too, which transformers keeps in float32)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    lift_float32(model, rope_inv_freq(llama.flavors["debug"]))  # its float32 norms and rotary
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0,
                                                       target_modules=names))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.5)
    model.save_pretrained(folder)
    return model.eval()


def hf_logps(model, inputs, targets):
    with torch.no_grad():
        logp = model(inputs).logits.log_softmax(-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != IGNORE_INDEX)).sum(1)


def test_step_1_from_a_peft_adapter_is_the_dpo_loss_of_transformers_and_peft(tmp_path):
    """float64: the policy is peft's model, the reference the same with its adapter
    disabled (``disable_adapter``); the loss and rewards agree to a relative 1e-9."""
    base, folder = tmp_path / "base", tmp_path / "adapter"
    save_model_hf(base, llama.flavors["debug"])
    peft_model = peft_adapter(base, folder, ["q_proj", "v_proj", "o_proj", "down_proj"])
    beta = 0.5
    run = trainer(tmp_path / "run", "--model.hf_path", str(base), *DPO, "--lora.target_modules",
                  "wq,wv,wo,w2", "--lora.initial_adapter", str(folder), "--dpo.beta", str(beta),
                  "--training.dtype", "float64")
    inputs, targets = run.train_data.next_batch()  # the batch step 1 reads
    run.train_data.reset()
    row = run.train_step()
    policy = hf_logps(peft_model, inputs, targets)
    with peft_model.disable_adapter():
        reference = hf_logps(peft_model, inputs, targets)
    chosen, rejected = (beta * (policy - reference)).chunk(2)
    loss = -F.logsigmoid(chosen - rejected).mean().item()
    assert abs(loss - math.log(2)) > 1e-3  # the adapter moves the policy off the reference
    print(f"step-1 DPO loss: composer {row['loss']!r}, transformers+peft {loss!r}, "
          f"relative difference {abs(row['loss'] - loss) / loss:.2e}")
    assert abs(row["loss"] - loss) <= 1e-9 * loss, (row["loss"], loss)
    margin = (chosen - rejected).mean().item()
    assert abs(row["dpo_margin"] - margin) <= 1e-9 * abs(margin), (row["dpo_margin"], margin)
    assert row["dpo_accuracy"] == (chosen > rejected).double().mean().item()


def test_a_short_run_on_the_shipped_pairs_raises_the_margin(tmp_path):
    rows = train(tmp_path, 1, ["--config", str(ROOT / "train_configs" / "debug_model.toml"),
                               *DPO, "--lora.target_modules", "wq,wv,wo,w1,w2,output",
                               "--training.steps", "12", "--training.local_batch_size", "8",
                               "--data.seq_len", "32", "--optimizer.lr", "1e-2",
                               "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
                               "--metrics.enable_tensorboard", "false",
                               "--validation.enable", "false"])
    assert [r["step"] for r in rows] == list(range(1, 13))
    for r in rows:
        assert set(METRICS) <= r.keys()
        assert r["dpo_margin"] == pytest.approx(r["dpo_chosen_reward"] - r["dpo_rejected_reward"])
    first, last = rows[0], rows[-1]
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)  # fresh adapters: the base
    assert first["dpo_margin"] == 0
    print(f"margin: step 1 {first['dpo_margin']!r}, step {last['step']} {last['dpo_margin']!r}; "
          f"loss {first['loss']:.4f} -> {last['loss']:.4f}")
    assert last["dpo_margin"] > first["dpo_margin"] and last["loss"] < first["loss"]


BAD = [
    (["--training.objective", "dpo", "--model.converters", "lora"],
     "training.objective='dpo': it learns from pairs; set data.format='preference' "
     "(it is 'text')"),
    (["--data.format", "preference", "--data.dataset", PAIRS],
     "data.format='preference': pairs train only with training.objective='dpo' (it is 'lm')"),
    ([*DPO, "--dpo.beta", "0"], "dpo.beta=0.0: out of range; allowed: > 0"),
    ([*DPO, "--dpo.beta", "-1"], "dpo.beta=-1.0: out of range; allowed: > 0"),
    ([*DPO, "--data.columns", "chosen=good"],
     "data.columns='chosen=good' with data.format='preference': pairs are read by their own "
     "fields (prompt, chosen, rejected); allowed: ''"),
    ([*DPO, "--data.sft_packing", "true"],
     "data.sft_packing=true with training.objective='dpo': each answer of a pair is its own "
     "padded sequence; allowed: false"),
    ([*DPO, "--parallelism.pipeline_parallel_degree", "2"],
     "parallelism.pipeline_parallel_degree=2 with training.objective='dpo': a pair's answers "
     "and their log-probabilities must stay on one rank; allowed: 1"),
    ([*DPO, "--parallelism.context_parallel_degree", "2"],
     "parallelism.context_parallel_degree=2 with training.objective='dpo': a pair's answers "
     "and their log-probabilities must stay on one rank; allowed: 1"),
    ([*DPO, "--data.dataset", str(ROOT / "tests" / "data" / "sft_tiny.jsonl")],
     f"data.dataset={str(ROOT / 'tests' / 'data' / 'sft_tiny.jsonl')!r}: dataset "
     f"{str(ROOT / 'tests' / 'data' / 'sft_tiny.jsonl')!r} has no preference fields 'chosen' "
     f"and 'rejected' (and 'prompt'); its columns are ['prompt', 'response']"),
]


@pytest.mark.parametrize("argv,line", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_refused_in_one_line_before_any_process_group(argv, line, monkeypatch,
                                                                   capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_argv(["--validate", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"error: {line}"


def test_a_row_without_its_rejected_answer_is_refused_before_training(tmp_path, capsys):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3 + [{"prompt": "p",
                                                                      "chosen": "a"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    argv = ["--config", str(ROOT / "train_configs" / "debug_model.toml"), *DPO,
            "--data.dataset", path, "--data.seq_len", "16", "--job.dump_folder",
            str(tmp_path / "out")]
    assert run_argv(argv, rank=0, world_size=1) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data.dataset={path!r}: dataset {path!r}, row 3 (from 0): expected string "
        f"fields 'prompt', 'chosen' and 'rejected'; or 'chosen' and 'rejected' as lists of "
        f"{{'role', 'content'}} messages, with an optional 'prompt' (a string, or messages) "
        f"before both; the row has fields ['chosen', 'prompt']")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_inspect_data_shows_each_pairs_chosen_then_rejected_sequence(capsys):
    from composer.tools.inspect_data import main
    assert main(["--data.format", "preference", "--data.dataset", PAIRS,
                 "--training.objective", "dpo", "--rows", "2", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    first = json.loads(open(PAIRS).readline())
    chosen, rejected = pair_tokens(first, ByteTokenizer())
    assert [(e["tokens"], e["learn"]) for e in shown] == [chosen, rejected]


def test_qlora_trains_dpo_against_its_nf4_base(tmp_path):
    """QLoRA's reference is LoRA's (its adapters off): the NF4 base; fresh adapters
    make step 1 the base itself, and the adapters then move the policy off it."""
    rows = train(tmp_path, 1, ["--config", str(ROOT / "train_configs" / "debug_model.toml"),
                               *DPO, "--model.converters", "qlora", "--model.flavor", "debug256",
                               "--lora.target_modules", "wq,wv,wo,w1,w2", "--training.steps", "2",
                               "--training.local_batch_size", "4", "--data.seq_len", "32",
                               "--optimizer.lr", "1e-2", "--metrics.log_freq", "1",
                               "--metrics.enable_tensorboard", "false",
                               "--validation.enable", "false"])
    assert rows[0]["dpo_margin"] == 0 and rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert rows[1]["dpo_chosen_reward"] != 0 and rows[1]["dpo_rejected_reward"] != 0
