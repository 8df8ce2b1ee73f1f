"""Features plug in from outside ``composer/``: the converter (with a config section
of its own) and observers of ``tests/support/plugin.py``, registered through the public
interfaces when ``job.plugins`` imports that module, run in real training runs.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import sys

import pytest

from composer.config import SECTIONS
from composer.converters import CONVERTERS
from composer.observe import OBSERVERS

PLUGIN = ["--job.plugins", "tests.support.plugin"]


@contextlib.contextmanager
def registries_restored():
    """The registries and the module cache as they were, after the block: a later
    import of tests.support.plugin registers anew."""
    converters, observers, sections = dict(CONVERTERS), list(OBSERVERS), dict(SECTIONS)
    try:
        yield
    finally:
        CONVERTERS.clear()
        CONVERTERS.update(converters)
        OBSERVERS[:] = observers
        SECTIONS.clear()
        SECTIONS.update(sections)
        sys.modules.pop("tests.support.plugin", None)


@pytest.fixture
def plugged():
    """tests.support.plugin imported (so registered) for one test."""
    with registries_restored():
        importlib.import_module("tests.support.plugin")
        yield


def test_a_plugged_converter_and_observer_run_in_a_tensor_parallel_job(plugged, tmp_path):
    from composer.testing.harness import launch, read_metrics
    from tests.support.plugin import SLOW_S
    steps, batch, seq = 3, 4, 64
    result = launch(["--job.plugins", "tests.support.plugin,tests.support.exit_census",
                     "--job.dump_folder", str(tmp_path),
                     "--model.converters", "frozen_embedding", "--frozen_embedding.record", "calls",
                     "--parallelism.tensor_parallel_degree", "2", "--training.steps", str(steps),
                     "--training.local_batch_size", str(batch), "--data.seq_len", str(seq),
                     "--metrics.log_freq", "1",
                     "--metrics.comm_stats",  # the anatomy times each collective by dim
                     "--data.document_mask", "false"],  # every target counts
                    nproc=2, timeout=300)
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
    # each rank ended its process groups before the interpreter's teardown began
    assert out.count("gloo threads at exit: 0") == 2, out[-3000:]
    assert out.count("is a straggler") == 1 and "rank 1 is a straggler" in out
    assert out.count("communication is") == 1
    assert "tp is responsible; for a layout that moves less: python -m composer.planner" in out
    # the section's key, set on the command line, named the hook log
    assert not list(tmp_path.glob("hooks-rank*.txt"))
    for rank in range(2):
        hooks = (tmp_path / f"calls-rank{rank}.txt").read_text().splitlines()
        kinds = [line.split()[0] for line in hooks]
        # convert runs on every meta build (the planner's, the model's, a CPU
        # replica's for the weights); the other hooks once, in this order
        assert kinds[0] == "convert"
        assert [k for k in kinds if k != "convert"] == ["tp_styles", "built",
                                                        *["after_step"] * steps]
        sums = {line.split()[1] for line in hooks if line.startswith(("built", "after_step"))}
        assert len(sums) == 1  # the frozen embedding never moved
        assert int(hooks[kinds.index("tp_styles")].split()[1]) > 0
    # the run record keeps the plugin's section with the value it ran with
    assert '[frozen_embedding]\nrecord = "calls"' in (tmp_path / "config.toml").read_text()


def run_cli(monkeypatch, capsys, argv: list[str]) -> tuple[int, list[str]]:
    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = run_argv(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_typo_in_a_plugins_section_is_one_line(plugged, monkeypatch, capsys, tmp_path):
    code, lines = run_cli(monkeypatch, capsys, [*PLUGIN, "--job.dump_folder", str(tmp_path / "o"),
                                                "--frozen_embedding.recrod", "x"])
    assert code == 2 and lines == ["error: unknown key 'frozen_embedding.recrod' (did you mean "
                                   "'frozen_embedding.record'?)"]
    assert not (tmp_path / "o").exists()


def test_a_plugin_named_in_the_toml_file_is_imported_before_its_section_is_read(
        monkeypatch, capsys, tmp_path):
    from composer.config import parse_args
    sys.modules.pop("tests.support.plugin", None)  # imported by the config, not by this test
    config = tmp_path / "job.toml"
    config.write_text('[frozen_embedding]\nrecord = "from_toml"\n\n[job]\n'
                      'plugins = ["tests.support.plugin"]\n')
    with registries_restored():
        cfg, _ = parse_args(["--config", str(config)])
        assert cfg.frozen_embedding.record == "from_toml"
        from composer.cli.run import run_argv
        assert run_argv(["--config", str(config), "--print-config"]) == 0
        assert '[frozen_embedding]\nrecord = "from_toml"' in capsys.readouterr().out
    code, lines = run_cli(monkeypatch, capsys, ["--job.plugins", "tests.no_such_plugin"])
    assert code == 2 and lines == ["error: job.plugins: cannot import 'tests.no_such_plugin' (No "
                                   "module named 'tests.no_such_plugin'); allowed: a module on "
                                   "the Python path"]


def test_a_plugged_converters_check_ends_in_one_line(plugged, monkeypatch, capsys, tmp_path):
    code, lines = run_cli(monkeypatch, capsys, [
        "--job.dump_folder", str(tmp_path / "out"), "--model.converters", "frozen_embedding",
        "--training.max_norm", "0.5"])
    assert code == 2 and lines == ["error: training.max_norm=0.5: frozen_embedding refuses it; "
                                   "allowed: any other"]
    assert not (tmp_path / "out").exists()


def test_unknown_converters_name_the_registered_ones(plugged, monkeypatch, capsys):
    code, lines = run_cli(monkeypatch, capsys, ["--model.converters", "int4"])
    assert code == 2 and lines == ["error: model.converters: unknown entry 'int4'; "
                                   "allowed: float8, lora, qlora, frozen_embedding"]


def test_one_process_run_rows_carry_the_observer(plugged, tmp_path):
    from composer.testing.harness import train
    rows = train(tmp_path, 1, [*PLUGIN, "--training.steps", "2", "--training.local_batch_size", "2",
                               "--data.seq_len", "32", "--metrics.log_freq", "1",
                               "--data.document_mask", "false"])  # every target counts
    assert [r["plugin_tokens"] for r in rows] == [64, 64]
    assert json.dumps(rows[-1]["plugin_phases"]) == ('["backward", "data", "forward", "loss", '
                                                     '"optimizer"]')


def test_the_interfaces_stay_narrow():
    """What a component implements or a model tells is small: at most 8 public
    methods per interface class, at most 8 fields at the top of ModelSpec, and a
    plain model needs only its name, flavors, build and blocks."""
    import dataclasses
    import inspect

    from composer.converters.base import CheckpointPolicy, Converter, CostHints
    from composer.observe.base import Observer, Observers, RunView
    from composer.spec import ModelSpec
    for cls in (Converter, CheckpointPolicy, CostHints, Observer, Observers, RunView):
        public = [n for n, v in inspect.getmembers(cls) if not n.startswith("_")
                  and (inspect.isfunction(v) or isinstance(v, property))]
        assert 0 < len(public) <= 8, (cls.__name__, public)
    fields = dataclasses.fields(ModelSpec)
    assert len(fields) <= 8
    required = [f.name for f in fields if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    assert required == ["name", "flavors", "build", "blocks"]
