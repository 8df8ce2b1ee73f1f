"""Metrics helpers: the communication summary of the log line."""
from __future__ import annotations

from composer.observe.comm import comm_summary


def test_comm_summary_adds_up_phases_per_dim():
    comm = {"forward": {"tp": {"all_reduce": {"count": 9, "bytes": 8, "ring_bytes": 2 * 2**20}}},
            "backward": {"tp": {"all_reduce": {"count": 9, "bytes": 8, "ring_bytes": 2**20}},
                         "dp_shard": {"reduce_scatter": {"count": 5, "bytes": 8,
                                                         "ring_bytes": 2**19}}}}
    assert comm_summary(comm) == "dp_shard RS 5 0.50MiB | tp AR 18 3.00MiB"
