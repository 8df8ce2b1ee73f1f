"""The wheel holds the product: every module and data file of the source tree, under
the names it imports by (``models/`` as ``composer.models``, ``train_configs/`` as
``composer/train_configs/``), and nothing else; installed, it finds its shipped configs
and samples by name from any directory; and its metadata offers each optional extra of
pyproject.toml, every one of them also in ``dev``.

The wheel is built, without the network, from a fresh copy of what the build reads, so
neither a stale ``build/`` nor an ``*.egg-info`` of the working tree can hide a file that
discovery missed (and the build leaves nothing in the tree).
"""
from __future__ import annotations

import re
import shutil
import sys
import zipfile
from email.parser import Parser

import pytest

from composer.testing.harness import ROOT, launch_env, run_command

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
# source folder -> the package name it installs as
PACKAGE_ROOTS = {"composer": "composer", **{folder: name for name, folder in
                                            SETUPTOOLS.get("package-dir", {}).items()}}
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
# The PEP 517 hook that pip and ``python -m build --no-isolation`` call, without their
# start-up: offline, and with the setuptools of this environment (dev's).
BUILD_WHEEL = ("import os, sys; os.chdir(sys.argv[1]); from setuptools import build_meta; "
               "build_meta.build_wheel(sys.argv[2])")


def shipped_files() -> set[str]:
    """Every file of the package folders, as its path inside the wheel."""
    found = set()
    for folder, package in PACKAGE_ROOTS.items():
        for path in (ROOT / folder).rglob("*"):
            parts = path.relative_to(ROOT / folder).parts
            if path.is_file() and not any(p == "__pycache__" or p.startswith(".") for p in parts) \
                    and path.suffix != ".pyc":
                found.add("/".join([*package.split("."), *parts]))
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "setup.py", PYPROJECT["project"]["readme"]):
        shutil.copy2(ROOT / name, src / name)
    for folder in PACKAGE_ROOTS:
        shutil.copytree(ROOT / folder, src / folder, ignore=SKIPPED)
    result = run_command([sys.executable, "-c", BUILD_WHEEL, str(src), str(out)], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_every_module_and_data_file_and_nothing_else(wheel):
    held = {n for n in wheel.namelist() if ".dist-info/" not in n}
    expected = shipped_files()
    missing, extra = sorted(expected - held), sorted(held - expected)
    assert not missing, ("missing from the wheel (a folder without __init__.py, or a data "
                         "file outside an assets/ folder, see pyproject.toml): "
                         + ", ".join(missing))
    assert not extra, f"in the wheel but not in the tree: {', '.join(extra)}"
    assert any(n.startswith("composer/models/") and n.endswith(".py") for n in held)
    assert any(not n.endswith(".py") for n in held), "the built-in corpus is data"


# Run in another directory, with the wheel's files the only composer on the path: the
# shipped configs by name, one of them reading the shipped SFT sample by name.
BY_NAME = ("import os, sys; os.chdir(sys.argv[1]); import composer.cli as cli; "
           "print('composer from', cli.__file__); "
           "sys.exit(cli.run_argv(['--config', 'debug_model', '--print-config']) "
           "or cli.run_argv(['--config', 'debug_qlora', '--validate']))")


def test_the_installed_wheel_finds_its_configs_and_samples_by_name(wheel, tmp_path):
    held = set(wheel.namelist())
    configs = {f"composer/train_configs/{p.name}" for p in (ROOT / "train_configs").glob("*.toml")}
    assert "composer/train_configs/debug_model.toml" in configs and configs <= held
    assert {"composer/data/assets/sft_tiny.jsonl",
            "composer/data/assets/preference_tiny.jsonl"} <= held
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    wheel.extractall(site)  # a pure-Python wheel unpacked is what pip installs
    elsewhere.mkdir()
    env = {**launch_env(), "PYTHONPATH": str(site)}
    # -P: the directory the command starts in (the source tree) is not on the path
    result = run_command([sys.executable, "-P", "-c", BY_NAME, str(elsewhere)], timeout=120,
                         env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"composer from {site / 'composer'}" in result.stdout
    assert 'dump_folder = "./outputs/debug_model"' in result.stdout
    assert "config ok for 1 rank(s)" in result.stdout, result.stdout[-3000:]


def names(requirements: list[str]) -> set[str]:
    """Distribution names, normalised (PEP 503), without versions or markers."""
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", r.strip()).group()).lower()
            for r in requirements}


def test_the_metadata_offers_each_extra_of_pyproject(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(meta).decode())
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(metadata.get_all("Provides-Extra")) == set(extras)
    for extra, requirements in extras.items():
        marked = [r.split(";")[0] for r in metadata.get_all("Requires-Dist")
                  if re.search(rf"extra\s*==\s*['\"]{extra}['\"]", r)]
        assert names(marked) == names(requirements), extra


def test_dev_holds_every_optional_extra():
    extras = PYPROJECT["project"]["optional-dependencies"]
    dev = names(extras["dev"])
    for extra, requirements in extras.items():
        assert names(requirements) <= dev, f"[{extra}] not in dev: {names(requirements) - dev}"
