"""The command line's ``--help``: the usage and every config section, or one section's
keys (type, default, allowed values, help).

    composer-train --help              the usage and the config sections
    composer-train --help lora         one section's keys

The reference pages generated from the same metadata: ``composer.tools.reference_pages``.
"""
from __future__ import annotations

import sys
import textwrap

from composer import observe  # noqa: F401 (registers the observers' sections)
from composer.config.describe import description, keys, known_sections, plain
from composer.faults import replicas  # noqa: F401 (registers the fault_tolerance section)

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


def overview() -> str:
    """The usage and every section, one line each."""
    known = known_sections()
    width = max(map(len, known)) + 2
    lines = [USAGE, "sections (--help SECTION lists its keys):"]
    lines += [f"  {name:<{width}}{plain(description(s))}".rstrip() for name, s in known.items()]
    return "\n".join(lines) + "\n"


def section_help(name: str) -> str:
    """The keys of section ``name``, each with its type, default, allowed values and help."""
    section = known_sections()[name]
    lines = [f"[{name}]  {plain(description(section))}".rstrip(), ""]
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
