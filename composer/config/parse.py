"""TOML file and command line -> a validated JobConfig, and a JobConfig -> TOML.

Defaults, then the file, then ``--section.key VALUE`` overrides; every value is
coerced to its field's type and checked against its metadata (``choice``,
``bounded``, ``listed``). Plugins named by ``job.plugins`` (and a ``model.name``
written ``module:attribute``) are imported first, so the sections they register
are known when the other keys are read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from composer.config.schema import ConfigError, JobConfig, sections

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _nearest(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _section(cfg: JobConfig, name: str) -> Any:
    known = sections(cfg)
    if name not in known:
        names = list(known)
        raise ConfigError(f"unknown section '{name}'{_nearest(name, names)}; "
                          f"sections are: {', '.join(names)}")
    return known[name]


def _field(section: Any, sname: str, key: str) -> dataclasses.Field:
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        full = [f"{sname}.{k}" for k in fields]
        raise ConfigError(f"unknown key '{sname}.{key}'{_nearest(f'{sname}.{key}', full)}")
    return fields[key]


def _convert(key: str, value: Any, kinds: tuple[type, ...], from_text: bool) -> Any:
    """Coerce a value to the field's type (``kinds``: several for a field such as
    ``bool | str``, which takes the first that fits), or say why not. Command-line
    values are text and get parsed; TOML values are typed already and must match."""
    for one in kinds:
        converted = _convert_one(value, one, from_text)
        if converted is not _NO:
            return converted
    names = " or ".join(one.__name__ for one in kinds)
    raise ConfigError(f"{key}={value!r}: expected {names}")


_NO = object()  # a value that does not fit a kind


def _convert_one(value: Any, kind: type, from_text: bool) -> Any:
    text = from_text and isinstance(value, str)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if text and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text:
            with contextlib.suppress(ValueError):
                return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if text:
            with contextlib.suppress(ValueError):
                return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    elif kind is list:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        if text:
            return [v.strip() for v in value.strip("[]").split(",") if v.strip().strip("'\"")]
    return _NO


def _check(key: str, value: Any, meta: typing.Mapping) -> None:
    if "choices" in meta and value not in meta["choices"]:
        allowed = ", ".join(_toml_word(c) for c in meta["choices"])
        raise ConfigError(f"{key}={value!r}: not allowed; choose one of: {allowed}")
    low, high = meta.get("low"), meta.get("high")
    if value in meta.get("also", ()):
        return
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"[{low}, {'inf' if high is None else high}]"
        extra = "".join(f" or {a}" for a in meta.get("also", ()))
        raise ConfigError(f"{key}={value!r}: out of range; allowed: {span}{extra}")
    for item in value if meta.get("items") is not None else ():
        if item not in meta["items"]:
            allowed = ", ".join(meta["items"]) or "none yet"
            raise ConfigError(f"{key}: unknown entry {item!r}; allowed: {allowed}")


def _toml_word(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def set_value(cfg: JobConfig, dotted: str, value: Any, from_text: bool = False) -> None:
    """Set ``section.key`` from a TOML value or (``from_text``) command-line text."""
    if dotted.count(".") != 1:
        raise ConfigError(f"'{dotted}': keys are written section.key (e.g. training.steps)")
    sname, key = dotted.split(".")
    section = _section(cfg, sname)
    f = _field(section, sname, key)
    hint = typing.get_type_hints(type(section))[key]
    kinds = (typing.get_args(hint) if isinstance(hint, types.UnionType)
             else (typing.get_origin(hint) or hint,))
    converted = _convert(dotted, value, kinds, from_text)
    _check(dotted, converted, f.metadata)
    setattr(section, key, converted)


# The configs of train_configs/: in an installed wheel composer/train_configs/, in a
# source tree the folder beside composer/ (pyproject.toml's package-dir maps one to the other)
_PACKAGE = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG_FOLDERS = (_PACKAGE / "train_configs", _PACKAGE.parent / "train_configs")


def shipped_configs() -> dict[str, Path]:
    """The configs composer ships, by name (the file's stem): ``debug_model``, ..."""
    folder = next((f for f in SHIPPED_CONFIG_FOLDERS if f.is_dir()), None)
    return {p.stem: p for p in sorted(folder.glob("*.toml"))} if folder else {}


def config_path(path: str) -> Path:
    """``--config``'s file: an existing path, else a shipped config by name (with or
    without .toml, or as train_configs/NAME.toml, the source tree's path), else a
    ConfigError listing the shipped names."""
    p = Path(path)
    if p.is_file():
        return p
    shipped = shipped_configs()
    name = p.stem if p.suffix == ".toml" else p.name
    if p.parent in (Path("."), Path("train_configs")) and name in shipped:
        return shipped[name]
    raise ConfigError(f"--config {path}: no such file or shipped config; shipped: "
                      f"{', '.join(shipped) or 'none'}")


def load_toml(path: str) -> dict:
    p = config_path(path)
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: invalid TOML: {e}") from None


def _apply_toml(cfg: JobConfig, data: dict) -> None:
    for sname, body in data.items():
        _section(cfg, sname)
        if not isinstance(body, dict):
            raise ConfigError(f"'{sname}' must be a [section] table, got {body!r}")
        for key, value in body.items():
            set_value(cfg, f"{sname}.{key}", value)


def config_from(tables: dict) -> JobConfig:
    """The default JobConfig with ``tables`` set (``{"lora": {"rank": 4}}``: what a TOML
    file's tables hold), each value checked as a TOML file's is: for a library's user,
    who wants a few settings without a file."""
    cfg = JobConfig()
    _apply_toml(cfg, tables)
    return cfg


def _split_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``--a.b V``, ``--a.b=V`` and a bare ``--a.b`` (a true flag) -> pairs."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides are --section.key VALUE")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value, i = arg[2:], args[i + 1], i + 2
        else:
            key, value, i = arg[2:], "true", i + 1
        pairs.append((key, value))
    return pairs


