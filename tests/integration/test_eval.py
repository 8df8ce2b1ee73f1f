"""lm-eval on composer's model (``composer/inference/lm_eval.py``, ``composer.tools.eval``), with
lm-eval's own ``hf`` backend on the exported folder as the reference: on a DCP step of a
Llama sharded by FSDP over 2 ranks, every request's log-likelihood (multiple choice,
rolling perplexity) equals the hf backend's to 1e-9 (float64), greedy generations are
the same text, and so every metric is the same number. Local tasks in lm-eval's YAML
format (``tests/data/eval``) on a shipped JSON-lines file: no hub."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from composer.cli.run import run_argv
from composer.models import llama
from composer.models.common.rotary import rope_inv_freq
from composer.testing.harness import ROOT, launch, read_metrics
from composer.tools import eval as eval_tool
from tests.integration.test_hf import lift_float32
from tests.unit.test_chat import TEMPLATES, write_tokenizer

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

TASKS = "composer_tiny_qa,composer_tiny_gen,composer_tiny_text"
INCLUDE = str(ROOT / "tests" / "data" / "eval")
CONFIG = ["--config", str(ROOT / "train_configs" / "debug_model.toml"), "--training.dtype",
          "float64"]
EVAL = ["--eval.tasks", "composer_tiny_qa", "--eval.include_path", INCLUDE]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DCP step of the debug Llama after 2 steps with a BPE tokenizer, its folder as
    Hugging Face weights (float64, with the tokenizer) and the run's dump folder, which
    evaluated the step in training (``eval.*``)."""
    folder = tmp_path_factory.mktemp("eval")
    tokenizer = write_tokenizer(folder / "tokenizer", TEMPLATES["chatml"])
    argv = [*CONFIG, "--data.tokenizer", str(tokenizer), "--job.dump_folder", str(folder / "run"),
            "--training.steps", "2", "--data.seq_len", "64", "--training.local_batch_size", "2",
            "--checkpoint.enable", "true", "--checkpoint.interval", "2",
            "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float64",
            "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
            "--metrics.log_freq", "1", *EVAL, "--eval.freq", "2", "--eval.limit", "4"]
    assert run_argv(argv) == 0
    steps = folder / "run" / "checkpoint"
    return steps / "step-2", steps / "step-2-hf", tokenizer, folder / "run"


