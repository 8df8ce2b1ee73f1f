"""Supervised fine-tuning examples: the tokens a model reads and the few it learns.

An example is a dataset row with string fields ``prompt`` and ``response``; or
with ``messages``, a list of ``{"role": "system" | "user" | "assistant",
"content": str}``; or in a form read as messages: ``instruction`` (with an optional
``input``, joined to it by a blank line) as the user's and ``output`` as the
assistant's, or ``conversations`` of ``{"from": "human" | "gpt" | ..., "value": str}``
turns. ``data.columns`` maps these fields to a dataset's own column names. Each becomes
tokens and a learn mask (1: the loss may take that token as a target):

- prompt/response: ``[bos] + encode(prompt)`` with mask 0, then
  ``encode(response) + [eos]`` with mask 1.
- messages, with a tokenizer that has a chat template (``data.chat_template``;
  ``composer/data/chat.py``): the template's text, tokenized whole, the template
  writing every special token; learned are the tokens of its ``{% generation %}``
  blocks, or where it has none each assistant content and the token after it.
- messages otherwise: ``[bos]`` with mask 0, then every message in order, rendered by
  this built-in template::

      system, user:  encode(f"<|{role}|>\\n{content}\\n")    mask 0
      assistant:     encode("<|assistant|>\\n")              mask 0
                     encode(content) + [eos]                 mask 1

  so ``[user "hi", assistant "hello"]`` reads
  ``<bos><|user|>\\nhi\\n<|assistant|>\\nhello<eos>``; an assistant turn ends
  with eos instead of a newline.

bos and eos are left out when the tokenizer has none. The pieces are encoded
one by one, so a subword tokenizer never merges a learned token with an
unlearned one and the mask stays exact.

Position t of a window predicts token t+1, and learns it only where
``mask[t+1] == 1``; the other targets are IGNORE_INDEX, which the loss neither
takes nor counts. Windows are ``seq_len + 1`` tokens wide:

- padding (``data.sft_packing = false``): one example per window, cut to the
  width when longer (one warning counts them) and right-padded with eos (id 0
  when the tokenizer has none) under mask 0. Attention is causal, so the pads
  never change the positions before them.
- packing (``data.sft_packing = true``): the examples end to end, cut into
  consecutive windows; the tail shorter than a window is dropped, as for text.
  With ``data.document_mask`` (the default) attention stays inside each
  example, so a packed example reads as if it were alone (with
  ``data.reset_positions``, at its own positions too); without it an example
  sees the ones before it. The loss mask stays exact. As in text, a window's
  first token is only an input, never a target.

Examples, not windows, are held out for validation (``is_validation_document``
on the row index), so no example is in both splits. SFT sets are small: every
row is read and tokenized (a bad row fails even in the other split) and the
windows are held in memory.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

from composer.data.sources import (
    check_one_window,
    document_starts,
    is_validation_document,
    open_rows,
    split_name,
)

log = logging.getLogger("composer")

ROLES = ("system", "user", "assistant")
# the forms of an example: prompt/response, messages, an instruction (with an optional
# input) and its output, conversations of from/value turns
COLUMNS = [("prompt", "response"), ("messages",), ("instruction", "output"),
           ("conversations",)]
_MESSAGE = "{'role': 'system' | 'user' | 'assistant', 'content': str}"
_FORMS = (f"string fields 'prompt' and 'response'; 'messages': a list of {_MESSAGE}; "
          f"'instruction' (and 'input') and 'output'; or 'conversations': a list of "
          f"{{'from': 'system' | 'human' | 'user' | 'gpt' | 'assistant', 'value': str}}")
# a conversations turn's speaker -> its role
SPEAKERS = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
            "assistant": "assistant"}

Example = tuple[list[int], list[int]]  # tokens, and their learn mask of 0s and 1s


def _specials(tokenizer: Any) -> tuple[list[int], list[int]]:
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    return bos, eos


def _joined(pieces: list[tuple[list[int], int]]) -> Example:
    """The pieces' tokens end to end, each piece's mask value repeated over its tokens."""
    tokens = [token for ids, _ in pieces for token in ids]
    mask = [learned for ids, learned in pieces for _ in ids]
    return tokens, mask


def prompt_response_tokens(prompt: str, response: str, tokenizer: Any) -> Example:
    bos, eos = _specials(tokenizer)
    prompt_ids = bos + tokenizer.encode(prompt)
    return _joined([(prompt_ids, 0), (tokenizer.encode(response) + eos, 1)])


def chat_tokens(messages: list[dict], tokenizer: Any) -> Example:
    """The messages through the tokenizer's chat template (``tokenizer.chat``: the
    template writes every special token), or the built-in one of the module docstring."""
    for index, message in enumerate(messages):
        _role_and_content(message, index)
    if tokenizer.chat is not None:
        return tokenizer.chat.tokens(messages, tokenizer)
    bos, eos = _specials(tokenizer)
    pieces = [(bos, 0)]
    for index, message in enumerate(messages):
        role, content = _role_and_content(message, index)
        if role == "assistant":
            pieces.append((tokenizer.encode("<|assistant|>\n"), 0))
            pieces.append((tokenizer.encode(content) + eos, 1))
        else:
            pieces.append((tokenizer.encode(f"<|{role}|>\n{content}\n"), 0))
    return _joined(pieces)


def chat_prompt(messages: list[dict], tokenizer: Any) -> list[int]:
    """The tokens of a chat to answer: the messages as ``chat_tokens`` renders them,
    then what opens the assistant's turn (the template's generation prompt, or the
    built-in ``<|assistant|>\\n``)."""
    for index, message in enumerate(messages):
        _role_and_content(message, index)
    if tokenizer.chat is not None:
        return tokenizer.encode(tokenizer.chat.render(messages, add_generation_prompt=True)[0])
    tokens = chat_tokens(messages, tokenizer)[0] if messages else _specials(tokenizer)[0]
    return tokens + tokenizer.encode("<|assistant|>\n")


def _role_and_content(message: Any, index: int) -> tuple[str, str]:
    if (
        not isinstance(message, dict)
        or message.get("role") not in ROLES
        or not isinstance(message.get("content"), str)
    ):
        raise ValueError(f"message {index} is {message!r}; expected {_MESSAGE}")
    return message["role"], message["content"]


def parse_columns(text: str) -> dict[str, str]:
    """``data.columns`` (``"ours=theirs,..."``) as {our field: the dataset's column}."""
    out = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        ours, _, theirs = pair.partition("=")
        known = {name for form in COLUMNS for name in form} | {"input"}
        if ours.strip() not in known or not theirs.strip():
            raise ValueError(f"{pair!r}: allowed: <field>=<column>, field one of "
                             f"{', '.join(sorted(known))}")
        out[ours.strip()] = theirs.strip()
    return out


def messages_of(row: dict) -> list | None:
    """The row as messages where it is an instruction or conversations; None otherwise."""
    if isinstance(row.get("instruction"), str) and isinstance(row.get("output"), str):
        extra = row.get("input")
        prompt = row["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra
                                       else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant",
                                                        "content": row["output"]}]
    if isinstance(row.get("conversations"), list):
        turns = []
        for index, turn in enumerate(row["conversations"]):
            speaker = turn.get("from") if isinstance(turn, dict) else None
            if speaker not in SPEAKERS or not isinstance(turn.get("value"), str):
                raise ValueError(f"conversations turn {index} is {turn!r}; expected "
                                 f"{{'from': {' | '.join(map(repr, SPEAKERS))}, 'value': str}}")
            turns.append({"role": SPEAKERS[speaker], "content": turn["value"]})
        return turns
    return None


