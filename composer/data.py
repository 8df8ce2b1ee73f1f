"""Tokenizers, documents and the packed, rank-sharded, resumable token stream.

Every data-parallel rank walks the same global stream of windows and takes its
own slice of each global batch, so any parallel layout trains on exactly the
batches of the single-process run, and a resumed run continues where the
interrupted one stopped.
"""
from __future__ import annotations

import functools
import math
from array import array
from dataclasses import dataclass
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

IGNORE_INDEX = -100  # a target the loss skips (and does not count)
BUILTIN_DATASET = "tinyshakespeare"
_BUILTIN_FILE = Path(__file__).parent / "assets" / "tinyshakespeare.txt"
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
_SPLITS = ("train", "validation")
_FORMATS = ("text", "sft")


def _datasets():
    """Hugging Face ``datasets``, imported on first use: it costs every rank about
    a second of start-up, and the built-in corpus does not need it."""
    import datasets

    # Each load_dataset call otherwise sends a HEAD request to count a download, even
    # for local files; offline, its DNS lookup alone can block a rank for seconds.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus a bos and an eos id."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``, through the ``tokenizers`` package."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(
                "loading a tokenizer.json needs the 'tokenizers' package: pip install tokenizers"
            ) from e
        self._tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.bos_id = self._first_token_id(_BOS_NAMES)
        self.eos_id = self._first_token_id(_EOS_NAMES)

    def _first_token_id(self, names: tuple[str, ...]) -> int | None:
        ids = (self._tokenizer.token_to_id(name) for name in names)
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        # Packing adds bos/eos itself; the tokenizer's own template would double them.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


def build_tokenizer(name: str) -> ByteTokenizer | HFTokenizer:
    """"byte", a tokenizer.json file, or a directory holding one."""
    if name == "byte":
        return ByteTokenizer()
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file() and path.suffix == ".json":
        return HFTokenizer(path)
    raise ValueError(
        f"tokenizer {name!r} is neither 'byte' nor the path of a tokenizer.json"
        " (or of a directory holding one)"
    )


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
    rows, local = _open_rows(dataset)
    columns = _column_names(rows, dataset)
    if text_field not in columns:
        raise ValueError(
            f"dataset {dataset!r} has no text field {text_field!r}; its columns are {columns}"
        )
    if dataset == BUILTIN_DATASET:
        return Documents(builtin_paragraphs, local)
    rows = rows.select_columns([text_field])
    return Documents(lambda: (t for batch in rows.iter(batch_size=1024) for t in batch[text_field]),
                     local)


def _open_rows(dataset: str) -> tuple[Any, bool]:
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


def _document_tokens(
    documents: Documents, tokenizer: Any, validation: bool, val_fraction: float
) -> Iterator[list[int]]:
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    for index, text in enumerate(documents):
        if is_validation_document(index, val_fraction) == validation:
            yield bos + tokenizer.encode(text) + eos


def split_name(dataset: str, split: str, val_fraction: float) -> str:
    return f"the {split} split of dataset {dataset!r} (val_fraction={val_fraction})"


def _check_one_window(num_tokens: int, width: int, what: str) -> None:
    if num_tokens == 0:
        raise ValueError(f"{what} is empty")
    if num_tokens < width:
        raise ValueError(
            f"{what} has {num_tokens} tokens, fewer than one window of seq_len + 1 = {width}"
        )


