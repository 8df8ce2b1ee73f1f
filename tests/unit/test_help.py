"""``--help``: the usage and the sections, a section's keys, one line for an unknown
section; every key's help; the generated reference pages match the code."""
from __future__ import annotations

import dataclasses
import runpy
import sys
from pathlib import Path

import pytest

from composer.cli.run import run_argv
from composer.config.describe import known_sections
from composer.planner.cli import main as plan_main
from composer.tools.reference_pages import PAGES

ROOT = Path(__file__).resolve().parents[2]


def test_help_prints_the_usage_and_every_section_on_stdout(capsys):
    assert run_argv(["--help"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("usage: composer-train --config FILE|NAME [--section.key VALUE ...]")
    for flag in ("--print-config", "--validate", "--dry-run", "--help [SECTION]"):
        assert flag in out
    listed = out.split("sections (--help SECTION lists its keys):\n")[1].splitlines()
    assert [line.split()[0] for line in listed] == list(known_sections())
    assert {"training", "lora", "float8", "dpo", "eval", "fault_tolerance"} <= set(known_sections())
    assert all(len(line.split()) > 1 for line in listed)  # each with its description


def test_help_section_lists_each_key_with_type_default_allowed_and_help(capsys):
    assert run_argv(["--help", "lora"]) == 0  # a converter's registered section
    out = capsys.readouterr().out
    assert out.startswith("[lora]  LoRA and QLoRA adapters")
    assert "  lora.rank  (int, default 8)\n      allowed: >= 1\n      the adapters' rank" in out
    assert '  lora.export  (str, default "")\n      allowed: one of "", "peft"\n' in out
    assert run_argv(["--config", "x.toml", "--help=training"]) == 0
    out = capsys.readouterr().out
    assert "training.global_batch_size  (int, default -1)\n      allowed: >= 1 or -1\n" in out
    assert 'allowed: one of "float32", "bfloat16", "float64"' in out


def test_help_of_an_unknown_section_is_one_line_and_status_2(capsys):
    assert run_argv(["--help", "nosuch"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("error: --help nosuch: no such section; sections are: job, model,")
    assert "lora" in err


@pytest.mark.filterwarnings("ignore:'composer.(train|cli)' found in sys.modules")
def test_python_m_composer_train_help_exits_0(monkeypatch, capsys):
    """What ``python -m composer.train --help`` runs, in this process."""
    monkeypatch.setattr(sys, "argv", ["composer.train", "--help"])
    with pytest.raises(SystemExit) as ended:
        runpy.run_module("composer.train", run_name="__main__", alter_sys=True)
    assert ended.value.code == 0
    assert capsys.readouterr().out.startswith("usage: composer-train")


def test_every_key_of_every_section_has_help():
    missing = [f"{name}.{f.name}" for name, section in known_sections().items()
               for f in dataclasses.fields(section) if not f.metadata.get("help")]
    assert not missing, f"keys without help metadata: {', '.join(missing)}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_generated_reference_page_is_current(page):
    committed = (ROOT / "docs" / page).read_text()
    assert committed == PAGES[page](), (
        f"docs/{page} differs from the code; regenerate: python -m composer.tools.reference_pages "
        f"--write docs")


def test_planner_help_shows_the_config_the_overrides_and_an_example(capsys):
    with pytest.raises(SystemExit) as ended:
        plan_main(["--help"])
    assert ended.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: composer-plan [--config FILE] [--section.key VALUE ...]")
    assert "examples:\n  composer-plan --config train_configs/" in out
