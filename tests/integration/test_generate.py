"""Generation (``composer.tools.generate``, ``composer.inference.decode``), with transformers as
the reference: greedy decoding with composer's KV cache gives transformers'
``generate(do_sample=False)`` token for token (float64, 32 new tokens and more), from a
DCP step of a built-in Llama in one process and under tensor parallel x2, and from
Hugging Face folders through the HF-backed family: Mistral (a sliding window shorter
than the text) and Gemma2 (soft-capped attention and logits, windows on alternate
layers, a tied head), whose cores take the cached keys through other code paths."""
from __future__ import annotations

import json

import pytest
import torch

from composer.cli.run import run_argv
from composer.inference.decode import Decoder, pick
from composer.testing.harness import ROOT, launch
from composer.tools import generate
from tests.support.hf_folders import make

transformers = pytest.importorskip("transformers")

CONFIG = ["--config", str(ROOT / "train_configs" / "debug_model.toml"), "--training.dtype",
          "float64"]
PROMPT = "ROMEO: Is the day so young?"
NEW = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DCP step of the debug Llama after 2 steps, and the same weights as a Hugging
    Face folder (float64)."""
    folder = tmp_path_factory.mktemp("gen")
    assert run_argv([*CONFIG, "--job.dump_folder", str(folder), "--training.steps", "2",
                     "--data.seq_len", "64", "--training.local_batch_size", "2",
                     "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                     "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype",
                     "float64", "--metrics.enable_tensorboard", "false",
                     "--validation.enable", "false"]) == 0
    return folder / "checkpoint" / "step-2", folder / "checkpoint" / "step-2-hf"


def transformers_greedy(folder, prompt: list[int], new: int = NEW) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    out = model.eval().generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                                eos_token_id=257, pad_token_id=257, attention_mask=None)
    return out[0, len(prompt):].tolist()


def ours(capsys, *argv: str) -> dict:
    assert generate.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def byte_prompt(text: str = PROMPT) -> list[int]:
    return [256, *text.encode()]


def test_greedy_from_a_dcp_step_is_transformers_generate(trained, capsys):
    step, hf = trained
    got = ours(capsys, *CONFIG, "--checkpoint", str(step), "--prompt", PROMPT,
               "--max-new-tokens", str(NEW))
    expected = transformers_greedy(hf, byte_prompt())
    assert got["tokens"] == expected and len(expected) == NEW
    assert len(set(expected)) > 3  # a sequence, not one token repeated
    assert got["text"] == bytes(t for t in expected if t < 256).decode(errors="replace")


@pytest.mark.slow
def test_greedy_under_tensor_parallel_is_the_same(trained):
    step, hf = trained
    result = launch([*CONFIG, "--parallelism.tensor_parallel_degree", "2", "--checkpoint",
                     str(step), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--json"],
                    nproc=2, program="composer.tools.generate")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["tokens"] == \
        transformers_greedy(hf, byte_prompt())


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_greedy_through_the_hf_family_is_transformers_generate(tmp_path, arch, capsys):
    folder = make(arch, tmp_path / arch)
    got = ours(capsys, *CONFIG, "--model.name", "hf", "--model.hf_path", str(folder),
               "--checkpoint", str(folder), "--prompt", PROMPT, "--max-new-tokens", "32")
    assert got["tokens"] == transformers_greedy(folder, byte_prompt(), 32)


def test_sampling_is_seeded_and_a_tiny_nucleus_is_greedy():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    draws = [pick(logits, 1.0, 1.0, torch.Generator().manual_seed(s)) for s in range(20)]
    assert draws == [pick(logits, 1.0, 1.0, torch.Generator().manual_seed(s))
                     for s in range(20)]
    assert len(set(draws)) > 5
    assert pick(logits, 0.7, 1e-9, torch.Generator()) == int(logits.argmax())
    # top-p keeps the fewest most likely tokens reaching p: here the best two
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).log()
    kept = {pick(probs, 1.0, 0.75, torch.Generator().manual_seed(s)) for s in range(200)}
    assert kept == {0, 1}


def test_the_decoder_without_a_cache_gives_the_same_tokens(trained):
    """The path of sequence and context parallel (whole sequences padded to a width)."""
    from composer.config import parse_args
    from composer.inference.decode import load_weights
    from composer.job.plan import plan_job
    from composer.trainer.build import build_model
    step, _ = trained
    cfg, _ = parse_args([*CONFIG, "--data.seq_len", "128"])
    plan = plan_job(cfg, 0, 1)
    parts = build_model(plan)
    load_weights(plan, parts, step)
    model = parts[0].eval()
    cached = Decoder(model, plan.spec, plan.device).generate(byte_prompt(), 24)
    assert Decoder(model, plan.spec, plan.device, pad_to=128).generate(byte_prompt(), 24) == \
        cached


def test_bad_generation_input_is_one_line(trained, capsys):
    step, _ = trained
    base = [*CONFIG, "--checkpoint", str(step)]
    cases = {
        (): "error: give one of --prompt TEXT and --chat JSON",
        ("--prompt", "a", "--temperature", "-1"):
            "error: --temperature -1: allowed: a number in [0, inf]",
        ("--prompt", "a", "--top-p", "0"): "error: --top-p 0: allowed: a number in (0, 1]",
        ("--chat", "[{\"role\": \"robot\", \"content\": \"hi\"}]"):
            "error: --chat: message 0 is {'role': 'robot', 'content': 'hi'}; expected "
            "{'role': 'system' | 'user' | 'assistant', 'content': str}",
        ("--prompt", "a", "--max-new-tokens", "5000"):
            "error: --max-new-tokens 5000: with the prompt's 2 tokens it passes the model's "
            "2048 positions; allowed: 1..2046",
        ("--prompt", "a", "--parallelism.pipeline_parallel_degree", "2"):
            "error: parallelism.pipeline_parallel_degree=2: generation runs the whole model "
            "on whole sequences; allowed: 1",
    }
    for extra, line in cases.items():
        assert generate.main([*base, *extra]) == 2, extra
        assert capsys.readouterr().err.strip().splitlines()[-1] == line
    assert generate.main([*CONFIG, "--checkpoint", str(step.parent.parent), "--prompt", "a"]) \
        == 2
    assert "not a Hugging Face folder (config.json), a complete DCP step" in \
        capsys.readouterr().err


def test_validation_samples_are_checked_at_start(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    samples = ["--validation.generate", "ROMEO:", "--data.seq_len", "32"]
    cases = {
        ("--validation.generate_tokens", "30"):
            "error: validation.generate_tokens=30: with the longest prompt's 7 tokens it passes "
            "data.seq_len=32; allowed: 1..25",
        ("--parallelism.pipeline_parallel_degree", "2"):
            "error: validation.generate=['ROMEO:']: samples need the whole model in one part; "
            "allowed with parallelism.pipeline_parallel_degree=1",
    }
    for extra, line in cases.items():
        assert run_argv([*CONFIG, *samples, "--validate", *extra]) == 2, extra
        assert capsys.readouterr().err.strip() == line