class _MemoryWindows:
    """The windows of a finite dataset, tokenized once: seeking is free.

    ``learned`` (bool, like the windows) marks the tokens the loss may take as
    targets; the rest are IGNORE_INDEX in the labels. Text learns every token.
    """

    def __init__(self, windows: torch.Tensor, learned: torch.Tensor | None = None):
        self.windows_per_epoch = len(windows)
        self._windows = windows
        self._labels = windows if learned is None else windows.masked_fill(~learned, IGNORE_INDEX)
        self.position = 0

    @property
    def epoch(self) -> int:
        return self.position // self.windows_per_epoch

    def seek(self, position: int) -> None:
        self.position = position

    def read(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) of the next ``count`` windows."""
        rows = torch.arange(self.position, self.position + count) % self.windows_per_epoch
        self.position += count
        return self._windows[rows].long(), self._labels[rows].long()


class _StreamWindows:
    """The windows of a dataset too large to hold, read in order from its documents.

    Invariant: the buffer always holds window ``position``, so ``epoch`` is the
    epoch of the next window, as for the in-memory source.
    """

    def __init__(self, token_docs: Callable[[], Iterator[list[int]]], width: int, what: str):
        self._token_docs = token_docs
        self._width = width
        self._what = what
        self._rewind()

    def _rewind(self) -> None:
        self._docs = self._token_docs()
        self._buffer: list[int] = []
        self._start = 0
        self.position = 0
        self.epoch = 0
        self._epoch_start = 0
        self._fill()

    def _fill(self) -> None:
        while len(self._buffer) - self._start < self._width:
            doc = next(self._docs, None)
            if doc is not None:
                self._buffer = self._buffer[self._start :] + doc
                self._start = 0
            elif self.position == self._epoch_start:  # a whole pass without one window
                _check_one_window(len(self._buffer), self._width, self._what)
            else:
                # The tail shorter than a window is dropped, as the in-memory source does.
                self._docs = self._token_docs()
                self._buffer, self._start = [], 0
                self.epoch += 1
                self._epoch_start = self.position

    def _next_window(self) -> list[int]:
        window = self._buffer[self._start : self._start + self._width]
        self._start += self._width
        self.position += 1
        self._fill()
        return window

    def seek(self, position: int) -> None:
        if position < self.position:
            self._rewind()
        while self.position < position:
            self._next_window()

    def read(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = torch.tensor([self._next_window() for _ in range(count)], dtype=torch.int64)
        return windows, windows


class DataLoader:
    """Batches of packed windows for one data-parallel rank.

    Windows are dealt in rounds of ``local_batch_size * dp_degree``: in round k
    rank r takes windows ``k*L*D + r*L`` to ``k*L*D + r*L + L - 1``. So the
    global batch, and hence the loss, is the same for every parallel layout.
    ``windows_consumed`` counts windows of all ranks; ``epoch`` is the number
    of completed passes over the split at that position.

    ``format`` "sft" reads prompt/response or chat examples (composer.sft) whose
    prompt targets are IGNORE_INDEX; ``text_field`` then plays no part.
    """

    def __init__(
        self,
        dataset: str,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        split: str = "train",
        val_fraction: float = 0.05,
        text_field: str = "text",
        format: str = "text",
        sft_packing: bool = False,
    ):
        _check_arguments(
            seq_len, local_batch_size, dp_rank, dp_degree, split, val_fraction, format
        )
        self.tokenizer = build_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.split = split
        self.windows_consumed = 0
        if format == "sft":
            from composer.sft import sft_windows  # composer.sft builds on this module

            self._windows = _MemoryWindows(*sft_windows(
                dataset, self.tokenizer, seq_len + 1, split, val_fraction, sft_packing
            ))
        else:
            self._windows = _text_windows(
                dataset, self.tokenizer, seq_len + 1, split, val_fraction, text_field
            )

    @property
    def epoch(self) -> int:
        return self._windows.epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [local_batch_size, seq_len], targets shifted by one."""
        batch_size = self.local_batch_size
        self._windows.seek(self.windows_consumed + self.dp_rank * batch_size)
        windows, labels = self._windows.read(batch_size)
        self.windows_consumed += batch_size * self.dp_degree
        self._windows.seek(self.windows_consumed)
        return windows[:, :-1].contiguous(), labels[:, 1:].contiguous()

    def reset(self) -> None:
        """Back to the first batch, so each evaluation reads the same validation batches."""
        self.windows_consumed = 0
        self._windows.seek(0)

    def state_dict(self) -> dict[str, int]:
        return {"windows_consumed": self.windows_consumed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seq_len"] != self.seq_len:
            raise ValueError(
                f"data checkpoint was written with seq_len {state['seq_len']}, this run has"
                f" {self.seq_len}; its window position would point elsewhere"
            )
        self.windows_consumed = int(state["windows_consumed"])
        self._windows.seek(self.windows_consumed)


def _text_windows(
    dataset: str, tokenizer: Any, width: int, split: str, val_fraction: float, text_field: str
) -> _MemoryWindows | _StreamWindows:
    """The documents' tokens end to end, cut into windows; the short tail is dropped."""
    documents = load_documents(dataset, text_field)
    validation = split == "validation"
    token_docs = partial(_document_tokens, documents, tokenizer, validation, val_fraction)
    what = split_name(dataset, split, val_fraction)
    if not documents.local:
        return _StreamWindows(token_docs, width, what)
    # array('i') keeps the stream at 4 bytes a token while it grows, not a list's ~36.
    tokens = array("i", chain.from_iterable(token_docs()))
    _check_one_window(len(tokens), width, what)
    flat = torch.frombuffer(tokens, dtype=torch.int32)
    return _MemoryWindows(flat[: len(tokens) // width * width].view(-1, width))


def _check_arguments(
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    split: str,
    val_fraction: float,
    format: str,
) -> None:
    if seq_len < 1:
        raise ValueError(f"data.seq_len = {seq_len}: must be at least 1")
    if local_batch_size < 1:
        raise ValueError(f"local_batch_size = {local_batch_size}: must be at least 1")
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_degree - 1} (dp_degree {dp_degree})")
    if split not in _SPLITS:
        raise ValueError(f"split = {split!r}: expected one of {_SPLITS}")
    if format not in _FORMATS:
        raise ValueError(f"format = {format!r}: expected one of {_FORMATS}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction = {val_fraction}: must be in [0, 1)")
