"""The tree is the architecture document: docs/architecture.md's tree names every package
and top-level module of composer/ (and nothing that is gone), each package's docstring says
which packages it may import, every import keeps to that, and the floors those lines make
are the ones the page shows (so no cycle and no import that runs back up)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
TOP = {"__init__", "train"}  # above every floor: the public API and `python -m composer.train`
IMPORTS = re.compile(r"^Imports: (.+)", re.M | re.S)  # the docstring's last paragraph


def tree_block() -> str:
    text = PAGE.read_text()
    start = text.index("## The tree")
    block = text[start:].split("```")[1]
    return block


def documented() -> set[str]:
    """The entries of the page's tree: composer's children as ``composer/x/`` or
    ``composer/x.py``, and the folders beside it as written."""
    entries, parent = set(), ""
    for line in tree_block().splitlines():
        if not line.strip() or line.startswith(" " * 8):  # a description's second line
            continue
        name = line.split()[0]
        if not line.startswith(" "):
            parent = name if name == "composer/" else ""
            entries.add(name)
        elif parent:
            entries.add(parent + name)
    return entries


def in_code() -> set[str]:
    composer = ROOT / "composer"
    found = {f"composer/{p.name}" for p in composer.glob("*.py")}
    found |= {f"composer/{p.parent.name}/" for p in composer.glob("*/__init__.py")}
    return found | {"composer/"}


def units() -> dict[str, list[Path]]:
    """Each unit a rule is written for (a package, spec.py, mesh.py, models/) -> its files."""
    composer = ROOT / "composer"
    out = {p.parent.name: sorted(p.parent.rglob("*.py")) for p in composer.glob("*/__init__.py")}
    out.update({p.stem: [p] for p in composer.glob("*.py") if p.stem not in TOP})
    out["models"] = sorted((ROOT / "models").rglob("*.py"))
    return out


def rule_file(unit: str) -> Path:
    if unit == "models":
        return ROOT / "models" / "__init__.py"
    package = ROOT / "composer" / unit / "__init__.py"
    return package if package.is_file() else ROOT / "composer" / f"{unit}.py"


def allowed(unit: str) -> set[str]:
    """The units ``unit``'s docstring says it may import."""
    doc = ast.get_docstring(ast.parse(rule_file(unit).read_text())) or ""
    found = IMPORTS.search(doc)
    assert found, f"{rule_file(unit).relative_to(ROOT)}: its docstring ends without 'Imports: ...'"
    words = " ".join(found.group(1).split()).rstrip(".")
    return set() if words == "nothing of composer" else set(words.split(", "))


def imported_units(path: Path) -> set[tuple[str, int]]:
    """(unit, line) of every composer import in ``path``, function-level ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + ([f"composer.{a.name}" for a in node.names]
                                     if node.module == "composer" else [])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "composer" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


def floors() -> dict[str, int]:
    text = PAGE.read_text()
    block = text[text.index("<!-- floors -->"):text.index("<!-- /floors -->")]
    return {name.strip(): int(number) for number, names in
            re.findall(r"^(\d+)\. (.+)$", block, re.M) for name in names.split(",")}


def test_the_documented_tree_is_the_code():
    entries, code = documented(), in_code()
    assert code - entries == set(), "in composer/ but not in docs/architecture.md's tree"
    assert {e for e in entries if e.startswith("composer/")} - code == set(), \
        "in docs/architecture.md's tree but not in composer/"
    beside = {e for e in entries if not e.startswith("composer/")}
    assert all((ROOT / e).is_dir() for e in beside), sorted(e for e in beside
                                                            if not (ROOT / e).is_dir())
    folders = {f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
               and p.name not in ("composer", "outputs", "build", "dist")
               and not p.name.endswith(".egg-info") and p.name != "__pycache__"}
    tests = {f"tests/{p.name}/" for p in (ROOT / "tests").iterdir()
             if p.is_dir() and p.name != "__pycache__"}
    assert (folders - {"tests/"}) | tests == beside


@pytest.mark.parametrize("unit", sorted(units()))
def test_every_import_keeps_to_its_packages_rule(unit):
    may = allowed(unit) | {unit}
    if unit == "models":
        may.add("models")
    wrong = [f"{path.relative_to(ROOT)}:{line} imports composer.{name}"
             for path in units()[unit] for name, line in imported_units(path)
             if name not in may and name not in TOP]
    assert not wrong, f"{unit} may import only {sorted(allowed(unit))}:\n" + "\n".join(wrong)


def test_the_rules_make_the_documented_floors():
    """Each unit sits on the page's floor list, and each may import only lower floors:
    the import graph has no cycle and no arrow back up."""
    levels = floors()
    assert set(levels) == set(units()), "docs/architecture.md's floors list every unit once"
    up = [f"{unit} (floor {levels[unit]}) may import {other} (floor {levels[other]})"
          for unit in units() for other in allowed(unit) if levels[other] >= levels[unit]]
    assert not up, "\n".join(up)


def test_the_scan_sees_each_way_of_importing(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import composer.parallel.stages\nfrom composer import torch_compat\n"
                    "def f():\n    from composer.trainer.loss import loss_sum\n"
                    "import torch\nfrom composer.job import plan\n")
    assert {name for name, _ in imported_units(path)} == {"parallel", "torch_compat", "trainer",
                                                          "job"}