def import_from_here(module: str):
    """Import ``module`` as ``python -m`` would, the current folder on the path (a console
    script such as ``composer-train`` or ``composer-plan`` leaves it off): after every
    other place, so that it shadows nothing installed."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    return importlib.import_module(module)


def import_plugins(cfg: JobConfig) -> None:
    """Import the modules ``job.plugins`` names and the module of a ``model.name``
    written ``module:attribute``, so that what they register exists. Importing a
    module runs its code: whatever it raises is one line naming the module."""
    modules = list(cfg.job.plugins)
    if ":" in cfg.model.name:
        modules.append(cfg.model.name.split(":", 1)[0])
    for module in modules:
        key = "model.name" if module not in cfg.job.plugins else "job.plugins"
        try:
            import_from_here(module)
        except ImportError as e:
            raise ConfigError(f"{key}: cannot import {module!r} ({e}); allowed: a module "
                              f"on the Python path") from None
        except Exception as e:  # the user's module failed while it ran
            raise ConfigError(f"{key}: importing {module!r} failed: {type(e).__name__}: "
                              f"{e}") from None


def parse_args(argv: list[str]) -> tuple[JobConfig, bool]:
    """Command line -> (validated config, whether --print-config was given).

    ``job.plugins`` and ``model.name`` are read first (from the file, then the
    command line) and their modules imported, so that the sections they register
    are known when every other key is validated."""
    argv = list(argv)
    show = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = (arg.split("=", 1)[1] if "=" in arg
                    else (argv[i + 1] if i + 1 < len(argv) else ""))
            argv = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            break
    data = load_toml(path) if path is not None else {}
    pairs = _split_overrides(argv)
    first = ("job.plugins", "model.name")
    early = JobConfig()
    for sname in ("job", "model"):
        body = data.get(sname)
        for key, value in (body.items() if isinstance(body, dict) else ()):
            if f"{sname}.{key}" in first:
                set_value(early, f"{sname}.{key}", value)
    for key, value in pairs:
        if key in first:
            set_value(early, key, value, from_text=True)
    import_plugins(early)
    cfg = JobConfig()  # now with the plugins' sections
    _apply_toml(cfg, data)
    for key, value in pairs:
        set_value(cfg, key, value, from_text=True)
    return cfg, show


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: JobConfig) -> str:
    lines = []
    for name, section in sections(cfg).items():
        lines.append(f"[{name}]")
        for key, value in dataclasses.asdict(section).items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