def example_tokens(row: dict, tokenizer: Any, columns: dict[str, str] | None = None) -> Example:
    """One row in any of the forms (``columns``: our field -> the dataset's column, for
    other names); a ValueError says what the row lacks."""
    row = {**row, **{ours: row.get(theirs) for ours, theirs in (columns or {}).items()}}
    if isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
        return prompt_response_tokens(row["prompt"], row["response"], tokenizer)
    messages = row.get("messages") if isinstance(row.get("messages"), list) else None
    messages = messages if messages is not None else messages_of(row)
    if messages is not None:
        return chat_tokens(messages, tokenizer)
    fields = sorted(name for name, value in row.items() if value is not None)
    raise ValueError(f"expected {_FORMS}; the row has fields {fields}")


def load_examples(dataset: str, tokenizer: Any,
                  columns: dict[str, str] | None = None) -> Iterator[Example]:
    """Every row of a dataset (as data.load_documents finds it), tokenized, in order."""
    rows, _ = open_rows(dataset)
    for index, row in enumerate(rows):
        try:
            yield example_tokens(row, tokenizer, columns)
        except ValueError as e:
            raise ValueError(f"dataset {dataset!r}, row {index} (from 0): {e}") from None


def sft_windows(
    dataset: str,
    tokenizer: Any,
    width: int,
    split: str = "train",
    val_fraction: float = 0.0,
    packing: bool = False,
    starts: bool = False,
    columns: dict[str, str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(tokens int32, mask bool, example starts bool or None), each [n_windows,
    width], of one split's examples; starts only for ``packing`` and ``starts``."""
    validation = split == "validation"
    examples = [
        example
        for index, example in enumerate(load_examples(dataset, tokenizer, columns))
        if is_validation_document(index, val_fraction) == validation
    ]
    what = split_name(dataset, split, val_fraction)
    if packing:
        tokens, mask, first = packed_windows(examples, width, what)
        return tokens, mask, first if starts else None
    return (*padded_windows(examples, width, pad_id(tokenizer), what), None)


def pad_id(tokenizer: Any) -> int:
    """What pads a window: eos, or id 0 where the tokenizer has none."""
    return 0 if tokenizer.eos_id is None else tokenizer.eos_id


def padded_windows(
    examples: list[Example], width: int, pad_id: int, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One example a window: cut to ``width``, then padded to it with unlearned ``pad_id``."""
    if not examples:
        raise ValueError(f"{what} has no examples")
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.int32)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, (ids, learned) in enumerate(examples):
        length = min(len(ids), width)
        tokens[row, :length] = torch.tensor(ids[:length], dtype=torch.int32)
        mask[row, :length] = torch.tensor(learned[:length], dtype=torch.bool)
    truncated = sum(len(ids) > width for ids, _ in examples)
    if truncated:
        log.warning(
            "%s: %d of %d examples are longer than seq_len + 1 = %d tokens and were cut to it",
            what, truncated, len(examples), width,
        )
    return tokens, mask


def packed_windows(
    examples: list[Example], width: int, what: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The examples end to end, cut into windows of ``width``; the short tail is
    dropped. Returns tokens, learn mask and each example's first token."""
    tokens = torch.tensor([token for ids, _ in examples for token in ids], dtype=torch.int32)
    mask = torch.tensor([m for _, learned in examples for m in learned], dtype=torch.bool)
    starts = torch.tensor([first for ids, _ in examples for first in document_starts(ids)])
    check_one_window(len(tokens), width, what)
    usable = len(tokens) // width * width
    return tuple(t[:usable].view(-1, width) for t in (tokens, mask, starts))
