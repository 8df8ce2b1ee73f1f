"""Known third-party noise kept off the console, by message, and kept in the log at
debug level: nothing else is filtered, so a new warning still shows.

Installed when this module is imported, which ``composer`` does first: before torchao
is imported (it logs a line per kernel library it cannot load on this machine).
"""
from __future__ import annotations

import logging
import re
import warnings

from composer.torch_compat.names import PYTREE_LOGGER

# (logger, what its known lines start with)
LOGGED = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torchao.kernel.intmm": ("Warning: Detected no triton",),  # the planner's import of it
    PYTREE_LOGGER: ("<enum ",),  # register_constant() on an Enum: deprecated in torch
}
# warnings.warn messages (regular expressions, matched at the start)
WARNED = (
    r"torch\.distributed is disabled",  # DCP, one process: no process group, on purpose
)
log = logging.getLogger("composer.torch_compat.quiet")


class _Demote(logging.Filter):
    """Records that start with one of ``starts``: at debug level, shown only when
    composer's log is at debug level."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.starts):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger("composer").isEnabledFor(logging.DEBUG)


_PATTERN = re.compile("|".join(f"(?:{p})" for p in WARNED))
_show = warnings.showwarning


def _showwarning(message, category, filename, lineno, file=None, line=None):
    if _PATTERN.match(str(message)):
        log.debug("%s: %s (%s:%s)", category.__name__, message, filename, lineno)
        return
    _show(message, category, filename, lineno, file, line)


def install() -> None:
    """Idempotent: a filter per logger, and one hook in front of warnings' printer."""
    global _show
    for name, starts in LOGGED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Demote) for f in logger.filters):
            logger.addFilter(_Demote(starts))
    if warnings.showwarning is not _showwarning:
        _show = warnings.showwarning
        warnings.showwarning = _showwarning


install()
