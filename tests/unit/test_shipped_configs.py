"""The shipped configs and samples, found by name from any directory; the cluster a
config's prediction is for (``[planner] cluster``, ``--cluster``). The installed wheel
finds them too: tests/integration/test_wheel.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from composer.config import ConfigError, load_toml, parse_args
from composer.data.sources import SAMPLES, check_columns
from composer.planner.cli import main as plan_main
from composer.planner.cluster import load_cluster
from composer.testing.harness import ROOT

SHIPPED = sorted(p.stem for p in (ROOT / "train_configs").glob("*.toml"))


def test_a_shipped_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected, _ = parse_args(["--config", str(ROOT / "train_configs" / "debug_qlora.toml")])
    for given in ("debug_qlora", "debug_qlora.toml", "train_configs/debug_qlora.toml"):
        assert parse_args(["--config", given])[0] == expected, given
    (tmp_path / "debug_qlora.toml").write_text("[training]\nsteps = 7\n")  # a path comes first
    assert parse_args(["--config", "debug_qlora.toml"])[0].training.steps == 7
    assert parse_args(["--config", "debug_qlora"])[0].training.steps == 300


def test_an_unknown_config_is_one_line_listing_the_shipped_names(tmp_path, monkeypatch, capsys):
    from composer.cli.run import run_argv
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_toml("debug_modle")
    assert str(e.value) == ("--config debug_modle: no such file or shipped config; shipped: "
                            + ", ".join(SHIPPED))
    assert run_argv(["--config", "nowhere/debug_model.toml"]) == 2  # a path, not a name
    assert capsys.readouterr().err.splitlines() == [
        "error: --config nowhere/debug_model.toml: no such file or shipped config; shipped: "
        + ", ".join(SHIPPED)]


def test_the_samples_are_found_by_name_and_a_local_path_comes_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_columns("sft_tiny", [("prompt", "response")], "prompt/response")
    check_columns("preference_tiny", [("prompt", "chosen", "rejected")], "pairs")
    assert SAMPLES["sft_tiny"].resolve() == (ROOT / "tests/data/sft_tiny.jsonl").resolve()
    (tmp_path / "sft_tiny").mkdir()
    (tmp_path / "sft_tiny" / "mine.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    with pytest.raises(ValueError, match=r"columns are \['question', 'answer'\]"):
        check_columns("sft_tiny", [("prompt", "response")], "prompt/response")


def _configs() -> dict[str, dict]:
    return {name: load_toml(str(ROOT / "train_configs" / f"{name}.toml")) for name in SHIPPED}


def test_each_shipped_config_writes_to_its_own_folder_and_reads_shipped_data():
    for name, data in _configs().items():
        assert Path(data["job"]["dump_folder"]) == Path("outputs") / name, name
        dataset = data["data"]["dataset"]
        assert dataset == "tinyshakespeare" or dataset in SAMPLES, (name, dataset)


def test_the_gpu_configs_name_the_cluster_their_comments_do():
    named = {name: data["planner"]["cluster"] for name, data in _configs().items()
             if "planner" in data}
    assert set(named) == {"llama3_8b", "llama3_8b_128k", "llama3_8b_lora", "llama3_70b",
                          "llama3_70b_lora", "llama3_70b_qlora", "llama3_405b",
                          "qwen3_30b_a3b", "hf_lora"}
    for name, cluster in named.items():
        assert cluster == "h100-80gb" and load_cluster(cluster).memory_gib > 79, name
        assert "GPU" in (ROOT / "train_configs" / f"{name}.toml").read_text().split("[")[0]


def validate(monkeypatch, capsys, *argv: str) -> tuple[int, str, list[str]]:
    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = run_argv(["--config", "debug_model", "--validate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err.splitlines()


def test_validate_predicts_for_the_named_cluster_the_flag_first(monkeypatch, capsys, tmp_path):
    code, out, _ = validate(monkeypatch, capsys)
    assert code == 0 and "predicted for 2 x cpu (this device; planner.cluster or --cluster" in out
    code, out, _ = validate(monkeypatch, capsys, "--planner.cluster", "a100-40gb")
    assert code == 0 and "predicted for 2 x a100-40gb: peak" in out and "of 38.50 usable" in out
    code, out, _ = validate(monkeypatch, capsys, "--planner.cluster", "a100-40gb",
                            "--cluster", "h200-141gb")
    assert code == 0 and "predicted for 2 x h200-141gb: peak" in out
    mine = tmp_path / "lab.toml"
    mine.write_text(_lab_toml())
    code, out, _ = validate(monkeypatch, capsys, f"--cluster={mine}")
    assert code == 0 and "predicted for 2 x lab: peak" in out and "of 9.00 usable" in out


def _lab_toml() -> str:
    return ("devices_per_node = 4\nmemory_gib = 10.0\nreserved_gib = 1.0\n"
            "intra_node_gbps = 100.0\ninter_node_gbps = 10.0\nintra_node_latency_us = 5.0\n"
            "inter_node_latency_us = 10.0\nmatmul_efficiency = 0.5\ncomm_efficiency = 0.7\n"
            "op_overhead_us = 5.0\n[peak_tflops]\nfloat32 = 20.0\n")


@pytest.mark.parametrize("argv, line", [
    (["--planner.cluster", "h100"],
     "error: planner.cluster='h100': unknown cluster 'h100' (did you mean 'h100-80gb'?); "
     "built-in: cpu, a100-40gb, a100-80gb, h100-80gb, h200-141gb, b200, or a path to a TOML "
     "file"),
    (["--cluster", "nowhere/lab.toml"],
     "error: planner.cluster='nowhere/lab.toml': cluster nowhere/lab.toml: no such file"),
    (["--cluster"], "error: --cluster: give a built-in cluster's name or a cluster TOML file"),
])
def test_a_bad_cluster_stops_at_start_with_one_line(monkeypatch, capsys, argv, line):
    code, out, err = validate(monkeypatch, capsys, *argv)
    assert (code, err) == (2, [line]) and "config ok" not in out


def test_composer_plan_defaults_to_the_configs_cluster(capsys):
    import json
    argv = ["--config", "debug_model", "--world-size", "2", "--json"]
    assert plan_main([*argv, "--planner.cluster", "a100-80gb"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "a100-80gb"
    assert plan_main([*argv, "--planner.cluster", "a100-80gb", "--cluster", "b200"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "b200"
    assert plan_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "cpu"
