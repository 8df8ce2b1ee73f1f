"""The packed, rank-sharded, resumable token stream.

Every data-parallel rank walks the same global stream of windows and takes its
own slice of each global batch, so any parallel layout trains on exactly the
batches of the single-process run, and a resumed run continues where the
interrupted one stopped.
"""
from __future__ import annotations

from array import array
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from composer.data import preference, sft
from composer.data.sft import sft_windows
from composer.data.sources import (
    BUILTIN_DATASET,
    IGNORE_INDEX,
    Cursor,
    carries_documents,
    check_columns,
    check_one_window,
    document_starts,
    is_validation_document,
    load_documents,
    split_name,
)
from composer.data.tokenizer import build_tokenizer
from composer.data.tokens import PackedWindows, read_meta, token_windows

_SPLITS = ("train", "validation")
_FORMATS = ("text", "sft", "preference", "tokens")


def document_tokens(documents: Iterable[str], tokenizer: Any,
                    keep: Callable[[int], bool] = lambda index: True) -> Iterator[list[int]]:
    """Each kept document's tokens as packing lays them out: bos, its text, eos."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    for index, text in enumerate(documents):
        if not isinstance(text, str):  # a json row without the text field reads as None
            raise ValueError(f"row {index} (from 0): its text is {text!r}, not a string")
        if keep(index):
            yield bos + tokenizer.encode(text) + eos


def _in_split(validation: bool, val_fraction: float, index: int) -> bool:
    return is_validation_document(index, val_fraction) == validation


class _MemoryWindows(Cursor):
    """The windows of a finite dataset, tokenized once: seeking is free.

    ``learned`` (bool, like the windows) marks the tokens the loss may take as
    targets; the rest are IGNORE_INDEX in the labels.
    ``starts`` (bool, like the windows, or None) marks each document's first token.
    """

    def __init__(self, windows: torch.Tensor, learned: torch.Tensor | None = None,
                 starts: torch.Tensor | None = None):
        self.windows_per_epoch = len(windows)
        self._windows = windows
        self._labels = windows if learned is None else windows.masked_fill(~learned, IGNORE_INDEX)
        self._starts = starts
        self.position = 0

    def read(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens, labels, document starts or None) of the next ``count`` windows."""
        rows = torch.arange(self.position, self.position + count) % self.windows_per_epoch
        self.position += count
        starts = None if self._starts is None else self._starts[rows]
        return self._windows[rows].long(), self._labels[rows].long(), starts


