"""Text from a trained model, on the job's own layout.

    python -m composer.tools.generate --config F [overrides] --checkpoint STEP_OR_HF_FOLDER
        (--prompt TEXT | --chat JSON) [--max-new-tokens N] [--temperature T] [--top-p P]
        [--json]
    torchrun --nproc_per_node=2 -m composer.tools.generate ... \\
        --parallelism.tensor_parallel_degree 2

The config and overrides are training's: they name the model, the tokenizer (and its
chat template) and the layout (data parallel, FSDP, tensor parallel; not pipeline or
context parallel). ``--checkpoint``: a DCP step of a run (or its checkpoint folder: the
newest complete step; with LoRA the step holds the adapters, the base weights come from
the config as in training) or a Hugging Face folder. ``--prompt``: text, tokenized
as it is after the tokenizer's bos; ``--chat``: a JSON list of ``{"role", "content"}``
messages (or the path of a file holding one), rendered by the same chat template
training uses, with the assistant's turn opened. ``--temperature 0`` (the default) is
greedy; otherwise tokens are drawn from the softmax at that temperature, cut to its
``--top-p`` nucleus, seeded by ``job.seed``. Generation ends after ``--max-new-tokens``
(default 64) or at the tokenizer's eos. A KV cache keeps each step one token long.

Plain output is the new text; ``--json`` prints ``{"tokens": [...], "text": ...}``, the
generated ids only. Logs go to stderr; bad input is one line and exit 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from composer.config import ConfigError
from composer.data.sft import chat_prompt
from composer.inference.decode import Decoder
from composer.job.data import max_seq_len
from composer.job.plan import Plan
from composer.tools.common import loaded_model, number, plan_answering, start, take_options

# option -> its default (None: no default)
OPTIONS = {"--checkpoint": None, "--prompt": None, "--chat": None, "--max-new-tokens": "64",
           "--temperature": "0", "--top-p": "1"}


def prompt_tokens(options: dict, tokenizer) -> list[int]:
    """The prompt's tokens: ``--prompt`` after the bos, or ``--chat`` through the template."""
    prompt, chat = options["--prompt"], options["--chat"]
    if (prompt is None) == (chat is None):
        raise ConfigError("give one of --prompt TEXT and --chat JSON")
    if prompt is not None:
        return ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(prompt)
    text = Path(chat).read_text() if Path(chat).is_file() else chat
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--chat: not JSON ({e}); allowed: a list of {{\"role\": ..., "
                          f"\"content\": ...}} messages, or the path of a file holding one")
    if not isinstance(messages, list):
        raise ConfigError("--chat: allowed: a JSON list of {\"role\": ..., \"content\": ...}")
    try:
        return chat_prompt(messages, tokenizer)
    except ValueError as e:
        raise ConfigError(f"--chat: {e}") from None


def plan_generation(argv: list[str], options: dict, rank: int, world_size: int
                    ) -> tuple[Plan, list[int], dict]:
    """The checked job, prompt and sampling settings; ConfigError for bad input."""
    settings = {"max_new_tokens": number(options, "--max-new-tokens", int, 1),
                "temperature": number(options, "--temperature", float, 0),
                "top_p": number(options, "--top-p", float, 0, 1, above=True)}
    plan, step = plan_answering(argv, options["--checkpoint"], rank, world_size)
    prompt = prompt_tokens(options, plan.tokenizer)
    limit = max_seq_len(plan.args)
    if limit is not None and len(prompt) + settings["max_new_tokens"] > limit:
        raise ConfigError(f"--max-new-tokens {settings['max_new_tokens']}: with the prompt's "
                          f"{len(prompt)} tokens it passes the model's {limit} positions; "
                          f"allowed: 1..{limit - len(prompt)}")
    return plan, prompt, {**settings, "step": step}


def generate(plan: Plan, prompt: list[int], settings: dict, world_size: int) -> list[int]:
    """The generated ids: the model built on the plan's layout, its weights loaded."""
    with loaded_model(plan, settings["step"], world_size) as model:
        decoder = Decoder(model, plan.spec, plan.device, max_seq_len(plan.args),
                          seed=plan.cfg.job.seed)
        stop = set() if plan.tokenizer.eos_id is None else {plan.tokenizer.eos_id}
        return decoder.generate(prompt, settings["max_new_tokens"], settings["temperature"],
                                settings["top_p"], stop)


def main(argv: list[str] | None = None) -> int:
    started = start(argv, __doc__, ("--json",))
    if started is None:
        return 0
    argv, flags, rank, world_size = started
    try:
        plan, prompt, settings = plan_generation(argv, take_options(argv, OPTIONS), rank,
                                                 world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    tokens = generate(plan, prompt, settings, world_size)
    if rank == 0:
        text = plan.tokenizer.decode(tokens)
        print(json.dumps({"tokens": tokens, "text": text}, ensure_ascii=False) if flags["--json"]
              else text)
    return 0


def cli() -> None:
    """The console script ``composer-generate``."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
