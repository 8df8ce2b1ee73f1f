"""Observability: the observers the trainer calls through one interface
(``base``): router statistics, communication counts, memory by category, the
step's anatomy (where its time goes, the slowest rank), the run record, the
profiler, samples at each validation, lm-eval tasks, the metrics logger (throughput; the log
line, metrics.jsonl and TensorBoard) and the experiment trackers (W&B, MLflow).

Imports: torch_compat, spec, config, mesh, models, data, parallel, checkpoint,
converters, faults, inference, job.
"""
from composer.observe.anatomy import anatomy_observer
from composer.observe.base import OBSERVERS, Observer, RunView, StepInfo, register_observer
from composer.observe.comm import comm_observer
from composer.observe.evals import EvalConfig, eval_observer
from composer.observe.memory import memory_observer
from composer.observe.metrics import metrics_observer
from composer.observe.mlflow_log import mlflow_observer
from composer.observe.profile import profile_observer
from composer.observe.record import record_observer
from composer.observe.router import router_observer
from composer.observe.samples import samples_observer
from composer.observe.wandb_log import wandb_observer

# registration order is row order: the run record (written first), router
# statistics, communication, memory, the step's anatomy, the profiler, validation
# samples, lm-eval's tasks, the experiment trackers (W&B, MLflow); the metrics logger
# last, so its throughput window closes after theirs and opens after their start-up
for _factory, _section in ((record_observer, None), (router_observer, None),
                           (comm_observer, None), (memory_observer, None),
                           (anatomy_observer, None), (profile_observer, None),
                           (samples_observer, None), (eval_observer, ("eval", EvalConfig)),
                           (wandb_observer, None), (mlflow_observer, None),
                           (metrics_observer, None)):
    register_observer(_factory, _section)

__all__ = ["OBSERVERS", "Observer", "RunView", "StepInfo", "register_observer"]
