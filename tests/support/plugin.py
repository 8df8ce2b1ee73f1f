"""A plugin from outside ``composer/``: a converter with a config section of its own
(``[frozen_embedding]``) and observers, registered through the public interfaces
when this module is imported, as ``job.plugins = ["tests.support.plugin"]`` does:

    torchrun --nproc_per_node=2 -m composer.train --job.plugins tests.support.plugin ...
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from composer import ModelSpec, register_model
from composer.converters import Converter, register_converter
from composer.observe import Observer, StepInfo, register_observer


@dataclass
class FrozenEmbeddingConfig:
    """The ``[frozen_embedding]`` section."""

    record: str = field(default="hooks", metadata={
        "help": "the hook log: <job.dump_folder>/<record>-rank<R>.txt"})


class FrozenEmbedding(Converter):
    """Keeps the token embedding out of training; logs each hook it is asked."""

    section = ("frozen_embedding", FrozenEmbeddingConfig)

    def record(self, line: str) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        folder = Path(self.cfg.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{self.config.record}-rank{rank}.txt", "a") as f:
            f.write(line + "\n")

    def check(self, meta: nn.Module) -> None:
        if not hasattr(meta, "tok_embeddings"):
            raise ValueError(f"model.converters=['frozen_embedding']: {self.spec.name} has no "
                             f"tok_embeddings; allowed: llama3, moe, qwen3")
        if self.cfg.training.max_norm == 0.5:  # a setting this converter refuses, for the test
            raise ValueError("training.max_norm=0.5: frozen_embedding refuses it; "
                             "allowed: any other")

    def convert(self, model: nn.Module) -> None:
        model.tok_embeddings.weight.requires_grad_(False)
        self.record("convert")

    def tp_styles(self, model: nn.Module, plan: dict, sequence_parallel: bool) -> dict:
        self.record(f"tp_styles {len(plan)}")
        return plan

    def built(self, parts: list[nn.Module]) -> None:
        self.record(f"built {self.embedding_sum(parts)}")

    def after_step(self, parts: list[nn.Module]) -> None:
        self.record(f"after_step {self.embedding_sum(parts)}")

    @staticmethod
    def embedding_sum(parts: list[nn.Module]) -> str:
        weight = parts[0].tok_embeddings.weight
        weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
        return repr(weight.double().sum().item())


class TokenCounter(Observer):
    """Adds the step's global target tokens and the phases it saw to each row."""

    def __init__(self):
        self.phases: list[str] = []

    def phase(self, name: str):
        self.phases.append(name)
        return super().phase(name)

    def row(self, info: StepInfo) -> dict:
        row = {"plugin_tokens": info.tokens, "plugin_phases": sorted(set(self.phases))}
        self.phases.clear()
        return row


class SlowForward(Observer):
    """Makes rank 1's forward slow: the straggler the step's anatomy must name."""

    @contextlib.contextmanager
    def phase(self, name: str):
        if name == "forward" and torch.distributed.get_rank() == 1:
            time.sleep(SLOW_S)
        yield


# long beside a loaded CI machine's step (0.5 s seen): rank 1 must stay 1.5x rank 0
SLOW_S = 1.0


register_converter("frozen_embedding", FrozenEmbedding)
register_observer(lambda view: TokenCounter())
if torch.distributed.is_torchelastic_launched():
    register_observer(lambda view: SlowForward())


class Made(nn.Module):
    """The smallest model a spec describes: an embedding, one block, an output."""

    def __init__(self, dim: int):
        super().__init__()
        self.embed, self.block, self.output = (nn.Embedding(320, dim), nn.Linear(dim, dim),
                                               nn.Linear(dim, 320))

    def forward(self, tokens):
        return self.output(torch.relu(self.block(self.embed(tokens))))


def made_spec() -> ModelSpec:
    """A function returning a spec (``model.name = "tests.support.plugin:made_spec"``)."""
    return ModelSpec(name="made", flavors={"small": {"dim": 16}}, build=lambda a: Made(**a),
                     blocks=lambda model: [model.block])


def not_a_spec() -> int:
    return 1


register_model(made_spec())
