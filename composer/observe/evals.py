"""lm-eval tasks during training (the ``[eval]`` section): every ``eval.freq`` steps and
at the last, the model as it is laid out runs lm-eval's tasks (``composer/inference/lm_eval.py``,
no export), its metrics go into the step's row as ``eval/<task>/<metric>`` and lm-eval's
whole results dict into ``<dump folder>/eval/step-N.json``. The model's length for
lm-eval is the training window, ``data.seq_len``, on every layout (requests are cut on
the left to it, as lm-eval's hf backend cuts them to a model's length)."""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from composer.config import ConfigError
from composer.config.schema import bounded
from composer.inference.decode import Decoder
from composer.job.data import max_seq_len
from composer.observe.base import Observer, StepInfo

log = logging.getLogger("composer")

EXTRA = "pip install 'composer-parallel[eval]'"


@dataclass
class EvalConfig:
    """lm-eval tasks run on the model during training."""

    tasks: list = field(default_factory=list, metadata={
        "help": "lm-eval task names run on the model during training (empty: none)"})
    freq: int = bounded(500, 1, help="every this many steps, and at the last; a multiple of "
                                     "metrics.log_freq, so that each evaluation is logged")
    include_path: str = field(default="", metadata={
        "help": "a folder of lm-eval task YAML files, besides lm-eval's own tasks"})
    limit: int = bounded(0, 0, help="the first N documents of each task (0: all of them)")

    def check(self, cfg, dims) -> None:
        """Checked with the rest of the job, before any process group."""
        if not self.tasks:
            return
        if importlib.util.find_spec("lm_eval") is None:
            raise ConfigError(f"eval.tasks={self.tasks!r}: lm-eval is not installed: {EXTRA}")
        if dims.pp > 1:
            raise ConfigError(f"eval.tasks={self.tasks!r}: lm-eval runs the whole model in one "
                              f"part; allowed with parallelism.pipeline_parallel_degree=1")
        if self.freq % cfg.metrics.log_freq:
            raise ConfigError(f"eval.freq={self.freq}: allowed: a multiple of "
                              f"metrics.log_freq={cfg.metrics.log_freq}, so that each "
                              f"evaluation's row is logged")
        if self.include_path and not Path(self.include_path).is_dir():
            raise ConfigError(f"eval.include_path={self.include_path!r}: no such folder")
        from composer.inference.lm_eval import task_manager
        try:
            task_manager(tuple(self.tasks), self.include_path or None)
        except ValueError as e:
            raise ConfigError(f"eval.tasks={self.tasks!r}: {e}") from None


class Evaluations(Observer):
    def __init__(self, view, config: EvalConfig):
        from composer.inference.lm_eval import ComposerLM
        plan, cfg = view.plan, view.cfg
        p, width = cfg.parallelism, cfg.data.seq_len
        whole_windows = (p.sequence_parallel and plan.dims.tp > 1) or plan.dims.cp > 1 or \
            cfg.compile.enable
        cp_group = plan.dims.mesh("cp").get_group() if plan.dims.cp > 1 else None
        decoder = Decoder(view.parts[0], plan.spec, plan.device, max_seq_len(plan.args),
                          pad_to=width if whole_windows else None, cp_group=cp_group)
        group = plan.dims.mesh("dp").get_group() if plan.dims.dp > 1 else None
        # the training window on every layout, so that each scores the same tokens
        self.lm = ComposerLM(decoder, plan.tokenizer, width, group)
        self.view, self.config = view, config
        self.folder = Path(cfg.job.dump_folder) / "eval"

    def row(self, info: StepInfo) -> dict:
        c = self.config
        if info.step % c.freq and info.step != self.view.cfg.training.steps:
            return {}
        from composer.inference.lm_eval import evaluate
        results = evaluate(self.lm, c.tasks, c.include_path or None, c.limit or None)
        if self.view.plan.rank != 0:
            return {}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"step-{info.step}.json").write_text(
            json.dumps(results, default=str, ensure_ascii=False, indent=1))
        return {f"eval/{task}/{key.split(',')[0]}": value
                for task, metrics in results["results"].items()
                for key, value in metrics.items() if isinstance(value, (int, float))
                and not isinstance(value, bool) and "_stderr" not in key}


def eval_observer(view, config: EvalConfig) -> Evaluations | None:
    if not config.tasks:
        return None
    return Evaluations(view, config)
