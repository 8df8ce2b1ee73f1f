"""The torch composer is written and tested for, and what happens with another one."""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("composer.torch_compat")

WRITTEN_FOR = "2.13"
# set to 1 to run the command line on a torch of another minor, at one's own risk
UNTESTED_TORCH_ENV = "COMPOSER_UNTESTED_TORCH"


def minor(version: str) -> str:
    """``version``'s major.minor (``2.13.1+cu128`` -> ``2.13``)."""
    return ".".join(version.split("+")[0].split(".")[:2])


def check_torch_version(version: str = torch.__version__) -> bool:
    """Whether ``version`` has the major.minor this module was written for; warns when not
    (a different torch may still work: only a missing name is an error)."""
    if minor(version) == WRITTEN_FOR:
        return True
    log.warning("composer was written for torch %s; torch %s may differ in the private "
                "APIs it names", WRITTEN_FOR, version)
    return False


def untested_torch(version: str | None = None) -> str | None:
    """The one line the command line exits 2 with when torch's minor is not the tested
    one (None when it is, or when the user set ``COMPOSER_UNTESTED_TORCH=1``)."""
    version = torch.__version__ if version is None else version
    if minor(version) == WRITTEN_FOR or os.environ.get(UNTESTED_TORCH_ENV) == "1":
        return None
    return (f"error: composer is tested with torch {WRITTEN_FOR}.x; this is torch {version} "
            f"(install torch=={WRITTEN_FOR}.*, or set {UNTESTED_TORCH_ENV}=1 to go on at your "
            f"own risk)")
