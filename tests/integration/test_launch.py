"""composer-train --nproc: which arguments go to torch's launcher and which to composer
(the launches themselves: tests/integration/test_train.py, Ctrl-C, SIGTERM and a config error)."""
from __future__ import annotations

import pytest

from composer.cli.launch import split
from composer.config import ConfigError


def test_torchrun_options_pass_through_and_the_rest_is_composers():
    argv = ["--config", "debug_model", "--nproc", "4", "--nnodes=2", "--rdzv-backend", "c10d",
            "--rdzv_endpoint", "host:29500", "--standalone", "--training.steps", "3",
            "--max-restarts", "1"]
    nproc, launcher, ours = split(argv)
    assert nproc == 4
    assert launcher == ["--nnodes=2", "--rdzv-backend", "c10d", "--rdzv_endpoint", "host:29500",
                        "--standalone", "--max-restarts", "1"]
    assert ours == ["--config", "debug_model", "--training.steps", "3"]
    assert split(["--nproc=2", "--validate"]) == (2, [], ["--validate"])


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_nproc_is_one_line(value):
    with pytest.raises(ConfigError, match=rf"--nproc '{value}'.*allowed: an integer >= 1"):
        split(["--nproc", value, "--config", "debug_model"])
