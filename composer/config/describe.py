"""What a config section says about itself: each key's type, default, allowed values
and help, from the dataclass fields' metadata (``--help`` and the generated
configuration page read it)."""
from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

from composer.config.schema import JobConfig, sections


def known_sections() -> dict[str, Any]:
    """The sections by name: the built-in ones in their order, then the registered ones
    by name (their registration order depends on what was imported first)."""
    known = sections(JobConfig())
    builtin = [f.name for f in dataclasses.fields(JobConfig) if f.name != "components"]
    return {name: known[name] for name in builtin + sorted(set(known) - set(builtin))}


def plain(text: str) -> str:
    return text.replace("``", "")


def description(section: Any) -> str:
    """The first paragraph of the section dataclass's docstring, on one line."""
    doc = type(section).__doc__ or ""
    if doc.startswith(type(section).__name__ + "("):  # @dataclass's stand-in: no docstring
        return f"(registered by {type(section).__module__})"
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _toml(value: Any) -> str:
    return json.dumps(value)  # a TOML literal for the values config keys hold


def default(f: dataclasses.Field) -> str:
    missing = f.default is dataclasses.MISSING
    return _toml(f.default_factory() if missing else f.default)


def allowed(f: dataclasses.Field) -> str:
    """What the parser lets through, from the metadata of ``choice``, ``bounded``, ``listed``."""
    meta = f.metadata
    if "choices" in meta:
        return "one of " + ", ".join(_toml(c) for c in meta["choices"])
    if meta.get("items"):
        return "entries from " + ", ".join(_toml(c) for c in meta["items"])
    low, high = meta.get("low"), meta.get("high")
    if low is None and high is None:
        return ""
    span = f"{low}..{high}" if low is not None and high is not None else (
        f">= {low}" if low is not None else f"<= {high}")
    return span + "".join(f" or {_toml(a)}" for a in meta.get("also", ()))


def keys(section: Any) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, allowed, help) of each key of ``section``."""
    return [(f.name, str(f.type), default(f), allowed(f), f.metadata.get("help", ""))
            for f in dataclasses.fields(section)]
