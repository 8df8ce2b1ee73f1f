"""Pipeline parallel's point-to-point traffic is counted: two gloo ranks on a "pp"
mesh send and receive known tensors under a CommCounter."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from composer.observe.comm import CommCounter, comm_summary
from composer.testing.harness import launch

ACTIVATION = 2**18  # float32: 1 MiB
SMALL = 3  # float64: 24 bytes
SENT = ACTIVATION * 4 + SMALL * 8


def exchange(folder: Path) -> None:
    """Rank 0 sends one tensor by isend and one by batch_isend_irecv (as the pipeline
    schedules do); rank 1 receives both. Each rank writes its counter's table."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pp = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)).get_group()
    big = torch.arange(ACTIVATION, dtype=torch.float32) if rank == 0 else torch.zeros(ACTIVATION)
    small = torch.full((SMALL,), 7.0 if rank == 0 else 0.0, dtype=torch.float64)
    op = dist.isend if rank == 0 else dist.irecv
    peer = {"group_dst": 1} if rank == 0 else {"group_src": 0}
    counter = CommCounter({"pp": pp})
    with counter:
        op(big, group=pp, **peer).wait()
        for work in dist.batch_isend_irecv([dist.P2POp(op, small, group=pp, group_peer=1 - rank)]):
            work.wait()
    dist.barrier()
    received = bool(big[-1] == ACTIVATION - 1 and small.eq(7.0).all())
    out = {"comm": counter.table(), "received": received}
    (folder / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.mark.slow
def test_send_and_recv_are_counted_on_the_pp_dim(tmp_path):
    result = launch([str(tmp_path)], nproc=2, timeout=120,
                    program="tests/integration/test_comm_p2p.py")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank, kind in enumerate(("send", "recv")):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["received"]
        counted = {"count": 2, "bytes": SENT, "ring_bytes": SENT}
        assert out["comm"] == {"step": {"pp": {kind: counted}}}
        assert comm_summary(out["comm"]) == f"pp {kind.upper()} 2 1.00MiB"


if __name__ == "__main__":
    exchange(Path(sys.argv[1]))
