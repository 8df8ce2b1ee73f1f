"""Config: defaults <- TOML <- command line, and one clear line for every kind of bad input."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from composer.config import ConfigError, JobConfig, parse_args, to_toml
from tests.harness import ROOT, launch


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_then_toml_then_overrides(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nlocal_batch_size = 3\n[optimizer]\nlr = 0.5\n")
    cfg, show = parse_args(["--config", path, "--training.steps", "9", "--optimizer.lr=0.25"])
    assert not show
    assert cfg.training.steps == 9            # override beats TOML
    assert cfg.training.local_batch_size == 3  # TOML beats default
    assert cfg.optimizer.lr == 0.25
    assert cfg.data.seq_len == JobConfig().data.seq_len  # untouched default


def test_booleans_lists_and_bare_flags():
    cfg, _ = parse_args(["--metrics.enable_tensorboard", "false", "--validation.enable",
                         "--model.converters", ""])
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.validation.enable is True
    assert cfg.model.converters == []


def test_print_config_round_trips(tmp_path):
    cfg, _ = parse_args(["--training.steps", "11", "--data.dataset", 'a "quoted" name'])
    again, _ = parse_args(["--config", write(tmp_path, to_toml(cfg))])
    assert again == cfg


BAD = [
    (["--trainig.steps", "3"], "unknown section 'trainig' (did you mean 'training'?)"),
    (["--training.step", "3"], "unknown key 'training.step' (did you mean 'training.steps'?)"),
    (["--training.steps", "three"], "training.steps='three': expected int"),
    (["--training.steps", "0"], "training.steps=0: out of range"),
    (["--training.dtype", "float16"], "training.dtype='float16': not allowed; choose one of: float32, bfloat16, float64"),
    (["--parallelism.zero_stage", "4"], "parallelism.zero_stage=4: not allowed"),
    (["--metrics.enable_tensorboard", "maybe"], "metrics.enable_tensorboard='maybe': expected bool"),
    (["--training.global_batch_size", "-2"], "training.global_batch_size=-2: out of range; allowed: [1, inf] or -1"),
    (["--steps", "3"], "'steps': keys are written section.key"),
    (["--config", "/no/such.toml"], "--config /no/such.toml: no such file"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_values_name_the_key(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_invalid_toml_names_the_line(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 3\nlr = = 2\n")
    with pytest.raises(ConfigError, match="invalid TOML.*line 3"):
        parse_args(["--config", path])


def test_wrong_type_in_toml(tmp_path):
    with pytest.raises(ConfigError, match=r"training.steps='10': expected int"):
        parse_args(["--config", write(tmp_path, '[training]\nsteps = "10"\n')])


CLI_BAD = [
    (["--training.stepz", "3"], "training.stepz"),
    (["--model.flavor", "9B"], "model.flavor='9B': unknown for llama3; allowed: debug"),
    (["--model.name", "gpt"], "model.name='gpt'"),
    (["--data.seq_len", "100000"], "data.seq_len=100000"),
    (["--data.dataset", "/no/such/corpus.txt"], "data.dataset='/no/such/corpus.txt'"),
    (["--data.tokenizer", "sentencepiece"], "data.tokenizer='sentencepiece'"),
    (["--training.global_batch_size", "12"], "training.global_batch_size=12: must be a multiple of"),
    (["--parallelism.tensor_parallel_degree", "2"], "parallelism.tensor_parallel_degree=2"),
    (["--job.device", "tpu"], "job.device='tpu'"),
]


@pytest.mark.parametrize("argv,message", CLI_BAD)
def test_command_line_errors_exit_2_with_one_line(tmp_path, argv, message):
    result = launch(["--training.local_batch_size", "8", "--job.dump_folder", str(tmp_path / "out"), *argv],
                    timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_world_size_mismatch_names_the_degrees():
    from composer.mesh import ParallelDims
    with pytest.raises(ConfigError, match="multiply to 8 but the world size is 4: pp 1 x dp_replicate 2 x dp_shard 4"):
        ParallelDims(dp_replicate=2, dp_shard=4, cp=1, tp=1, pp=1, ep=1, world_size=4)
    with pytest.raises(ConfigError, match="world size 6 is not divisible by .* dp_replicate 4"):
        ParallelDims(dp_replicate=4, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=6)
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=8)
    assert dims.dp_shard == 4 and dims.dp == 8
    assert [dims.dp_rank(r) for r in range(8)] == list(range(8))


def test_dp_rank_skips_inner_dims():
    from composer.mesh import ParallelDims
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=2, ep=1, world_size=8)
    # ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "train_configs").glob("*.toml")))
def test_shipped_configs_parse(name):
    cfg, _ = parse_args(["--config", str(ROOT / "train_configs" / name)])
    assert cfg.model.name == "llama3"


def test_validate_mode_under_a_world_size():
    env_cmd = [sys.executable, "-m", "composer.train", "--config", "train_configs/debug_model.toml",
               "--validate", "--parallelism.data_parallel_replicate_degree", "3"]
    result = subprocess.run(env_cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={"WORLD_SIZE": "4", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2
    assert "world size 4 is not divisible" in result.stderr
