"""The planner (composer/planner): published arithmetic reproduced, its search
and its command line, and its predictions against what training measures
(metrics.memory_breakdown of one-process runs here; the multi-rank memory and
every comm_stats row are compared in tests/integration/test_parity.py on the matrix's own
rows)."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from composer.config import parse_args
from composer.planner.cli import main as plan_main
from composer.planner.cluster import load_cluster
from composer.planner.layout import layout_of, load_model
from composer.planner.predict import predict
from composer.planner.search import search
from composer.planner.state import rank_state, state_bytes
from composer.testing.harness import train

DEBUG = ["--config", "train_configs/debug_model.toml"]
# Llama-2-7B's shape in the llama3 family: 6.74e9 parameters
SEVEN_B = ("dim=4096,n_layers=32,n_heads=32,n_kv_heads=32,vocab_size=32000,multiple_of=256,"
           "ffn_dim_multiplier=1.0")
# GPT-3 175B's shape (every TP=12 split divides): 174.6e9 parameters
GPT3 = "dim=12288,n_layers=96,n_heads=96,n_kv_heads=96,ffn_dim_multiplier=1.0,multiple_of=24"


def layout_for(argv: list[str], world: int, device: str = "cpu"):
    cfg, _ = parse_args(argv)
    return layout_of(cfg, load_model(cfg), world, device)


def state(argv: list[str], world: int) -> tuple[dict, int]:
    layout = layout_for(argv, world)
    rest = state_bytes(layout, rank_state(layout, [0]))
    return vars(rest), layout.model.spec.num_params(layout.model.args)


def test_mixed_precision_adam_holds_16_bytes_per_parameter():
    """7B with bfloat16 compute and AdamW, one rank, no sharding: float32 weights
    (the master copy), float32 gradients and two float32 moments, 4+4+8 bytes:
    the 2+2+12 of the classic split, 16 bytes either way."""
    rest, n = state(["--config", "train_configs/llama3_70b.toml", "--model.overrides", SEVEN_B,
                     "--parallelism.zero_stage", "0"], 1)
    assert 6.7e9 < n < 6.8e9
    assert rest == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}
    assert sum(rest.values()) == 16 * n  # 107.9e9 bytes for this 6.74e9; 7e9 x 16 = 112e9


@pytest.mark.parametrize("zero,formula", [
    (0, lambda p, n: 16 * p), (1, lambda p, n: 8 * p + 8 * p / n),
    (2, lambda p, n: 16 * p / n), (3, lambda p, n: 16 * p / n)])
def test_model_state_follows_the_readme_formula_for_each_zero_stage(zero, formula):
    """float32 + AdamW on N = 4 ranks, at rest (stage 2 also holds the gathered
    weights between forward and backward, which the peak adds)."""
    rest, p = state([*DEBUG, "--parallelism.zero_stage", str(zero)], 4)
    assert sum(rest.values()) == formula(p, 4)


def test_175b_with_tp12_pp4_on_1024_gpus_is_refused_with_its_reason(capsys):
    code = plan_main(["--config", "train_configs/llama3_70b.toml", "--model.overrides", GPT3,
                      "--parallelism.tensor_parallel_degree", "12",
                      "--parallelism.pipeline_parallel_degree", "4", "--cluster", "a100-80gb",
                      "--nodes", "128"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "world size 1024 is not divisible by pp 4 x dp_replicate 1 x cp 1 x tp 12 = 48" in err[0]
    assert "(1024 / 48 = 21.33)" in err[0]


def test_the_search_finds_valid_layouts_for_175b_on_1024_gpus():
    cfg, _ = parse_args(["--config", "train_configs/llama3_70b.toml", "--model.overrides", GPT3,
                         "--data.seq_len", "2048", "--training.global_batch_size", "1536"])
    found, tried = search(cfg, load_model(cfg), 1024, load_cluster("a100-80gb"))
    assert tried > 100 and len(found) > 10
    best = found[0]
    assert best.fits and best.layout.dims.world_size == 1024
    assert best.layout.dims.tp <= 8  # within a node
    assert [p.time.tokens_per_second for p in found] == sorted(
        (p.time.tokens_per_second for p in found), reverse=True)


def test_json_holds_the_prediction_alone(capsys):
    assert plan_main([*DEBUG, "--cluster", "cpu", "--world-size", "2",
                      "--parallelism.tensor_parallel_degree", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["memory_gib"]) == {"params", "grads", "optimizer",
                                      "activations", "other", "peak"}
    assert {"step_s", "tokens_per_second", "mfu", "comm_share", "fits"} <= out.keys()
    assert out["fits"] is True and out["degrees"]["tp"] == 2
    forward = out["comm"]["forward"]["tp"]
    assert set(forward) == {"all_gather", "reduce_scatter"}  # sequence parallel
    assert set(forward["all_gather"]) == {"count", "bytes", "ring_bytes"}


def one_line_error(capsys, argv: list[str]) -> str:
    code = plan_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


def test_bad_input_gives_one_line_and_exit_2(capsys, tmp_path):
    assert "unknown cluster 'h100'" in one_line_error(capsys, [*DEBUG, "--cluster", "h100"])
    partial = tmp_path / "mine.toml"
    partial.write_text("devices_per_node = 8\nmemory_gib = 80.0\n")
    assert "missing field" in one_line_error(capsys, [*DEBUG, "--cluster", str(partial)])
    fp32_only = tmp_path / "fp32_only.toml"
    fp32_only.write_text(
        "devices_per_node = 8\nmemory_gib = 80.0\nreserved_gib = 1.0\nintra_node_gbps = 400.0\n"
        "inter_node_gbps = 50.0\nintra_node_latency_us = 5.0\ninter_node_latency_us = 10.0\n"
        "matmul_efficiency = 0.5\ncomm_efficiency = 0.7\nop_overhead_us = 5.0\n"
        "[peak_tflops]\nfloat32 = 60.0\n")
    assert "no peak_tflops for bfloat16" in one_line_error(
        capsys, [*DEBUG, "--cluster", str(fp32_only),
                 "--training.mixed_precision_param", "bfloat16"])
    assert "world size 2 is not divisible by" in one_line_error(
        capsys, [*DEBUG, "--world-size", "2", "--parallelism.tensor_parallel_degree", "3"])
    nothing = one_line_error(capsys, ["--config", "train_configs/llama3_405b.toml", "--cluster",
                                      "a100-40gb", "--world-size", "8", "--search"])
    assert ("no layout of 8 ranks fits a100-40gb: the closest" in nothing
            and "GiB per rank" in nothing)


def test_a_refused_megatron_recipe_names_what_moves_the_same_bytes(capsys):
    line = one_line_error(capsys, [*DEBUG, "--world-size", "4", "--parallelism.zero_stage", "1",
                                   "--parallelism.tensor_parallel_degree", "2"])
    assert "zero_stage=1" in line and "zero_stage=2 (FSDP2 without resharding)" in line


def test_search_writes_a_config_training_validates(capsys, tmp_path, monkeypatch):
    out, svg = tmp_path / "plan.toml", tmp_path / "plan.svg"
    assert plan_main([*DEBUG, "--cluster", "cpu", "--world-size", "4", "--search",
                      "--write-toml", str(out), "--svg", str(svg)]) == 0
    table = capsys.readouterr().out
    assert "why it loses to #1" in table
    bars = ET.fromstring(svg.read_text()).findall(".//{http://www.w3.org/2000/svg}g[@class='bar']")
    assert len(bars) >= 2
    from composer.cli.run import run_argv as train_main
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert train_main(["--config", str(out), "--job.dump_folder", str(tmp_path / "run"),
                       "--validate"]) == 0


def test_the_search_picks_ddp_for_a_model_that_fits_one_device():
    cfg, _ = parse_args(DEBUG)
    found, _ = search(cfg, load_model(cfg), 8, load_cluster("cpu"))
    d = found[0].layout
    assert d.cfg.parallelism.zero_stage == 0 and d.dims.tp == d.dims.pp == d.dims.cp == 1


def test_tensor_parallel_across_nodes_is_warned_with_its_cost():
    layout = layout_for(["--config", "train_configs/llama3_70b.toml", "--model.overrides", GPT3,
                         "--parallelism.tensor_parallel_degree", "16"], 64, "cuda")
    warnings = predict(layout, load_cluster("h100-80gb")).warnings
    assert any(w.startswith("tensor parallel x16 spans nodes") and "InfiniBand" in w
               for w in warnings), warnings


def test_communication_above_30_percent_is_warned():
    layout = layout_for([*DEBUG, "--parallelism.tensor_parallel_degree", "2"], 2)
    p = predict(layout, load_cluster("cpu"))
    assert p.time.comm_share > 0.3
    assert any(w.startswith(f"communication is {p.time.comm_share:.0%} of the step")
               for w in p.warnings)


# float32 runs on this machine, step 2's breakdown (the rank with the largest peak)
MEASURED = ["--training.steps", "2", "--metrics.log_freq", "1", "--metrics.memory_breakdown",
            "true", "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
            "--lr_scheduler.warmup_steps", "1"]
LORA = ["--model.converters", "lora", "--lora.rank", "4", "--lora.target_modules",
        "wq,wv,wo,w1,w2,output", "--data.format", "sft", "--data.dataset",
        "tests/data/sft_tiny.jsonl"]
IN_PROCESS = {"no_ac": [], "ac_full": ["--activation_checkpoint.mode", "full"],
              "ac_selective_op": ["--activation_checkpoint.mode", "selective_op"], "lora": LORA}


def check_memory(name: str, argv: list[str], world: int, rows: list[dict]) -> None:
    """Peak within 10%, every category within 15% (of the peak where it is a
    small share of it: a category under 5% of the peak is held to 15% of 5%)."""
    measured = max(rows[1]["memory"], key=lambda r: r["peak"])
    predicted = predict(layout_for([*DEBUG, *argv], world), load_cluster("cpu")).peak.gib()
    assert abs(predicted["peak"] / measured["peak"] - 1) <= 0.10, (name, predicted, measured)
    floor = 0.05 * measured["peak"]
    for key in ("params", "grads", "optimizer", "activations", "other"):
        error = abs(predicted[key] - measured[key]) / max(measured[key], floor)
        assert error <= 0.15, (name, key, predicted, measured)


@pytest.mark.parametrize("name", IN_PROCESS)
def test_predicted_memory_matches_the_breakdown_on_one_process(name, tmp_path):
    rows = train(tmp_path, 1, [*DEBUG, *MEASURED, *IN_PROCESS[name]])
    check_memory(name, IN_PROCESS[name], 1, rows)


def test_validate_prints_the_prediction_and_warns_when_it_will_not_fit(monkeypatch, capsys,
                                                                      tmp_path):
    from composer.cli.run import run_argv as train_main
    monkeypatch.setenv("WORLD_SIZE", "64")
    config = ["--config", "train_configs/llama3_70b.toml", "--job.dump_folder", str(tmp_path)]
    assert train_main([*config, "--validate"]) == 0
    out = capsys.readouterr().out  # the config's cluster (planner.cluster): 8 nodes of H100
    assert "config ok for 64 rank(s)" in out and "predicted for 64 x h100-80gb: peak" in out
    assert "does not fit" not in out
    assert train_main([*config, "--validate", "--cluster", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "predicted for 64 x cpu: peak" in out
    assert "does not fit: " in out  # 70B on 64 CPU ranks sharing this machine's memory
