"""The one output of a benchmark: a markdown table whose columns put each measured figure
beside its reference (a plain PyTorch loop, the analytic minimum, the planner's
prediction, a published run), or, with ``--json``, the same rows for machines.

    args = bench_parser(__doc__).parse_args(argv)
    emit(rows, ["layout", "measured s", "predicted s", "ratio"], args.json)
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence, TextIO


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose description is the benchmark's docstring, with ``--json``."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true",
                        help="print the rows as JSON (one list of objects) instead of the table")
    return parser


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}" if value == 0 or abs(value) >= 0.001 else f"{value:.3e}"
    return str(value)


def markdown(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """``rows`` as a markdown table of ``columns`` (a missing value is ``-``)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def emit(rows: Sequence[dict], columns: Sequence[str], as_json: bool,
         out: TextIO | None = None) -> None:
    """Print ``rows``: the table of ``columns``, or every key of every row as JSON."""
    out = out or sys.stdout
    if as_json:
        print(json.dumps(list(rows), indent=1, default=str), file=out)
    else:
        print(markdown(rows, columns), file=out)


def emit_tables(tables: Sequence[tuple[str, Sequence[dict], Sequence[str]]],
                as_json: bool) -> None:
    """Several tables, each (heading, rows, columns): one after the other, or with
    ``as_json`` every row of every table in one list."""
    if as_json:
        emit([row for _, rows, _ in tables for row in rows], [], True)
        return
    for i, (heading, rows, columns) in enumerate(tables):
        print(("\n" if i else "") + heading)
        emit(rows, columns, False)
