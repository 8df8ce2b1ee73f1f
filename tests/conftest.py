"""Session-wide reporting: how many launches gloo could not connect."""
from __future__ import annotations

from tests.harness import RETRIED


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"launches tried again because gloo could not connect: {len(RETRIED)}")
    for line in RETRIED:
        terminalreporter.write_line(f"  {line}")
