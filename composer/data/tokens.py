"""Flat token arrays and the windows cut from them: the text path's documents tokenised
in memory, or a token file (``python -m composer.tools.tokenize``) memory-mapped, so that
training reads only the windows it reaches, whatever the corpus's size.

A token file is a folder: ``tokens.bin`` (every document's tokens end to end, uint16
where the vocabulary fits in 16 bits, else uint32), ``offsets.bin`` (each document's
first position, int64) and ``meta.json`` (VERSION, dtype, sizes, tokenizer, source).
"""
from __future__ import annotations

import json
import os
import shutil
from array import array
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from composer.data.sources import Cursor, check_one_window, split_name
from composer.data.tokenizer import ByteTokenizer

VERSION = 1
FORMAT = "composer-tokens"
_KEYS = ("dtype", "vocab_size", "tokenizer", "num_tokens", "num_documents")
_CHUNK = 1 << 22  # tokens (and documents) held at a time while writing or splitting


def tokenizer_name(tokenizer: Any) -> str:
    """How meta.json names a tokenizer: "byte", or its tokenizer.json's absolute path."""
    return "byte" if isinstance(tokenizer, ByteTokenizer) else str(Path(tokenizer.path).resolve())


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_token_file(docs: Iterable[list[int]], out: Path, meta: dict) -> dict:
    """Writes the documents' tokens into the new folder ``out`` (``meta``: vocab_size,
    tokenizer, source), a chunk at a time; the folder appears only once complete.
    Returns the whole meta.json."""
    dtype = token_dtype(meta["vocab_size"])
    temp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        with open(temp / "tokens.bin", "wb") as tokens, open(temp / "offsets.bin", "wb") as starts:
            count, documents = _write_chunks(docs, tokens, starts, dtype, meta["vocab_size"])
        if count == 0:
            raise ValueError("its documents hold no tokens")
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype, **meta,
                "num_tokens": count, "num_documents": documents}
        (temp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # an empty folder only; the tool refuses one with files in it
        temp.rename(out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return meta


def _write_chunks(docs: Iterable[list[int]], tokens, starts, dtype: str, vocab: int
                  ) -> tuple[int, int]:
    """(tokens, documents) written; ValueError for an id outside the vocabulary."""
    buffer, offsets, count, documents = array("q"), array("q"), 0, 0

    def flush() -> None:
        _write_ids(np.frombuffer(buffer, dtype=np.int64), tokens, dtype, vocab)
        np.frombuffer(offsets, dtype=np.int64).tofile(starts)
        del buffer[:], offsets[:]  # no view of them is left to pin their memory

    for doc in docs:
        offsets.append(count)
        buffer.extend(doc)
        count, documents = count + len(doc), documents + 1
        if len(buffer) >= _CHUNK or len(offsets) >= _CHUNK:
            flush()
    flush()
    return count, documents


def _write_ids(ids: np.ndarray, out, dtype: str, vocab: int) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"a token id is outside the tokenizer's {vocab} ids")
    ids.astype(dtype).tofile(out)


def read_meta(folder: str | Path) -> dict:
    """A token folder's meta.json, checked: ValueError naming what is wrong."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ValueError(f"token folder {str(folder)!r} does not exist (write one with "
                         f"python -m composer.tools.tokenize)")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"token folder {str(folder)!r} has no readable meta.json: {e}") from None
    meta, where = meta if isinstance(meta, dict) else {}, path / "meta.json"
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where}: format {meta.get('format')!r}, not {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise ValueError(f"{where}: format version {meta.get('version')!r} is unknown; this "
                         f"composer reads version {VERSION}")
    missing = [key for key in _KEYS if key not in meta]
    if missing:
        raise ValueError(f"{where}: lacks {', '.join(missing)}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"{where}: dtype {meta['dtype']!r}; allowed: uint16, uint32")
    for name, size, count in (("tokens.bin", np.dtype(meta["dtype"]).itemsize,
                               meta["num_tokens"]), ("offsets.bin", 8, meta["num_documents"])):
        if not (path / name).is_file():
            raise ValueError(f"{path / name} is missing")
        if (path / name).stat().st_size != size * count:
            raise ValueError(f"{path / name} holds {(path / name).stat().st_size} bytes; "
                             f"meta.json says {count} entries of {size} bytes")
    return meta


def open_token_file(folder: str | Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(tokens, document offsets, meta) of a token folder, memory-mapped read-only."""
    meta = read_meta(folder)
    path = Path(folder).expanduser()
    tokens = np.memmap(path / "tokens.bin", dtype=meta["dtype"], mode="r")
    offsets = np.memmap(path / "offsets.bin", dtype=np.int64, mode="r")
    return tokens, offsets, meta


def file_documents(folder: str | Path) -> Iterator[list[int]]:
    """Each document's tokens in a token file, in order."""
    tokens, offsets, _ = open_token_file(folder)
    for index, start in enumerate(offsets):
        end = offsets[index + 1] if index + 1 < len(offsets) else len(tokens)
        yield tokens[start:end].tolist()


def held_out(first: int, end: int, val_fraction: float) -> np.ndarray:
    """The validation documents among ``first``..``end - 1``: the indices that
    ``sources.is_validation_document`` holds out, in the same float arithmetic."""
    index = np.arange(first, end, dtype=np.float64)
    held = np.floor((index + 1) * val_fraction) > np.floor(index * val_fraction)
    return first + np.flatnonzero(held)


def split_runs(offsets: np.ndarray, num_tokens: int, validation: bool, val_fraction: float
               ) -> np.ndarray:
    """[R, 2] the (start, end) positions of the stretches of the token array that make
    up a split, in order: its documents, with the other split's cut out. One row per
    held-out document at most, so memory follows the validation split, not the corpus."""
    count = len(offsets)
    held = np.concatenate([held_out(i, min(i + _CHUNK, count), val_fraction)
                           for i in range(0, count, _CHUNK)] or [np.zeros(0, np.int64)])
    starts = np.asarray(offsets[held], dtype=np.int64)
    following = np.minimum(held + 1, count - 1)
    ends = np.where(held + 1 < count, offsets[following], num_tokens).astype(np.int64)
    if not validation:
        starts, ends = np.append(0, ends), np.append(starts, num_tokens)
    runs = np.stack([starts, ends], 1)
    return runs[runs[:, 1] > runs[:, 0]]


class PackedWindows(Cursor):
    """Windows of ``width`` tokens cut end to end from the ``runs`` of a flat token
    array (in memory or memory-mapped); the short tail is dropped, and a new epoch
    starts over. ``offsets`` (sorted) are the documents' first positions in the array;
    with ``starts`` each window also marks them. Seeking is free; a read copies only
    the windows it returns."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, runs: np.ndarray, width: int,
                 what: str, starts: bool = False):
        lengths = runs[:, 1] - runs[:, 0]
        check_one_window(int(lengths.sum()), width, what)
        self.windows_per_epoch = int(lengths.sum()) // width
        self._tokens, self._offsets, self._runs = tokens, offsets, runs
        self._run_from = np.cumsum(lengths) - lengths  # each run's first position in the split
        self._width = width
        self._track_starts = starts
        self.position = 0

    def read(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens, labels, document starts or None) of the next ``count`` windows."""
        rows = [self._window(i % self.windows_per_epoch)
                for i in range(self.position, self.position + count)]
        self.position += count
        windows = torch.from_numpy(np.stack([tokens for tokens, _ in rows]).astype(np.int64))
        starts = torch.from_numpy(np.stack([s for _, s in rows])) if self._track_starts else None
        return windows, windows, starts

    def _window(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        at, filled = index * self._width, 0
        run = int(np.searchsorted(self._run_from, at, "right")) - 1
        pieces, starts = [], np.zeros(self._width, dtype=bool) if self._track_starts else None
        while filled < self._width:
            begin = int(self._runs[run, 0] + at - self._run_from[run])
            end = min(int(self._runs[run, 1]), begin + self._width - filled)
            pieces.append(self._tokens[begin:end])
            if starts is not None:
                low, high = np.searchsorted(self._offsets, [begin, end])
                starts[filled + np.asarray(self._offsets[low:high]) - begin] = True
            filled, at, run = filled + end - begin, at + end - begin, run + 1
        return np.concatenate(pieces), starts


def token_windows(folder: str, width: int, split: str, val_fraction: float,
                  starts: bool = False) -> PackedWindows:
    """The windows of a token file's split: its documents held out as the text path
    holds them out of the same documents."""
    tokens, offsets, meta = open_token_file(folder)
    runs = split_runs(offsets, meta["num_tokens"], split == "validation", val_fraction)
    return PackedWindows(tokens, offsets, runs, width, split_name(folder, split, val_fraction),
                         starts)
