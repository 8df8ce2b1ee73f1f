"""Chats rendered by a tokenizer's own chat template, and the tokens learned in them.

A Hugging Face tokenizer folder keeps its chat template (Jinja) in
``tokenizer_config.json``. ``ChatTemplate.tokens(messages, tokenizer)`` renders a chat
as transformers renders it (transformers' own renderer where it is installed, else
jinja2 with the same extensions: ``{% generation %}``, ``raise_exception``,
``strftime_now``), tokenizes the whole text at once with no special tokens added (the
ids ``apply_chat_template(messages, tokenize=True)`` gives), and marks the learned
tokens:

- a template with ``{% generation %}`` blocks: the tokens inside them (what
  transformers' ``return_assistant_tokens_mask`` marks);
- otherwise: each assistant message's content, found in the rendered text in order,
  plus the token that follows it (the template's end of turn).

A token is learned where its characters overlap a learned span.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def special(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def read_config(folder: Path) -> dict:
    """The tokenizer folder's ``tokenizer_config.json`` (empty where there is none)."""
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def template_of(config: dict) -> str | None:
    """The config's chat template: its own, or the one named ``default`` of a list."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class ChatTemplate:
    """One Jinja chat template; ``source`` names it in messages."""

    def __init__(self, template: str, source: str, config: dict | None = None):
        self.template, self.source = template, source
        config = config or {}
        # what transformers hands every template: the special tokens by name
        self.specials = {name: special(config.get(name)) or "" for name in
                         ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.generation = bool(GENERATION.search(template))

    @classmethod
    def from_file(cls, path: str | Path, config: dict | None = None) -> ChatTemplate:
        return cls(Path(path).read_text(), str(path), config)

    def render(self, messages: list[dict], add_generation_prompt: bool = False
               ) -> tuple[str, list[tuple[int, int]]]:
        """The chat's text and the character spans of its ``{% generation %}`` blocks;
        ``add_generation_prompt``: ending with what opens the assistant's answer (a
        prompt to generate from)."""
        try:
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            return _render_jinja2(self.template, messages, self.specials, add_generation_prompt)
        texts, spans = render_jinja_template(
            [messages], chat_template=self.template, add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=self.generation, **self.specials)
        return texts[0], [tuple(span) for span in (spans[0] if spans else [])]

    def learned_spans(self, text: str, spans: list[tuple[int, int]],
                      messages: list[dict]) -> list[tuple[int, int, bool]]:
        """(start, end, with the token after) of each learned stretch of ``text``."""
        if self.generation:
            return [(start, end, False) for start, end in spans]
        out, cursor = [], 0
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = text.find(message["content"], cursor)
            if start < 0:
                raise ValueError(f"message {index}: the chat template {self.source} does not "
                                 f"write the assistant's content as it is")
            cursor = start + len(message["content"])
            out.append((start, cursor, True))
        return out

    def tokens(self, messages: list[dict], tokenizer: Any) -> tuple[list[int], list[int]]:
        """The chat's token ids and their learn mask (1: learned)."""
        text, spans = self.render(messages)
        ids, offsets = tokenizer.encode_with_offsets(text)
        learn = [0] * len(ids)
        for start, end, then_one_more in self.learned_spans(text, spans, messages):
            inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
            for i in inside:
                learn[i] = 1
            after = (inside[-1] + 1) if inside else next(
                (i for i, (a, _) in enumerate(offsets) if a >= end), len(ids))
            if then_one_more and after < len(ids):
                learn[after] = 1
        return ids, learn


# what a generation block's text is wrapped in while rendering, to find its span after
_OPEN, _CLOSE = "\x02generation\x03", "\x02/generation\x03"


def _render_jinja2(template: str, messages: list[dict], specials: dict,
                   add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The chat through jinja2 alone, with transformers' template extensions."""
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("a tokenizer's chat template renders with transformers or jinja2, "
                         "and neither is installed: pip install 'composer-parallel[hf]'") \
            from None

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: its text, marked."""
        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(line)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent,
                                                                   ensure_ascii=False)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    marked = env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **specials)
    text, spans, opened = "", [], 0
    for piece in re.split(f"({re.escape(_OPEN)}|{re.escape(_CLOSE)})", marked):
        if piece == _OPEN:
            opened = len(text)
        elif piece == _CLOSE:
            spans.append((opened, len(text)))
        else:
            text += piece
    return text, spans
