"""Session-wide: the parity matrix's fixtures, how the tests split over pytest-xdist's
workers, and how many launches gloo could not connect."""
from __future__ import annotations

import gc

import pytest

from composer.testing.harness import RETRIED
from composer.testing.parity import FLEX_LAYOUTS
from tests.support.parity import layout_rows, matrix, reference  # noqa: F401 (the fixtures)

# torch and composer, imported above, live as long as the session: the full
# collections of the one-process jobs that run in this process skip them
gc.freeze()

PARITY_FIXTURES = {"matrix", "reference", "layout_rows"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Under ``-n 2 --dist loadgroup`` (the README's test command) a worker takes a whole
    file, so that a file's module fixtures (its shared launch) run once; the tests that
    read the parity matrix's session fixtures, in whichever file, go together to one
    worker, so that its launches run once (the flex rows', which no other test reads,
    to a group of their own)."""
    for item in items:
        parity = PARITY_FIXTURES & set(getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.xdist_group(parity_group(item) if parity
                                                else item.path.name))


def parity_group(item) -> str:
    """The flex rows' launch is a group of its own (it shares no job with the others),
    so the two workers can run it beside the rest of the matrix."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    flex = params.get("name") in FLEX_LAYOUTS or params.get("group") == "flex"
    return "parity_flex" if flex else "parity"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """A worker hands its retried launches to the controller, which prints them."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["gloo_retried"] = list(RETRIED)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without pytest-xdist
def pytest_testnodedown(node):
    RETRIED.extend(getattr(node, "workeroutput", {}).get("gloo_retried", []))


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("launches tried again because "
                                f"gloo could not connect: {len(RETRIED)}")
    for line in RETRIED:
        terminalreporter.write_line(f"  {line}")
