"""Where documents come from: the built-in corpus, local files and hub datasets
(through ``datasets``), and which of them are held out for validation."""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

IGNORE_INDEX = -100  # a target the loss skips (and does not count)


def document_starts(tokens: list) -> list[bool]:
    """True at a document's (or packed example's) first token, False after it."""
    return [True] + [False] * (len(tokens) - 1)


def carries_documents(format: str, sft_packing: bool, document_mask: bool) -> bool:
    """Whether windows carry document boundaries: ``document_mask`` on a format
    that packs (text, tokens, or SFT with ``sft_packing``; a padded SFT window holds
    one example)."""
    return document_mask and (format in ("text", "tokens") or sft_packing)


class Cursor:
    """A read position over windows that repeat every ``windows_per_epoch`` (a new epoch
    starts over): seeking is free, reads move it on."""

    windows_per_epoch: int
    position: int = 0

    @property
    def epoch(self) -> int:
        return self.position // self.windows_per_epoch

    def seek(self, position: int) -> None:
        self.position = position


BUILTIN_DATASET = "tinyshakespeare"
_BUILTIN_FILE = Path(__file__).parent / "assets" / "tinyshakespeare.txt"
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# the samples composer ships, found by name where no local path has it (the shipped
# LoRA configs read sft_tiny): 300 prompt/response rows; 120 prompt/chosen/rejected pairs
SAMPLES = {name: Path(__file__).parent / "assets" / f"{name}.jsonl"
           for name in ("sft_tiny", "preference_tiny")}


def _datasets():
    """Hugging Face ``datasets``, imported on first use: it costs every rank about
    a second of start-up, and the built-in corpus does not need it."""
    import datasets

    # Each load_dataset call otherwise sends a HEAD request to count a download, even
    # for local files; offline, its DNS lookup alone can block a rank for seconds.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    # Its messages go to the run's log (stdout, rank-prefixed), not straight to
    # stderr: a fault's one line must be all that stderr shows.
    own = logging.getLogger("datasets")
    for handler in list(own.handlers):
        own.removeHandler(handler)
    own.propagate = True
    return datasets


@dataclass
class Documents:
    """The texts of a dataset, re-iterable from the start (one pass per epoch).

    ``local`` says the dataset is a finite local one, small enough to hold
    tokenized in memory; a hub dataset may be endless and is walked instead.
    """

    texts: Callable[[], Iterable[str]]  # a new pass over the texts at each call
    local: bool

    def __iter__(self) -> Iterator[str]:
        return iter(self.texts())


@functools.cache
def builtin_paragraphs() -> tuple[str, ...]:
    """The built-in corpus, one document per paragraph: exactly the rows of
    ``datasets``' text builder with ``sample_by="paragraph"`` (split at blank
    lines, empty pieces dropped), read without importing it."""
    with open(_BUILTIN_FILE, encoding="utf-8") as f:
        return tuple(p for p in f.read().split("\n\n") if p)


def load_documents(dataset: str, text_field: str = "text") -> Documents:
    """The built-in corpus, a local .txt/.json/.jsonl/.parquet file or folder, or a hub name.

    Everything but the built-in corpus is read through ``datasets`` with
    ``streaming=True``: no arrow cache is written, so many ranks can read the same
    files at once without racing or waiting on a lock.
    """
    rows, local = open_rows(dataset)
    check_columns(dataset, [(text_field,)], f"text field {text_field!r}", rows)
    if dataset == BUILTIN_DATASET:
        return Documents(builtin_paragraphs, local)
    rows = rows.select_columns([text_field])
    return Documents(lambda: (t for batch in rows.iter(batch_size=1024) for t in batch[text_field]),
                     local)


def check_columns(dataset: str, wanted: list[tuple[str, ...]], what: str, rows: Any = None) -> None:
    """ValueError unless the dataset opens and has all the columns of one of the
    ``wanted`` sets (``what`` names them); reads at most its first row."""
    rows = open_rows(dataset)[0] if rows is None else rows
    columns = _column_names(rows, dataset)
    if not any(set(names) <= set(columns) for names in wanted):
        raise ValueError(f"dataset {dataset!r} has no {what}; its columns are {columns}")


def open_rows(dataset: str) -> tuple[Any, bool]:
    if dataset == BUILTIN_DATASET:
        return [{"text": text} for text in builtin_paragraphs()], True
    files = _local_files(dataset)
    if files is not None:
        return _load_local(_builder_for(files, dataset), files, dataset), True
    try:
        return _datasets().load_dataset(dataset, split="train", streaming=True), False
    except (ConnectionError, FileNotFoundError) as e:
        raise ValueError(
            f"dataset {dataset!r} is neither {BUILTIN_DATASET!r} nor a local file or folder,"
            f" and loading it from the Hugging Face hub failed: {e}"
        ) from e


def _load_local(builder: str, files: list[Path], dataset: str) -> Any:
    # One document per paragraph: lines alone would cut sentences and dialogue apart.
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        return _datasets().load_dataset(
            builder, data_files=[str(f) for f in files], split="train", streaming=True, **options
        )
    except StopIteration:  # the json builder peeks at the first row to find the columns
        raise ValueError(f"dataset {dataset!r} is empty") from None


def _local_files(dataset: str) -> list[Path] | None:
    """The data files a local dataset names, or None when it names no local path."""
    path = Path(dataset).expanduser()
    if path.is_file():
        return [path]
    if dataset in SAMPLES and not path.exists():
        return [SAMPLES[dataset]]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS)
        if not files:
            raise ValueError(f"dataset folder {dataset!r} holds no {'/'.join(_BUILDERS)} files")
        return files
    if _looks_like_path(dataset):
        raise ValueError(f"dataset path {dataset!r} does not exist")
    return None


def _looks_like_path(dataset: str) -> bool:
    # Hub names are "name" or "owner/name"; anything else path-shaped is a typo'd path.
    return (
        dataset.startswith(("/", ".", "~"))
        or dataset.count("/") > 1
        or Path(dataset).suffix in _BUILDERS
    )


def _builder_for(files: list[Path], dataset: str) -> str:
    builders = {_BUILDERS.get(f.suffix) for f in files}
    if len(builders) != 1 or None in builders:
        kinds = ", ".join(sorted({f.suffix or "(no suffix)" for f in files}))
        raise ValueError(
            f"dataset {dataset!r}: cannot read {kinds} files; use one kind of"
            " .txt, .json/.jsonl or .parquet"
        )
    return builders.pop()


def _column_names(rows: Any, dataset: str) -> list[str]:
    if getattr(rows, "column_names", None) is not None:
        return list(rows.column_names)
    first = next(iter(rows), None)
    if first is None:
        raise ValueError(f"dataset {dataset!r} is empty")
    return list(first)


def is_validation_document(index: int, val_fraction: float) -> bool:
    """Spreads held-out documents evenly: exactly floor(n * f) of the first n."""
    return math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)


def split_name(dataset: str, split: str, val_fraction: float) -> str:
    return f"the {split} split of dataset {dataset!r} (val_fraction={val_fraction})"


def check_one_window(num_tokens: int, width: int, what: str) -> None:
    if num_tokens == 0:
        raise ValueError(f"{what} is empty")
    if num_tokens < width:
        raise ValueError(
            f"{what} has {num_tokens} tokens, fewer than one window of seq_len + 1 = {width}"
        )
