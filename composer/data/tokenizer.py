"""Tokenizers: the built-in byte-level one, or a Hugging Face ``tokenizer.json`` (with
the ``tokenizer_config.json`` beside it, where there is one: its special tokens and its
chat template)."""
from __future__ import annotations

import json
from pathlib import Path

from composer.data.chat import ChatTemplate, read_config, special, template_of

_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus a bos and an eos id."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258
    identity = ("byte",)  # equal identities encode alike
    chat: ChatTemplate | None = None  # chats take the built-in template

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The bytes of ``text``, each with the character it is part of."""
        ids, offsets = [], []
        for index, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids += encoded
            offsets += [(index, index + 1)] * len(encoded)
        return ids, offsets

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; bos and eos are left out, or written ``<bos>``, ``<eos>``."""
        names = {} if skip_special_tokens else {self.bos_id: b"<bos>", self.eos_id: b"<eos>"}
        data = b"".join(bytes([i]) if i < 256 else names.get(i, b"") for i in ids)
        return data.decode("utf-8", errors="replace")


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
        self.path = Path(path)
        stat = Path(path).stat()
        self.identity = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.config = read_config(Path(path).parent)
        self.bos_id = self._named_id("bos_token", _BOS_NAMES)
        self.eos_id = self._named_id("eos_token", _EOS_NAMES)
        template = template_of(self.config)
        self.chat = (ChatTemplate(template, f"of {Path(path).parent}", self.config)
                     if template else None)

    def _named_id(self, key: str, names: tuple[str, ...]) -> int | None:
        """The id of the special token the config names, else of the first known name."""
        named = special(self.config.get(key))
        found = self._tokenizer.token_to_id(named) if named else None
        return found if found is not None else self._first_token_id(names)

    def _first_token_id(self, names: tuple[str, ...]) -> int | None:
        ids = (self._tokenizer.token_to_id(name) for name in names)
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        # Packing adds bos/eos itself; the tokenizer's own template would double them.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` (no special tokens added) and each one's characters."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(span) for span in encoding.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def export_files(tokenizer: ByteTokenizer | HFTokenizer, into: Path) -> list[Path]:
    """What a model export carries for ``tokenizer``, written into ``into``: a Hugging
    Face tokenizer's ``tokenizer.json`` and its ``tokenizer_config.json`` with the chat
    template training used, and a ``generation_config.json`` naming the bos and eos ids
    (where a generation ends)."""
    into.mkdir(parents=True, exist_ok=True)
    files = []
    if isinstance(tokenizer, HFTokenizer):
        config = {**tokenizer.config}
        if tokenizer.chat is not None:
            config["chat_template"] = tokenizer.chat.template
        (into / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        files = [tokenizer.path, into / "tokenizer_config.json"]
        files += [p for p in [tokenizer.path.parent / "special_tokens_map.json"] if p.is_file()]
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    (into / "generation_config.json").write_text(json.dumps(
        {key: value for key, value in ids.items() if value is not None}, indent=2))
    return [*files, into / "generation_config.json"]


def set_chat_template(tokenizer: ByteTokenizer | HFTokenizer, choice: str) -> None:
    """The template ``tokenizer`` renders chats with: ``auto`` (its own, where it has
    one), ``builtin`` (composer's), or the path of a Jinja file."""
    if choice == "builtin":
        tokenizer.chat = None
    elif choice != "auto":
        if not Path(choice).is_file():
            raise ValueError("allowed: auto, builtin, or the path of a Jinja file")
        tokenizer.chat = ChatTemplate.from_file(choice, getattr(tokenizer, "config", {}))


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
