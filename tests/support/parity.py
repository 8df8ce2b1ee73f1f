"""The parity matrix's session fixtures: each group's jobs in one launch, once per
session; ``tests/conftest.py`` shares them with every test file."""
from __future__ import annotations

import pytest

from composer.testing.harness import Job, run_jobs
from composer.testing.parity import REFERENCES, group_jobs, group_of


@pytest.fixture(scope="session")
def matrix(tmp_path_factory):
    """Each group's jobs in one launch, once per session; other test files read
    the same rows."""
    done: dict[str, dict[str, Job]] = {}

    def jobs(group: str) -> dict[str, Job]:
        if group not in done:
            done[group] = run_jobs(group_jobs(group), tmp_path_factory.mktemp(f"parity_{group}"))
        return done[group]
    return jobs


@pytest.fixture(scope="session")
def reference(matrix):
    """The one-process run of each model (one process, no process group)."""
    def rows(key: str, group: str | None = None) -> list[dict]:
        group = group if group == "flex" else "quick" if key in REFERENCES else "full"
        rows = matrix(group)[f"reference_{key}"].rows()
        losses = [r["loss"] for r in rows]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert len(set(losses)) == 4 and losses[-1] < losses[0]  # the run actually trains
        return rows
    return rows


@pytest.fixture(scope="session")
def layout_rows(matrix):
    def rows(name: str) -> list[dict]:
        return matrix(group_of(name))[name].rows()
    return rows

