"""torch.compile, one block at a time.

Compiling each block in place (``Module.compile``) instead of the whole model
keeps compile time flat in depth (identical blocks share one compiled graph),
keeps module names (and checkpoint keys) unchanged, and leaves FSDP's hooks
and the pipeline schedule outside the compiled regions.

Under tensor parallel each block's sub-modules (attention, feed-forward,
norms) are compiled instead, and the residual adds between them stay eager:
in torch 2.13 a compiled graph that holds both a residual add and a TP
sub-module's layout change fails in backward (a plain tensor reaches DTensor's
redistribute). Each sub-module alone compiles and matches eager.
"""
from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)


def apply_compile(blocks: list[nn.Module], backend: str = "inductor",
                  per_submodule: bool = False, fullgraph: bool = True) -> None:
    """Compile each block (or, ``per_submodule``, each of its children) in place
    with ``backend``. ``fullgraph``: a graph break is an error, not a silent
    slowdown; MoE blocks need breaks (their token counts decide shapes)."""
    regions = [c for b in blocks for c in b.children()] if per_submodule else blocks
    for region in regions:
        region.compile(backend=backend, fullgraph=fullgraph)
    log.info("compiled %d %s with %s", len(regions),
             "block sub-modules" if per_submodule else "blocks", backend)