def hf_backend(folder):
    """lm-eval's hf backend on the folder, its transformers model computing its norms and
    rotary tables in float64 (transformers keeps them in float32 even in a float64
    model: about 1e-9 of a log-likelihood here), so what differs is the arithmetic."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    lift_float32(model, rope_inv_freq(llama.flavors["debug"]))
    return HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(folder), device="cpu",
                dtype=torch.float64)


def by_doc(results: dict) -> dict[str, list[dict]]:
    return {task: sorted(samples, key=lambda s: s["doc_id"])
            for task, samples in results["samples"].items()}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


@pytest.mark.slow
def test_sharded_composer_scores_every_request_as_lm_evals_hf_backend(trained, monkeypatch):
    step, hf, tokenizer, _ = trained
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository
    result = launch([*CONFIG, "--data.tokenizer", str(tokenizer), "--checkpoint", str(step),
                     "--tasks", TASKS, "--include-path", INCLUDE, "--json", "--log-samples"],
                    nproc=2, program="composer.tools.eval")
    assert result.returncode == 0, result.stderr[-3000:]
    ours = json.loads(result.stdout.strip().splitlines()[-1])
    theirs = lm_eval.simple_evaluate(model=hf_backend(hf), tasks=TASKS.split(","),
                                     log_samples=True, bootstrap_iters=0,
                                     task_manager=TaskManager(include_path=INCLUDE))
    ours_docs, their_docs = by_doc(ours), by_doc(theirs)
    worst = 0.0
    for task in TASKS.split(","):
        assert [s["doc_id"] for s in ours_docs[task]] == list(range(8))  # both ranks' shares
        for mine, reference in zip(ours_docs[task], their_docs[task], strict=True):
            assert mine["arguments"] == json.loads(json.dumps(reference["arguments"])), task
            for got, expected in zip(mine["resps"], reference["resps"], strict=True):
                if task == "composer_tiny_gen":  # [text]
                    assert got == expected, (task, mine["doc_id"])
                    continue
                got, expected = got[0], expected[0]
                if task == "composer_tiny_qa":  # [(loglikelihood, is_greedy)]
                    assert got[1] == expected[1]
                    got, expected = got[0], expected[0]
                worst = max(worst, relative(float(got), float(expected)))
        for metric, value in theirs["results"][task].items():
            if metric == "alias":
                continue
            # counts of right answers are equal; a perplexity, the exp of a sum of
            # log-likelihoods, to its float64 arithmetic
            mine = ours["results"][task][metric]
            exact = isinstance(value, str) or metric.startswith(("acc", "exact_match"))
            assert mine == value if exact else relative(mine, value) <= 1e-12, \
                (task, metric, mine, value)
    assert worst <= 1e-9, worst
    print(f"worst relative difference of a log-likelihood: {worst:.1e}; composer / hf:",
          {task: {k: (ours["results"][task][k], v) for k, v in theirs["results"][task].items()
                  if isinstance(v, float)} for task in TASKS.split(",")})
    generated = [s["resps"][0][0] for s in ours_docs["composer_tiny_gen"]]
    assert any(generated), generated  # something was written before a stop


def test_evaluation_during_training_writes_rows_and_files(trained, capsys, monkeypatch):
    """``eval.*``: lm-eval's results of the step in its row and in eval/step-N.json, the
    same as the tool's on that step's checkpoint."""
    step, _, tokenizer, run = trained
    rows = read_metrics(run)
    saved = json.loads((run / "eval" / "step-2.json").read_text())
    acc = saved["results"]["composer_tiny_qa"]["acc,none"]
    assert rows[-1]["step"] == 2 and rows[-1]["eval/composer_tiny_qa/acc"] == acc
    assert "eval/composer_tiny_qa/acc" not in rows[0]  # eval.freq 2
    monkeypatch.chdir(ROOT)
    assert eval_tool.main([*CONFIG, "--data.tokenizer", str(tokenizer), "--checkpoint",
                           str(step), "--tasks", "composer_tiny_qa", "--include-path", INCLUDE,
                           "--limit", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"]["composer_tiny_qa"]["acc,none"] == acc


def test_bad_evaluation_input_is_one_line(trained, capsys, monkeypatch):
    step, _, tokenizer, _ = trained
    base = [*CONFIG, "--data.tokenizer", str(tokenizer), "--checkpoint", str(step)]
    cases = {
        ("--tasks", "composer_tiny_qa", "--include-path", INCLUDE, "--limit", "0"):
            "error: --limit 0: allowed: a whole number in [1, inf]",
        ("--include-path", INCLUDE): "error: --tasks: allowed: lm-eval task names, "
                                     "comma-separated",
    }
    for extra, line in cases.items():
        assert eval_tool.main([*base, *extra]) == 2, extra
        assert capsys.readouterr().err.strip().splitlines()[-1] == line
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_argv([*CONFIG, "--validate", *EVAL, "--parallelism.pipeline_parallel_degree",
                     "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: eval.tasks=['composer_tiny_qa']: lm-eval runs the whole model in one part; "
        "allowed with parallelism.pipeline_parallel_degree=1")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # a machine without lm-eval
    assert run_argv([*CONFIG, "--validate", *EVAL]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: eval.tasks=['composer_tiny_qa']: lm-eval is not installed: "
        "pip install 'composer-parallel[eval]'")
    assert eval_tool.main([*base, "--tasks", "composer_tiny_qa"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: evaluation with lm-eval needs the lm-eval package: "
        "pip install 'composer-parallel[eval]'")


@pytest.mark.slow
def test_a_task_lm_eval_does_not_know_is_one_line(trained, capsys):
    """(lm-eval indexes its thousands of tasks to find one that is not in the folder)"""
    step, _, tokenizer, _ = trained
    assert eval_tool.main([*CONFIG, "--data.tokenizer", str(tokenizer), "--checkpoint", str(step),
                           "--tasks", "no_such_task", "--include-path", INCLUDE]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --tasks: 'no_such_task' is no lm-eval task (nor in {INCLUDE})")


def test_an_evaluation_leaves_the_runs_random_stream_where_it_was(monkeypatch):
    """lm-eval seeds the global generators; a run that evaluates draws after it what it
    would have drawn without."""
    import random

    import numpy

    from composer.config import parse_args
    from composer.inference.decode import Decoder
    from composer.inference.lm_eval import ComposerLM, evaluate
    from composer.job.plan import plan_job
    from composer.trainer.build import build_model
    monkeypatch.chdir(ROOT)
    plan = plan_job(parse_args([*CONFIG, "--data.seq_len", "32"])[0], 0, 1)
    model = build_model(plan)[0]
    lm = ComposerLM(Decoder(model, plan.spec, plan.device), plan.tokenizer, 32)
    torch.manual_seed(5), random.seed(5), numpy.random.seed(5)
    expected = torch.rand(3), random.random(), numpy.random.rand()
    torch.manual_seed(5), random.seed(5), numpy.random.seed(5)
    results = evaluate(lm, ["composer_tiny_text"], INCLUDE, limit=2)
    assert results["results"]["composer_tiny_text"]["word_perplexity,none"] > 1
    assert model.training  # back in training mode
    drawn = torch.rand(3), random.random(), numpy.random.rand()
    assert torch.equal(drawn[0], expected[0]) and drawn[1:] == expected[1:]
