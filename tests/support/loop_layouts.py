"""Run layouts of examples/parallel_loop.py in one torchrun launch, so that its
start-up is paid once. Test-only; tests/integration/test_custom_model.py drives it:

    torchrun --nproc_per_node=4 tests/support/loop_layouts.py OUT LAYOUTS_JSON

LAYOUTS_JSON maps a name to ``[nproc, argv]``. In order, each layout runs the
example's ``train`` on the launch's ranks ``0 .. nproc - 1`` (a one-rank layout
without a process group, as ``python examples/parallel_loop.py`` runs; others in a
process group of their own, through a store prefix of their own), and its rank 0
writes the rows to ``OUT/<name>.json``. A layout that fails fails the launch.
"""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from composer.testing.harness import ROOT

sys.path.insert(0, str(ROOT / "examples"))  # where the example finds my_model, as run
import parallel_loop  # noqa: E402


def run(name: str, nproc: int, argv: list[str], store: dist.Store, rank: int) -> list[dict]:
    if nproc == 1:
        return parallel_loop.train(parallel_loop.parse(argv), rank, 1)
    dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank,
                            world_size=nproc, timeout=timedelta(seconds=120))
    try:
        return parallel_loop.train(parallel_loop.parse(argv), rank, nproc)
    finally:
        dist.destroy_process_group()


def main(out: Path, layouts: dict[str, list]) -> None:
    store, rank, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=300)))
    torch.set_default_dtype(torch.float64)
    for name, (nproc, argv) in layouts.items():
        if rank < nproc:
            rows = run(name, nproc, argv, store, rank)
            if rank == 0:
                (out / f"{name}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
