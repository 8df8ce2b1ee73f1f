"""Session-wide: the parity matrix's fixtures, and how many launches gloo could not
connect."""
from __future__ import annotations

import gc

from tests.harness import RETRIED
from tests.parity_matrix import layout_rows, matrix, reference  # noqa: F401 (shared fixtures)

# torch and composer, imported above, live as long as the session: the full
# collections of the one-process jobs that run in this process skip them
gc.freeze()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("launches tried again because "
                                f"gloo could not connect: {len(RETRIED)}")
    for line in RETRIED:
        terminalreporter.write_line(f"  {line}")
