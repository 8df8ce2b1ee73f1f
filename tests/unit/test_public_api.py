"""The public API is ``composer.__all__``: every name in it has a docstring with an
example, every example runs as written (doctest, in this process), and the examples,
those of the docstrings and those of ``examples/``, reach composer through it only."""
from __future__ import annotations

import ast
import doctest
import inspect
import io
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import composer
from composer.models import MODELS
from composer.testing.harness import ROOT

# what a loop in examples/ may import of composer besides its top level: the data
# loader (composer.data)
EXAMPLES_MAY_IMPORT = {"composer", "composer.data"}


def examples(name: str) -> list[doctest.DocTest]:
    """The doctests of the public object ``name``: its docstring's, and its methods'."""
    found = doctest.DocTestFinder().find(getattr(composer, name), name, globs={})
    return [test for test in found if test.examples]


@pytest.fixture
def isolated():
    """What an example may change of this process is put back: the default dtype,
    the RNG, the registered models, a process group, torch.compile's caches."""
    dtype, rng, models = torch.get_default_dtype(), torch.get_rng_state(), dict(MODELS)
    yield
    torch.set_default_dtype(dtype)
    torch.set_rng_state(rng)
    MODELS.clear()
    MODELS.update(models)
    if dist.is_initialized():
        dist.destroy_process_group()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def test_docs_list_every_public_name_once():
    listed = re.findall(r"^- `(\w+)`", (ROOT / "docs" / "public_api.md").read_text(), re.M)
    assert sorted(listed) == sorted(composer.__all__)
    assert len(set(composer.__all__)) == len(composer.__all__)


@pytest.mark.parametrize("name", composer.__all__)
def test_every_public_name_has_a_docstring_with_an_example(name):
    obj = getattr(composer, name)
    doc = inspect.getdoc(obj) or ""
    # a dataclass without a docstring gets its signature as one
    assert doc and not doc.startswith(f"{name}("), f"{name} has no docstring"
    assert examples(name), f"{name}'s docstring shows no >>> example"


@pytest.mark.parametrize("name", composer.__all__)
def test_every_example_runs(name, isolated):
    for test in examples(name):
        out = io.StringIO()
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's, about one process without a group
            runner.run(test, out=out.write)
        assert runner.failures == 0, out.getvalue()
        assert runner.tries == len(test.examples)


def composer_imports(tree: ast.AST) -> list[tuple[str, str | None]]:
    """(module, name) of every import of composer in ``tree`` (name None: ``import m``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "composer"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "composer":
            found += [(node.module, a.name) for a in node.names]
    return found


@pytest.mark.parametrize("name", composer.__all__)
def test_docstring_examples_import_public_names_only(name):
    for test in examples(name):
        for example in test.examples:
            for module, imported in composer_imports(ast.parse(example.source)):
                assert module == "composer" and imported in composer.__all__, (
                    f"{name}'s example imports {imported or module} from {module}")


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_examples_import_public_names_only(path):
    for module, imported in composer_imports(ast.parse(path.read_text())):
        assert module in EXAMPLES_MAY_IMPORT, f"{path.name} imports {module}"
        assert module != "composer" or imported in composer.__all__, (
            f"{path.name} imports {imported}, which composer.__all__ does not hold")


def test_the_scan_sees_private_imports():
    tree = ast.parse("import composer.parallel.stages\nfrom composer.checkpoint import dcp\n"
                     "from composer import parallelize")
    assert composer_imports(tree) == [("composer.parallel.stages", None),
                                      ("composer.checkpoint", "dcp"),
                                      ("composer", "parallelize")]


def _load(path: Path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted((ROOT / "scripts").glob("*.py")), ids=lambda p: p.stem)
def test_scripts_import(path, monkeypatch):
    """Every script in scripts/ imports (its main guarded): a name moved inside composer
    breaks the script that used it here, not when someone next runs it."""
    assert _load(path, monkeypatch).__doc__, f"{path.name}: say what it does and how to run it"


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")),
                         ids=lambda p: p.stem)
def test_benchmarks_have_one_shape(path, monkeypatch, capsys):
    """Every benchmark imports the installed package only (no sys.path edit, nothing from
    tests/), says what it measures, and has ``main(argv)`` whose ``--help`` lists --json;
    benchmarks/README.md lists it."""
    text = path.read_text()
    assert "sys.path" not in text and "from tests" not in text and "import tests" not in text
    module = _load(path, monkeypatch)
    assert module.__doc__, f"{path.name}: say what it measures and how to run it"
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0 and "--json" in capsys.readouterr().out
    assert f"`{path.name}`" in (ROOT / "benchmarks" / "README.md").read_text()
