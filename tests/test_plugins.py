"""Features plug in from outside ``composer/``: a converter and an observer defined
here, registered through the public interfaces, run in real training runs.

Run under torchrun, this file registers them and trains (tensor parallel x2 in
the test below), so the converter's tensor-parallel hook is asked too:

    torchrun --nproc_per_node=2 tests/test_plugins.py --job.dump_folder OUT ...
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from composer.converters import CONVERTERS, Converter, register_converter
from composer.observe import OBSERVERS, Observer, StepInfo, register_observer


class FrozenEmbedding(Converter):
    """Keeps the token embedding out of training; logs each hook it is asked."""

    def record(self, line: str) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        folder = Path(self.cfg.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"hooks-rank{rank}.txt", "a") as f:
            f.write(line + "\n")

    def check(self, meta: nn.Module) -> None:
        if not hasattr(meta, "tok_embeddings"):
            raise ValueError(f"model.converters=['frozen_embedding']: {self.spec.name} has no "
                             f"tok_embeddings; allowed: llama3, moe, qwen3")
        if self.cfg.training.max_norm == 0.5:  # a setting this converter refuses, for the test
            raise ValueError("training.max_norm=0.5: frozen_embedding refuses it; allowed: any other")

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


SLOW_S = 0.3


def register() -> None:
    register_converter("frozen_embedding", FrozenEmbedding)
    register_observer(lambda trainer: TokenCounter())
    if torch.distributed.is_torchelastic_launched():
        register_observer(lambda trainer: SlowForward())


@pytest.fixture
def plugged():
    converters, observers = dict(CONVERTERS), list(OBSERVERS)
    register()
    yield
    CONVERTERS.clear()
    CONVERTERS.update(converters)
    OBSERVERS[:] = observers


def test_a_plugged_converter_and_observer_run_in_a_tensor_parallel_job(tmp_path):
    from tests.harness import launch, read_metrics
    steps, batch, seq = 3, 4, 64
    result = launch(["--job.dump_folder", str(tmp_path), "--model.converters", "frozen_embedding",
                     "--parallelism.tensor_parallel_degree", "2", "--training.steps", str(steps),
                     "--training.local_batch_size", str(batch), "--data.seq_len", str(seq),
                     "--metrics.log_freq", "1",
                     "--data.document_mask", "false"],  # every target counts
                    nproc=2, timeout=300,
                    program="tests/test_plugins.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["plugin_tokens"] for r in rows] == [batch * seq] * steps  # dp 1: one rank's batch
    assert rows[0]["plugin_phases"] == ["backward", "data", "forward", "loss", "optimizer"]
    # the plugged slow forward of rank 1: the anatomy names it, and rank 0's wait in tp
    for row in rows[1:]:  # the first step's warm-up is rank 0's own
        assert row["slowest_rank"] == 1
        assert row["slowest_rank_s"] > 1.2 * row["median_rank_s"]  # the warning's threshold
        assert row["comm_share"] > 0.30 and row["comm_exposed_s"] > SLOW_S * 0.8
        assert set(row["comm_dims_s"]) == {"tp"}
        phases = sum(row[k] for k in ("data_wait_s", "forward_s", "backward_s", "optimizer_s"))
        assert phases == pytest.approx(row["step_time_s"], rel=0.10)
    out = result.stdout
    assert out.count("is a straggler") == 1 and "rank 1 is a straggler" in out
    assert out.count("communication is") == 1
    assert "tp is responsible; for a layout that moves less: python -m composer.planner" in out
    for rank in range(2):
        hooks = (tmp_path / f"hooks-rank{rank}.txt").read_text().splitlines()
        kinds = [line.split()[0] for line in hooks]
        # convert runs on every meta build (the planner's, the model's, a CPU
        # replica's for the weights); the other hooks once, in this order
        assert kinds[0] == "convert"
        assert [k for k in kinds if k != "convert"] == ["tp_styles", "built", *["after_step"] * steps]
        sums = {line.split()[1] for line in hooks if line.startswith(("built", "after_step"))}
        assert len(sums) == 1  # the frozen embedding never moved
        assert int(hooks[kinds.index("tp_styles")].split()[1]) > 0


def test_a_plugged_converters_check_ends_in_one_line(plugged, monkeypatch, capsys, tmp_path):
    from composer.train import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = main(["--job.dump_folder", str(tmp_path / "out"), "--model.converters",
                 "frozen_embedding", "--training.max_norm", "0.5"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines == ["error: training.max_norm=0.5: frozen_embedding refuses it; "
                                   "allowed: any other"]
    assert not (tmp_path / "out").exists()


def test_unknown_converters_name_the_registered_ones(plugged, monkeypatch, capsys):
    from composer.train import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--model.converters", "int4"]) == 2
    assert capsys.readouterr().err.strip() == ("error: model.converters: unknown entry 'int4'; "
                                               "allowed: float8, lora, qlora, frozen_embedding")


def test_one_process_run_rows_carry_the_observer(plugged, tmp_path):
    from tests.harness import train
    rows = train(tmp_path, 1, ["--training.steps", "2", "--training.local_batch_size", "2",
                               "--data.seq_len", "32", "--metrics.log_freq", "1",
                               "--data.document_mask", "false"])  # every target counts
    assert [r["plugin_tokens"] for r in rows] == [64, 64]
    assert json.dumps(rows[-1]["plugin_phases"]) == '["backward", "data", "forward", "loss", "optimizer"]'


if __name__ == "__main__":
    register()
    from composer.train import cli
    cli()
