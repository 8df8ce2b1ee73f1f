"""lm-eval tasks on a trained model, on the job's own layout, without a Hugging Face export.

    python -m composer.tools.eval --config F [overrides] --checkpoint STEP --tasks T[,T2]
        [--include-path DIR] [--limit N] [--json] [--log-samples]
    torchrun --nproc_per_node=2 -m composer.tools.eval ...   # FSDP2 over 2 ranks

The config and overrides are training's (model, tokenizer, layout: data parallel, FSDP,
tensor parallel); ``--checkpoint`` a DCP step (or a checkpoint folder: its newest
complete one) or a Hugging Face folder, as for ``composer.tools.generate``. ``--tasks``:
lm-eval task names, found among lm-eval's own and in ``--include-path`` (a folder of
task YAML files); ``--limit``: the first N documents of each. Under data parallel each
data-parallel rank takes its share of the documents (``composer/inference/lm_eval.py``).

Plain output is lm-eval's table; ``--json`` prints lm-eval's results dict (with
``--log-samples``, each document's requests and responses under ``samples``). Needs
``pip install 'composer-parallel[eval]'``; bad input is one line and exit 2.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

from composer.config import ConfigError
from composer.inference.decode import Decoder
from composer.job.data import max_seq_len
from composer.job.plan import Plan
from composer.tools.common import loaded_model, number, plan_answering, start, take_options

OPTIONS = {"--checkpoint": None, "--tasks": None, "--include-path": None, "--limit": None}
EXTRA = "pip install 'composer-parallel[eval]'"


def check_tasks(tasks: str | None, include_path: str | None) -> list[str]:
    """The task names, each known to lm-eval; ConfigError naming the first that is not."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"evaluation with lm-eval needs the lm-eval package: {EXTRA}")
    if not tasks:
        raise ConfigError("--tasks: allowed: lm-eval task names, comma-separated")
    if include_path is not None and not os.path.isdir(include_path):
        raise ConfigError(f"--include-path {include_path}: no such folder")
    from composer.inference.lm_eval import task_manager
    names = tuple(t.strip() for t in tasks.split(",") if t.strip())
    try:
        task_manager(names, include_path)
    except ValueError as e:
        raise ConfigError(f"--tasks: {e}") from None
    return list(names)


def language_model(plan: Plan, model):
    """lm-eval's view of ``model`` on the plan's layout."""
    from composer.inference.lm_eval import ComposerLM
    dims = plan.dims
    decoder = Decoder(model, plan.spec, plan.device, max_seq_len(plan.args))
    group = dims.mesh("dp").get_group() if dims.dp > 1 else None
    return ComposerLM(decoder, plan.tokenizer, max_seq_len(plan.args) or plan.cfg.data.seq_len,
                      group)


def main(argv: list[str] | None = None) -> int:
    started = start(argv, __doc__, ("--json", "--log-samples"))
    if started is None:
        return 0
    argv, flags, rank, world_size = started
    try:
        options = take_options(argv, OPTIONS)
        tasks = check_tasks(options["--tasks"], options["--include-path"])
        limit = None if options["--limit"] is None else number(options, "--limit", int, 1)
        plan, step = plan_answering(argv, options["--checkpoint"], rank, world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    from composer.inference.lm_eval import evaluate
    with loaded_model(plan, step, world_size) as model:
        results = evaluate(language_model(plan, model), tasks, options["--include-path"], limit,
                           flags["--log-samples"])
    if rank == 0:
        if flags["--json"]:
            print(json.dumps(results, default=str, ensure_ascii=False))
        else:
            from lm_eval.utils import make_table
            print(make_table(results))
    return 0


def cli() -> None:
    """The console script ``composer-eval``."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
