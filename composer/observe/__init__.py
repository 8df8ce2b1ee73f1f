"""Observability: the observers the trainer calls through one interface
(``base``): router statistics, communication counts, memory by category, the
step's anatomy (where its time goes, the slowest rank), the run record, the
profiler, samples at each validation, and the metrics logger (throughput; the log
line, metrics.jsonl and TensorBoard)."""
from composer.observe.anatomy import anatomy_observer
from composer.observe.base import OBSERVERS, Observer, RunView, StepInfo, register_observer
from composer.observe.comm import comm_observer
from composer.observe.memory import memory_observer
from composer.observe.metrics import metrics_observer
from composer.observe.profile import profile_observer
from composer.observe.record import record_observer
from composer.observe.router import router_observer
from composer.observe.samples import samples_observer

# registration order is row order: the run record (written first), router
# statistics, communication, memory, the step's anatomy, the profiler, validation
# samples; the metrics logger last, so its throughput window closes after theirs
for _factory in (record_observer, router_observer, comm_observer, memory_observer,
                 anatomy_observer, profile_observer, samples_observer, metrics_observer):
    register_observer(_factory)

__all__ = ["OBSERVERS", "Observer", "RunView", "StepInfo", "register_observer"]
