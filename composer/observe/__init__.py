"""Observability: the metrics line, jsonl and TensorBoard (``metrics``), and the
observers the trainer calls through one interface (``base``): memory by
category, communication counts, router statistics."""
from composer.observe.base import OBSERVERS, Observer, StepInfo, register_observer
from composer.observe.comm import comm_observer
from composer.observe.memory import memory_observer
from composer.observe.router import router_observer

# registration order is row order: router statistics, communication, memory
for _factory in (router_observer, comm_observer, memory_observer):
    register_observer(_factory)

__all__ = ["OBSERVERS", "Observer", "StepInfo", "register_observer"]
