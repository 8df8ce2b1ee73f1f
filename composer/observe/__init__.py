"""Observability: the observers the trainer calls through one interface
(``base``): router statistics, communication counts, memory by category, and
the metrics logger (throughput; the log line, metrics.jsonl and TensorBoard)."""
from composer.observe.base import OBSERVERS, Observer, StepInfo, register_observer
from composer.observe.comm import comm_observer
from composer.observe.memory import memory_observer
from composer.observe.metrics import metrics_observer
from composer.observe.router import router_observer

# registration order is row order: router statistics, communication, memory;
# the metrics logger last, so its throughput window closes after theirs
for _factory in (router_observer, comm_observer, memory_observer, metrics_observer):
    register_observer(_factory)

__all__ = ["OBSERVERS", "Observer", "StepInfo", "register_observer"]
