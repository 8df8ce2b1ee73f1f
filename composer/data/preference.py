"""Preference pairs (``data.format = "preference"``): one prompt and two answers to it,
the ``chosen`` one preferred to the ``rejected`` one, for DPO (``composer/trainer/dpo.py``).

A row is one of:

- ``{"prompt": str, "chosen": str, "rejected": str}``: each answer becomes the SFT
  example ``prompt``/``response`` (``composer/data/sft.py``: bos + prompt unlearned,
  answer + eos learned);
- chats, ``chosen`` and ``rejected`` lists of messages (``{"role", "content"}``), with
  an optional ``prompt`` before both: a list of messages, or a string read as one user
  message. Each answer becomes the chat ``prompt + answer`` rendered as SFT renders
  chats (the tokenizer's chat template, or the built-in one), learning the assistant
  turns' tokens.

So an answer's learned tokens are exactly those SFT would learn from it. Each answer
is its own window of ``seq_len + 1`` tokens, cut and padded as unpacked SFT examples
are; a pair's two windows always travel together. Pairs, not windows, are held out for
validation (``is_validation_document`` on the row index).
"""
from __future__ import annotations

from typing import Any

import torch

from composer.data.sft import (
    Example,
    chat_tokens,
    pad_id,
    padded_windows,
    prompt_response_tokens,
)
from composer.data.sources import is_validation_document, open_rows, split_name

FIELDS = ("chosen", "rejected")
FORMS = ("string fields 'prompt', 'chosen' and 'rejected'; or 'chosen' and 'rejected' as "
         "lists of {'role', 'content'} messages, with an optional 'prompt' (a string, or "
         "messages) before both")


def pair_tokens(row: dict, tokenizer: Any) -> tuple[Example, Example]:
    """The chosen and the rejected answer of one row as SFT examples; a ValueError
    says what the row lacks."""
    prompt, chosen, rejected = row.get("prompt"), row.get("chosen"), row.get("rejected")
    if all(isinstance(x, str) for x in (prompt, chosen, rejected)):
        return (prompt_response_tokens(prompt, chosen, tokenizer),
                prompt_response_tokens(prompt, rejected, tokenizer))
    chats = isinstance(chosen, list) and isinstance(rejected, list)
    if chats and (prompt is None or isinstance(prompt, (str, list))):
        before = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return (chat_tokens((before or []) + chosen, tokenizer),
                chat_tokens((before or []) + rejected, tokenizer))
    fields = sorted(name for name, value in row.items() if value is not None)
    raise ValueError(f"expected {FORMS}; the row has fields {fields}")


def load_pairs(dataset: str, tokenizer: Any, split: str = "train", val_fraction: float = 0.0
               ) -> list[tuple[Example, Example]]:
    """One split's rows of ``dataset``, tokenized, in order (every row is read, so a bad
    row fails in either split)."""
    rows, _ = open_rows(dataset)
    pairs = []
    for index, row in enumerate(rows):
        try:
            pair = pair_tokens(row, tokenizer)
        except ValueError as e:
            raise ValueError(f"dataset {dataset!r}, row {index} (from 0): {e}") from None
        if is_validation_document(index, val_fraction) == (split == "validation"):
            pairs.append(pair)
    return pairs


def preference_windows(dataset: str, tokenizer: Any, width: int, split: str = "train",
                       val_fraction: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int32, learn mask bool), each [n_pairs, 2, width]: every pair's chosen
    window, then its rejected one."""
    pairs = load_pairs(dataset, tokenizer, split, val_fraction)
    what = split_name(dataset, split, val_fraction)
    if not pairs:
        raise ValueError(f"{what} has no pairs")
    chosen, rejected = zip(*pairs)
    pad = pad_id(tokenizer)
    (chosen_tokens, chosen_mask), (rejected_tokens, rejected_mask) = (
        padded_windows(list(answers), width, pad, f"{what} ({name} answers)")
        for answers, name in ((chosen, "chosen"), (rejected, "rejected")))
    return (torch.stack([chosen_tokens, rejected_tokens], 1),
            torch.stack([chosen_mask, rejected_mask], 1))
