"""What training reads, before a run is paid for: each example's text, its tokens and
which of them the loss learns.

    python -m composer.tools.inspect_data --config F [overrides] [--rows N] [--json]

The config and overrides are training's (``data.*`` decides what is read). For
``data.format = "sft"`` an example is a dataset row as the trainer tokenizes it (the
tokenizer's chat template, or the built-in one); for ``"preference"`` each pair gives two,
its chosen answer's sequence, then its rejected one's; for ``"text"`` a document, every
token of it learned, and for ``"tokens"`` a document of the token file, as written.
``--rows N``: the first N examples (default 3). Plain output shows each example's text,
then its tokens with the learned ones marked ``[...]``; ``--json``
prints one object per example: ``{"tokens": [...], "learn": [0 or 1, ...], "text":
...}``. Bad input is one line and exit 2.
"""
from __future__ import annotations

import itertools
import json
import sys
from typing import Any, Iterator

from composer.config import ConfigError, parse_args
from composer.data import build_tokenizer, load_documents, set_chat_template
from composer.data.loader import document_tokens
from composer.data.preference import pair_tokens
from composer.data.sft import example_tokens, parse_columns
from composer.data.sources import open_rows
from composer.data.tokens import file_documents

USAGE = "usage: python -m composer.tools.inspect_data --config F [overrides] [--rows N] [--json]"


def examples(cfg, tokenizer: Any) -> Iterator[tuple[list[int], list[int]]]:
    """(tokens, learn mask) of each example in the dataset's order, as training reads it."""
    d = cfg.data
    if d.format in ("sft", "preference"):
        rows, _ = open_rows(d.dataset)
        columns = parse_columns(d.columns)
        for index, row in enumerate(rows):
            try:
                yield from (pair_tokens(row, tokenizer) if d.format == "preference"
                            else [example_tokens(row, tokenizer, columns)])
            except ValueError as e:
                raise ValueError(f"dataset {d.dataset!r}, row {index} (from 0): {e}") from None
        return
    ids = (file_documents(d.dataset) if d.format == "tokens"
           else document_tokens(load_documents(d.dataset, d.text_field), tokenizer))
    yield from ((tokens, [1] * len(tokens)) for tokens in ids)


def shown(tokens: list[int], learn: list[int], tokenizer: Any) -> str:
    """The tokens decoded one by one, each learned stretch in brackets."""
    out = []
    for learned, run in itertools.groupby(zip(tokens, learn), key=lambda pair: pair[1]):
        text = "".join(repr(_piece(t, tokenizer))[1:-1] for t, _ in run)
        out.append(f"[{text}]" if learned else text)
    return "".join(out)


def _piece(token: int, tokenizer: Any) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _option(argv: list[str], name: str, default: str | None) -> str | None:
    if name in argv:
        i = argv.index(name)
        if i + 1 >= len(argv):
            raise ConfigError(f"{name} needs a value")
        value = argv[i + 1]
        del argv[i:i + 2]
        return value
    return default


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    try:
        rows = _option(argv, "--rows", "3")
        if not rows.isdigit() or int(rows) < 1:
            raise ConfigError(f"--rows {rows}: allowed: a whole number from 1")
        cfg, _ = parse_args(argv)
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        set_chat_template(tokenizer, cfg.data.chat_template)
        for tokens, learn in itertools.islice(examples(cfg, tokenizer), int(rows)):
            text = tokenizer.decode(tokens, skip_special_tokens=False)
            if as_json:
                print(json.dumps({"tokens": tokens, "learn": learn, "text": text},
                                 ensure_ascii=False))
            else:
                print(f"--- {len(tokens)} tokens, {sum(learn)} learned\n{text}\n"
                      f"{shown(tokens, learn, tokenizer)}")
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
