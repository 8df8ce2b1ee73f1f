"""A test plugin (``job.plugins``): the process that imports it prints, at the
interpreter's exit, how many of gloo's threads are still alive. atexit runs before
the interpreter's teardown, and a run that ended every process group it made
leaves none there (tests/integration/test_plugins.py)."""
from __future__ import annotations

import atexit

from composer.testing.jobs import gloo_threads


@atexit.register
def _census() -> None:
    print(f"gloo threads at exit: {gloo_threads()}", flush=True)
