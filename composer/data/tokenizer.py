"""Tokenizers: the built-in byte-level one, or a Hugging Face ``tokenizer.json``."""
from __future__ import annotations

from pathlib import Path

_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus a bos and an eos id."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258
    identity = ("byte",)  # equal identities encode alike

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
        stat = Path(path).stat()
        self.identity = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
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
