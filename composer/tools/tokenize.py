"""A corpus tokenised once into a token file, which ``data.format = "tokens"`` trains from
memory-mapped (docs/token_files.md).

    python -m composer.tools.tokenize --dataset D --tokenizer T --out FOLDER [--text-field F]

``--dataset`` and ``--text-field`` take what ``data.dataset`` and ``data.text_field`` take
(default tinyshakespeare, text), ``--tokenizer`` what ``data.tokenizer`` takes (default
byte). Each document is packed as the text path packs it (bos, its tokens, eos), so
training from the file sees the same windows. Documents stream through a chunk at a time,
so memory stays bounded whatever the corpus's size. ``--out`` must not exist or be empty;
the folder appears only once complete. Prints one line: tokens, documents, bytes, seconds.
Bad input is one line on stderr and exit 2.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from composer.data.loader import document_tokens
from composer.data.sources import load_documents
from composer.data.tokenizer import build_tokenizer
from composer.data.tokens import tokenizer_name, write_token_file

USAGE = ("usage: python -m composer.tools.tokenize --dataset D --tokenizer T --out FOLDER "
         "[--text-field F]")
DEFAULTS = {"--dataset": "tinyshakespeare", "--tokenizer": "byte", "--out": None,
            "--text-field": "text"}


def parse_options(argv: list[str]) -> dict[str, str]:
    """``--name value`` or ``--name=value`` for each known option; ValueError otherwise."""
    options, rest = dict(DEFAULTS), list(argv)
    while rest:
        name, _, value = rest.pop(0).partition("=")
        if name not in DEFAULTS:
            raise ValueError(f"unknown argument {name!r}; {USAGE}")
        if not value:
            if not rest:
                raise ValueError(f"{name} needs a value")
            value = rest.pop(0)
        options[name] = value
    if options["--out"] is None:
        raise ValueError(f"--out is required; {USAGE}")
    return options


def check_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} exists and is not an empty folder")


def tokenize(options: dict[str, str]) -> str:
    """Writes the token file; its one-line summary."""
    out, dataset = Path(options["--out"]).expanduser(), options["--dataset"]
    check_out(out)
    try:
        tokenizer = build_tokenizer(options["--tokenizer"])
    except ValueError as e:
        raise ValueError(f"--tokenizer {options['--tokenizer']!r}: {e}") from None
    start = time.perf_counter()
    try:
        documents = load_documents(dataset, options["--text-field"])
        source = str(Path(dataset).resolve()) if Path(dataset).exists() else dataset
        meta = write_token_file(document_tokens(documents, tokenizer), out, {
            "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer_name(tokenizer),
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
            "source": {"dataset": source, "text_field": options["--text-field"]}})
    except ValueError as e:
        raise ValueError(f"--dataset {dataset!r}: {e}") from None
    seconds = time.perf_counter() - start
    size = sum((out / name).stat().st_size for name in ("tokens.bin", "offsets.bin"))
    return (f"{out}: {meta['num_tokens']} tokens ({meta['dtype']}), {meta['num_documents']} "
            f"documents, {size} bytes, {seconds:.2f} s "
            f"({meta['num_tokens'] / max(seconds, 1e-9):,.0f} tokens/s)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    try:
        print(tokenize(parse_options(argv)))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
