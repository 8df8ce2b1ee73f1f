"""The two generated reference pages, written from the code so that they cannot drift:
``docs/configuration.md`` (every section's keys, from the fields' metadata) and
``docs/extension_hooks.md`` (the docstrings of what a user plugs in).

    python -m composer.tools.reference_pages --write docs

``tests/unit/test_help.py`` fails when a committed page differs from what this writes.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

from composer import observe  # noqa: F401 (registers the observers' sections)
from composer.config.describe import description, keys, known_sections
from composer.config.parse import import_plugins
from composer.config.schema import register_section
from composer.converters.base import CheckpointPolicy, Converter, CostHints, register_converter
from composer.faults import replicas  # noqa: F401 (registers the fault_tolerance section)
from composer.models import register_model
from composer.observe.base import Observer, RunView, StepInfo, register_observer
from composer.spec import Adapters, ModelSpec, ParallelHooks, StateDictAdapter, TrainingHooks


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def configuration_markdown() -> str:
    """docs/configuration.md: every key of composer's own sections (a plugin's are its
    own to document)."""
    lines = ["# Configuration reference", "",
             "Generated from the config dataclasses' field metadata by "
             "`python -m composer.tools.reference_pages --write docs`; do not edit by hand.", "",
             "A job is a TOML file of `[section]` tables; on the command line any key is "
             "`--section.key VALUE` (`composer-train --help SECTION` prints a section's keys). "
             "*Allowed* is what the parser checks; a bad value ends the run with one line "
             "and exit status 2.", ""]
    for name, section in known_sections().items():
        if not type(section).__module__.startswith("composer."):
            continue
        lines += [f"## [{name}]", "", description(section), "",
                  "| key | type | default | allowed | help |", "|---|---|---|---|---|"]
        lines += [f"| `{key}` | {_cell(kind)} | `{value}` | {_cell(allow)} | {_cell(text)} |"
                  for key, kind, value, allow, text in keys(section)]
        lines.append("")
    return "\n".join(lines)


HOOKS = (
    ("Describe a model", (ModelSpec, ParallelHooks, TrainingHooks, Adapters, StateDictAdapter,
                          register_model)),
    ("Converters: change the model before the passes",
     (register_converter, Converter, CheckpointPolicy, CostHints)),
    ("Observers: watch the loop, add columns to its rows",
     (register_observer, Observer, RunView, StepInfo)),
    ("Config sections and plugins", (register_section, import_plugins)),
)


def _signature(fn: Any) -> str:
    """``fn``'s signature as written (annotations are text under postponed evaluation)."""
    params, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {p.annotation}"
        if p.default is not p.empty:  # a function's repr holds its address: "..."
            simple = p.default is None or isinstance(p.default, (bool, int, float, str, tuple))
            text += f" = {p.default!r}" if simple else " = ..."
        params.append(text)
    returns = inspect.signature(fn).return_annotation
    arrow = "" if returns is inspect.Signature.empty or inspect.isclass(fn) else f" -> {returns}"
    return f"{fn.__name__}({', '.join(params)}){arrow}"


def _entry(obj: Any) -> list[str]:
    """A function's signature and docstring; a class's docstring, then its own methods'."""
    head = ("class " if inspect.isclass(obj) else "") + _signature(obj)
    lines = [f"### `{obj.__module__}.{obj.__name__}`", "", "```text", head, "",
             inspect.getdoc(obj) or "", "```", ""]
    if inspect.isclass(obj) and not dataclasses.is_dataclass(obj):
        for name, member in vars(obj).items():
            fn = getattr(member, "__func__", member)
            if inspect.isfunction(fn) and not name.startswith("_") and fn.__doc__:
                lines += [f"- `{_signature(fn)}`", "",
                          textwrap.indent(inspect.getdoc(fn), "  "), ""]
    return lines


def hooks_markdown() -> str:
    """docs/extension_hooks.md: the interfaces a user plugs into, by their docstrings."""
    lines = ["# Extension hooks", "",
             "Generated from the docstrings by "
             "`python -m composer.tools.reference_pages --write docs`; do not edit by hand. "
             "What a model of your own, a converter, an observer or a plugin implements or "
             "calls; `docs/public_api.md` lists the library functions.",
             ""]
    for title, objects in HOOKS:
        lines += [f"## {title}", ""]
        for obj in objects:
            lines += _entry(obj)
    return "\n".join(lines)


PAGES = {"configuration.md": configuration_markdown, "extension_hooks.md": hooks_markdown}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m composer.tools.reference_pages",
                                     description="Write the generated reference pages.")
    parser.add_argument("--write", metavar="FOLDER", required=True,
                        help="the folder (docs) to write " + " and ".join(PAGES) + " into")
    folder = Path(parser.parse_args(argv).write)
    for page, make in PAGES.items():
        (folder / page).write_text(make())
        print(f"wrote {folder / page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
