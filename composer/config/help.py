"""What the configuration and the extension points say about themselves: the command
line's ``--help`` and the two generated reference pages.

    composer-train --help              the usage and the config sections
    composer-train --help lora         one section's keys: type, default, allowed, help
    python -m composer.config.help --write docs

The last writes ``docs/configuration.md`` (every section's keys, from the fields'
metadata) and ``docs/extension_hooks.md`` (the docstrings of what a user plugs in), so
that the pages cannot drift from the code; ``tests/test_help.py`` fails when they do.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from composer import fault_tolerance, observe  # noqa: F401 (register their sections)
from composer.config.parse import import_plugins
from composer.config.schema import JobConfig, register_section, sections
from composer.converters.base import CheckpointPolicy, Converter, CostHints, register_converter
from composer.models import register_model
from composer.observe.base import Observer, RunView, StepInfo, register_observer
from composer.spec import Adapters, ModelSpec, ParallelHooks, StateDictAdapter, TrainingHooks

USAGE = """\
usage: composer-train --config FILE|NAME [--section.key VALUE ...]
       composer-train --nproc N [torchrun options] --config FILE|NAME [--section.key VALUE ...]
       composer-train --config FILE|NAME [...] --print-config | --validate [--cluster NAME|FILE]
       WORLD_SIZE=N composer-train --config FILE|NAME [...] --dry-run [--json]
       composer-train --help [SECTION]

Train a model on the job a TOML file describes ([section] tables of key = value).
Any key is overridden on the command line as --section.key VALUE (also
--section.key=VALUE; a bare --section.key sets a flag to true), e.g.
--training.steps 1000 --parallelism.tensor_parallel_degree 2.
`python -m composer.train` takes the same arguments.

  --config FILE|NAME  the job's TOML file, or a shipped config's name (debug_model,
                      llama3_8b, ...); keys it leaves out keep their defaults
  --nproc N           start N ranks on this machine (torch's launcher, in this
                      process; torchrun's options such as --nnodes, --rdzv-backend,
                      --rdzv-endpoint, --rdzv-id pass through): a config error or a
                      fault is one line, Ctrl-C exits 130, SIGTERM saves and exits 143
  --print-config      print the whole job, defaults included, as TOML, and exit
  --validate          check the job for WORLD_SIZE ranks, log the planner's
                      prediction for [planner] cluster (or --cluster), and exit
  --dry-run           build one rank of a WORLD_SIZE world on fake tensors, run one
                      step, print its memory and communication beside the planner's
                      prediction (--json: as JSON; --dry-run-rank R: that rank)
  --help [SECTION]    this text, or the keys of SECTION
"""


def known_sections() -> dict[str, Any]:
    """The sections by name: the built-in ones in their order, then the registered ones
    by name (their registration order depends on what was imported first)."""
    known = sections(JobConfig())
    builtin = [f.name for f in dataclasses.fields(JobConfig) if f.name != "components"]
    return {name: known[name] for name in builtin + sorted(set(known) - set(builtin))}


def _plain(text: str) -> str:
    return text.replace("``", "")


def description(section: Any) -> str:
    """The first paragraph of the section dataclass's docstring, on one line."""
    doc = type(section).__doc__ or ""
    if doc.startswith(type(section).__name__ + "("):  # @dataclass's stand-in: no docstring
        return f"(registered by {type(section).__module__})"
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _toml(value: Any) -> str:
    return json.dumps(value)  # a TOML literal for the values config keys hold


def default(f: dataclasses.Field) -> str:
    missing = f.default is dataclasses.MISSING
    return _toml(f.default_factory() if missing else f.default)


def allowed(f: dataclasses.Field) -> str:
    """What the parser lets through, from the metadata of ``choice``, ``bounded``, ``listed``."""
    meta = f.metadata
    if "choices" in meta:
        return "one of " + ", ".join(_toml(c) for c in meta["choices"])
    if meta.get("items"):
        return "entries from " + ", ".join(_toml(c) for c in meta["items"])
    low, high = meta.get("low"), meta.get("high")
    if low is None and high is None:
        return ""
    span = f"{low}..{high}" if low is not None and high is not None else (
        f">= {low}" if low is not None else f"<= {high}")
    return span + "".join(f" or {_toml(a)}" for a in meta.get("also", ()))


def keys(section: Any) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, allowed, help) of each key of ``section``."""
    return [(f.name, str(f.type), default(f), allowed(f), f.metadata.get("help", ""))
            for f in dataclasses.fields(section)]


def overview() -> str:
    """The usage and every section, one line each."""
    known = known_sections()
    width = max(map(len, known)) + 2
    lines = [USAGE, "sections (--help SECTION lists its keys):"]
    lines += [f"  {name:<{width}}{_plain(description(s))}".rstrip() for name, s in known.items()]
    return "\n".join(lines) + "\n"


def section_help(name: str) -> str:
    """The keys of section ``name``, each with its type, default, allowed values and help."""
    section = known_sections()[name]
    lines = [f"[{name}]  {_plain(description(section))}".rstrip(), ""]
    for key, kind, value, allow, text in keys(section):
        lines.append(f"  {name}.{key}  ({kind}, default {value})")
        for line in (f"allowed: {allow}" if allow else "", text):
            lines += textwrap.wrap(line, 80, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") or a.startswith("--help=") for a in argv)


def print_help(argv: list[str]) -> int:
    """``--help`` (the usage and the sections) or ``--help SECTION`` (its keys) on stdout,
    returning 0; an unknown section is one line on stderr and 2."""
    i = next(i for i, a in enumerate(argv) if wants_help([a]))
    name = argv[i].partition("=")[2] or (
        argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else "")
    if not name:
        print(overview(), end="")
        return 0
    if name not in known_sections():
        print(f"error: --help {name}: no such section; sections are: "
              f"{', '.join(known_sections())}", file=sys.stderr)
        return 2
    print(section_help(name), end="")
    return 0


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def configuration_markdown() -> str:
    """docs/configuration.md: every key of composer's own sections (a plugin's are its
    own to document)."""
    lines = ["# Configuration reference", "",
             "Generated from the config dataclasses' field metadata by "
             "`python -m composer.config.help --write docs`; do not edit by hand.", "",
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
             "Generated from the docstrings by `python -m composer.config.help --write docs`; "
             "do not edit by hand. What a model of your own, a converter, an observer or a "
             "plugin implements or calls; `docs/public_api.md` lists the library functions.",
             ""]
    for title, objects in HOOKS:
        lines += [f"## {title}", ""]
        for obj in objects:
            lines += _entry(obj)
    return "\n".join(lines)


PAGES = {"configuration.md": configuration_markdown, "extension_hooks.md": hooks_markdown}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m composer.config.help",
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