class _StreamWindows:
    """The windows of a dataset too large to hold, read in order from its documents.

    Invariant: the buffer always holds window ``position``, so ``epoch`` is the
    epoch of the next window, as for the in-memory source.
    """

    def __init__(self, token_docs: Callable[[], Iterator[list[int]]], width: int, what: str,
                 starts: bool = False):
        self._token_docs = token_docs
        self._width = width
        self._what = what
        self._track_starts = starts
        self._rewind()

    def _rewind(self) -> None:
        self._docs = self._token_docs()
        self._buffer: list[int] = []
        self._starts: list[bool] = []  # each document's first token, when tracked
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
                if self._track_starts:
                    self._starts = self._starts[self._start :] + document_starts(doc)
                self._start = 0
            elif self.position == self._epoch_start:  # a whole pass without one window
                check_one_window(len(self._buffer), self._width, self._what)
            else:
                # The tail shorter than a window is dropped, as the in-memory source does.
                self._docs = self._token_docs()
                self._buffer, self._starts, self._start = [], [], 0
                self.epoch += 1
                self._epoch_start = self.position

    def _next_window(self) -> tuple[list[int], list[bool]]:
        end = self._start + self._width
        window = self._buffer[self._start : end], self._starts[self._start : end]
        self._start = end
        self.position += 1
        self._fill()
        return window

    def seek(self, position: int) -> None:
        if position < self.position:
            self._rewind()
        while self.position < position:
            self._next_window()

    def read(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        tokens, starts = zip(*(self._next_window() for _ in range(count)))
        windows = torch.tensor(tokens, dtype=torch.int64)
        return windows, windows, torch.tensor(starts) if self._track_starts else None


class DataLoader:
    """Batches of packed windows for one data-parallel rank.

    Windows are dealt in rounds of ``local_batch_size * dp_degree``: in round k
    rank r takes windows ``k*L*D + r*L`` to ``k*L*D + r*L + L - 1``. So the
    global batch, and hence the loss, is the same for every parallel layout.
    ``windows_consumed`` counts windows of all ranks; ``epoch`` is the number
    of completed passes over the split at that position.

    ``format`` "sft" reads prompt/response or chat examples (composer.data.sft) whose
    prompt targets are IGNORE_INDEX; ``text_field`` then plays no part. ``format``
    "preference" reads pairs (composer.data.preference): the unit dealt is a pair, and
    a batch of ``local_batch_size`` pairs is their chosen sequences, then their rejected
    ones (``2 * local_batch_size`` rows, each masked as SFT masks it). ``format``
    "tokens": ``dataset`` is a token file (composer.data.tokens), memory-mapped; its
    windows are those the text path cuts from the same documents.

    ``document_mask`` carries the document boundaries of packed windows (text, tokens,
    or SFT with ``sft_packing``; a padded SFT window holds one example): each batch
    then also gives every input's document number, and a target that begins a
    new document is not trained (``documents`` says whether batches have them).
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
        document_mask: bool = False,
        streaming: bool = False,
        columns: str = "",
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
        self.documents = carries_documents(format, sft_packing, document_mask)
        if format == "preference":
            self._windows = _MemoryWindows(*preference.preference_windows(
                dataset, self.tokenizer, seq_len + 1, split, val_fraction))
        elif format == "sft":
            self._windows = _MemoryWindows(*sft_windows(
                dataset, self.tokenizer, seq_len + 1, split, val_fraction, sft_packing,
                self.documents, sft.parse_columns(columns)))
        elif format == "tokens":
            self._windows = token_windows(dataset, seq_len + 1, split, val_fraction,
                                          self.documents)
        else:
            self._windows = _text_windows(
                dataset, self.tokenizer, seq_len + 1, split, val_fraction, text_field,
                self.documents, streaming)

    @property
    def epoch(self) -> int:
        return self._windows.epoch

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """(inputs, targets), int64 [local_batch_size, seq_len], targets shifted by
        one; with ``documents``, also each input's document number (like the inputs,
        counted from 0 or 1 in each window), and a target that is a document's
        first token is IGNORE_INDEX (no token of its document came before it)."""
        batch_size = self.local_batch_size
        self._windows.seek(self.windows_consumed + self.dp_rank * batch_size)
        windows, labels, starts = self._windows.read(batch_size)
        if windows.dim() == 3:  # pairs [B, 2, W]: the B chosen windows, then the B rejected
            windows, labels = (t.transpose(0, 1).flatten(0, 1) for t in (windows, labels))
        self.windows_consumed += batch_size * self.dp_degree
        self._windows.seek(self.windows_consumed)
        inputs, targets = windows[:, :-1].contiguous(), labels[:, 1:].contiguous()
        if starts is None:
            return inputs, targets
        return inputs, targets.masked_fill(starts[:, 1:], IGNORE_INDEX), starts[:, :-1].cumsum(1)

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


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """[B, S] each position's distance from the first position of its document in
    the window (``documents`` [B, S]: each position's document number)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(first, index, 0).cummax(1).values


def _text_windows(
    dataset: str, tokenizer: Any, width: int, split: str, val_fraction: float, text_field: str,
    starts: bool = False, streaming: bool = False,
) -> PackedWindows | _StreamWindows:
    """The documents' tokens end to end, cut into windows; the short tail is dropped.
    ``starts``: also mark each document's first token; ``streaming``: read even a
    local dataset as the windows are reached, holding none of it."""
    documents = load_documents(dataset, text_field)
    validation = split == "validation"
    token_docs = partial(document_tokens, documents, tokenizer,
                         partial(_in_split, validation, val_fraction))
    what = split_name(dataset, split, val_fraction)
    if streaming or not documents.local:
        return _StreamWindows(token_docs, width, what, starts)
    identity = getattr(tokenizer, "identity", None)
    key = (identity, validation, val_fraction)
    if dataset == BUILTIN_DATASET and identity is not None:
        if key not in _BUILTIN_STREAMS:
            for other in [k for k in _BUILTIN_STREAMS if k[0] != identity]:
                del _BUILTIN_STREAMS[other]  # one tokenizer's streams at a time
            _BUILTIN_STREAMS[key] = _token_stream(token_docs())
        tokens, offsets = _BUILTIN_STREAMS[key]
    else:
        tokens, offsets = _token_stream(token_docs())
    # The split's documents alone were tokenised: the whole array is one run of it.
    return PackedWindows(tokens, offsets, np.array([[0, len(tokens)]]), width, what, starts)


# The packaged corpus's token streams, kept for the next loader of the same process
# (a launch that runs many jobs, a notebook): (tokenizer, split, fraction) ->
# (tokens, offsets). The corpus never changes; the windows only read them.
_BUILTIN_STREAMS: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def _token_stream(docs: Iterator[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The documents' tokens end to end (int32) and each one's first position (int64):
    the in-memory twin of a token file's tokens.bin and offsets.bin."""
    # array('i') keeps the stream at 4 bytes a token while it grows, not a list's ~36.
    tokens, offsets = array("i"), array("q")
    for doc in docs:
        offsets.append(len(tokens))
        tokens.extend(doc)
    return np.frombuffer(tokens, dtype=np.int32), np.frombuffer(offsets, dtype=np.int64)


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


def check_source(dataset: str, format: str, text_field: str, columns: str = "") -> None:
    """ValueError unless the dataset opens and has the fields ``format`` reads
    (its first row at most is read; nothing is tokenised). ``columns``: ``data.columns``."""
    if format == "preference":
        check_columns(dataset, [preference.FIELDS], "preference fields 'chosen' and 'rejected' "
                                                    "(and 'prompt')")
    elif format == "sft":
        named = sft.parse_columns(columns)
        wanted = [tuple(named.get(name, name) for name in form) for form in sft.COLUMNS]
        check_columns(dataset, wanted, "fine-tuning fields ('prompt' and 'response', "
                                       "'messages', 'instruction' and 'output', or "
                                       "'conversations'; data.columns names others)")
    elif format == "tokens":
        read_meta(dataset)
    else:
        check_columns(dataset, [(text_field,)], f"text field {text_field!r}")
