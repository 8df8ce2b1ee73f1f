"""Two nodes on one machine: two torchrun agents meet at a c10d rendezvous on
127.0.0.1, two ranks each, four in all, as two real nodes would.

One launch of the agents runs composer/testing/jobs.py: the one-process reference, then
HSDP whose two replicas lie on different nodes with TP 2 inside each node.
Then scripts/multinode.slurm runs under a stand-in srun (and scontrol) that
starts the same two agents here, one per "node", validating a layout whose TP
group crosses the node boundary: what the script makes of SLURM_*,
GPUS_PER_NODE and RDZV_PORT reaches torchrun and the ranks, and the crossing
warns, in the pre-step and on every rank. (Training through the script would
cost a whole launch more and test no more of it: its ranks run what the
first launch's ran.)

A c10d rendezvous numbers the nodes itself (torchrun warns that it ignores
``--node_rank=1``): which agent becomes node 0 is the rendezvous' choice, so the
tests ask only that each agent holds two consecutive global ranks.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import stat
import sys
import time
from pathlib import Path

import pytest

from composer.job.plan import warn_tp_across_nodes
from composer.mesh import ParallelDims
from composer.testing.harness import (
    PARITY,
    RETRIED,
    Run,
    alive,
    jobs_ended,
    launch_env,
    run_command,
    run_side_by_side,
    write_plan,
)

RTOL = 1e-9
TIMEOUT = 240  # each launch's limit; past it every process below it is killed, the test fails
WARNING = ("tensor parallel x4 spans nodes (2 ranks per node): every block's collectives "
           "cross the network")
# replicas on different nodes, no sharding, TP inside a node; 2 replicas x 4 sequences = 8
HSDP_TP = ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2",
           "--parallelism.data_parallel_shard_degree", "1",
           "--parallelism.tensor_parallel_degree", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(node_rank: int, port: int, program: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
            "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_id=nodes-{port}", *program]


def ranks_per_node(outputs: list[str], pattern: str) -> list[set[int]]:
    """The global ranks whose lines matching ``pattern`` (with a (?P<rank>) group)
    each node's output holds, sorted by their smallest rank. The pattern is not
    anchored: two ranks of one agent write to one stream, and a line of one may
    follow another's text before its newline."""
    found = [{int(m["rank"]) for m in re.finditer(pattern, out)} for out in outputs]
    return sorted(found, key=lambda ranks: min(ranks, default=-1))


# An agent's words when the rendezvous store it reached went away. Seen once in a full
# tier under two pytest workers: the agents stopped their ranks (SIGTERM) one step in,
# most likely because another launch held the port that free_port() had just found free.
STORE_LOST = "Did the remote server shutdown or crash?"


def two_nodes(jobs: dict[str, Run], folder) -> tuple[list[dict], list[int], list[str]]:
    """Run ``jobs`` under two torchrun agents (nodes) meeting at a c10d rendezvous:
    (the plan, the agents' exit codes, their outputs). A launch whose rendezvous store
    was lost is tried once more on another port, and counted (tests/conftest.py)."""
    for attempt in (0, 1):
        sub = folder / f"attempt{attempt}"
        plan = write_plan(jobs, sub)
        port = free_port()
        logs = [sub / f"agent{n}.log" for n in (0, 1)]
        codes = run_side_by_side([agent(n, port, ["-m", "composer.testing.jobs",
                                                  str(sub / "jobs.json")])
                                  for n in (0, 1)], logs, TIMEOUT)
        outputs = [log.read_text() for log in logs]
        if codes == [0, 0] or attempt or not any(STORE_LOST in out for out in outputs):
            return plan, codes, outputs
        RETRIED.append(f"two agents: {STORE_LOST}")


@pytest.mark.slow
def test_hsdp_replicas_across_nodes_tp_inside_match_one_process(tmp_path):
    """Per-step loss, gradient norm and validation loss of HSDP 2 x TP 2 on two
    nodes equal the one-process run's to RTOL; TP inside a node does not warn."""
    jobs = {"reference": Run(1, PARITY + ["--training.local_batch_size", "8"]),
            "hsdp_tp": Run(4, PARITY + HSDP_TP)}
    plan, codes, outputs = two_nodes(jobs, tmp_path)
    ended = jobs_ended(plan, "\n".join(f"agent exit {c}\n{o[-3000:]}"
                                       for c, o in zip(codes, outputs)))
    reference, rows = ended["reference"].rows(), ended["hsdp_tp"].rows()
    assert codes == [0, 0], outputs
    # Each agent (node) ran two consecutive global ranks. The mesh is laid out
    # (pp, dp_replicate, dp_shard, cp, tp) with tp innermost (composer/mesh.py),
    # so the TP pairs are ranks {0, 1} and {2, 3}, each inside one node, and each
    # replica's gradients are averaged across the nodes, over ranks {0, 2} and {1, 3}.
    assert ranks_per_node(outputs,
                          r"job hsdp_tp rank (?P<rank>\d)/4: exit 0 in ") == [{0, 1}, {2, 3}]
    dims = ParallelDims(dp_replicate=2, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=4)
    assert [(dims.coords(r)["dp_replicate"], dims.coords(r)["tp"]) for r in range(4)] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    losses = [r["loss"] for r in reference]
    assert [r["step"] for r in reference] == [1, 2, 3, 4] and losses[-1] < losses[0]  # it trains
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for ours, ref in zip(rows, reference):
        assert ("val_loss" in ours) == ("val_loss" in ref) == (ref["step"] % 2 == 0), ref["step"]
        for key in ("loss", "grad_norm", "val_loss"):
            if key in ref:
                error = abs(ours[key] - ref[key]) / abs(ref[key])
                assert error <= RTOL, (key, ref["step"], ours[key], ref[key], error)
    for rank in range(4):  # TP inside a node: no warning
        log = (ended["hsdp_tp"].logs / f"rank{rank}.log").read_text()
        assert "spans nodes" not in log, log[-2000:]
    # torchrun's own word on the flag a c10d rendezvous does not use
    assert sum("node_rank is only used for static rdzv_backend" in out for out in outputs) == 1


# Stand-ins for the two Slurm commands the script uses. srun starts its command
# once per node of the allocation, as real srun with --ntasks-per-node=1 does
# (one task per node: SLURM_NODEID = SLURM_PROCID, SLURM_LOCALID 0), and waits
# for all; it records the command it was given.
SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$STANDIN_DIR/srun.argv"
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" > "$STANDIN_DIR/node$node.log" 2>&1 &
  pids+=($!)
done
code=0
for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
exit $code
"""
# scontrol: only `scontrol show hostnames LIST`, for a comma-separated LIST
SCONTROL = """#!/usr/bin/env bash
[[ $# == 3 && $1 == show && $2 == hostnames ]] || { echo "stand-in scontrol: $*" >&2; exit 1; }
tr , '\\n' <<< "$3"
"""


def stand_ins(folder: Path) -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


@pytest.mark.slow
def test_multinode_slurm_starts_one_agent_per_node(tmp_path):
    """The script as sbatch would run it on the first of two nodes (sbatch's
    --gpus-per-node=8 overridden by GPUS_PER_NODE=2), validating the debug
    config with TP 4: its pre-step and the two agents see 4 ranks, 2 per node
    (were GPUS_PER_NODE lost for sbatch's 8, the pre-step would check 16 ranks
    and TP 4 would fit a node, without a warning)."""
    bin_dir = stand_ins(tmp_path)
    port = free_port()
    env = {**launch_env(), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "STANDIN_DIR": str(tmp_path), "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2", "SLURM_GPUS_PER_NODE": "8",
           "GPUS_PER_NODE": "2", "RDZV_PORT": str(port)}
    args = ["train_configs/debug_model.toml",
            "--parallelism.tensor_parallel_degree", "4", "--validate"]
    result = run_command(["bash", "scripts/multinode.slurm", *args], TIMEOUT, env)
    nodes = [(tmp_path / f"node{n}.log") for n in (0, 1)]
    nodes = [log.read_text() if log.is_file() else "" for log in nodes]
    assert result.returncode == 0, (f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n"
                                    + "\n".join(nodes))
    assert (tmp_path / "srun.argv").read_text().splitlines() == [
        "python", "-m", "composer.train", "--nproc", "2", "--nnodes=2", "--rdzv-id=4242",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--config", *args]
    # the pre-step, before srun: the whole job's world, and its nodes' size
    assert result.stdout.count("config ok for 4 rank(s)") == 1
    assert result.stdout.count(WARNING) == 1
    # the agents: rank 0 validates a world of 4, every rank warns, each node holds
    # two consecutive ranks
    assert sum(out.count("config ok for 4 rank(s)") for out in nodes) == 1
    warned = rf"\[rank(?P<rank>\d)\] [\d:]+ {re.escape(WARNING)}"
    assert ranks_per_node(nodes, warned) == [{0, 1}, {2, 3}], nodes
    assert sum(out.count(WARNING) for out in nodes) == 4


@pytest.mark.parametrize("per_node,tp,warns", [(2, 4, True), (6, 4, True),
                                               (8, 4, False), (2, 2, False),
                                               (None, 4, False)])
def test_tp_warns_where_a_group_crosses_a_node(monkeypatch, caplog, per_node, tp, warns):
    """TP groups are runs of tp consecutive ranks: with 6 ranks a node, TP 4's
    second group (ranks 4-7) lies on two nodes. Without LOCAL_WORLD_SIZE (one
    process, no torchrun) there are no nodes to cross."""
    caplog.set_level(logging.WARNING, logger="composer")
    if per_node is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    warn_tp_across_nodes(ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=tp,
                                      pp=1, ep=1, world_size=24))
    expected = [f"tensor parallel x{tp} spans nodes ({per_node} ranks per node): "
                "every block's collectives cross the network"] if warns else []
    assert [r.getMessage() for r in caplog.records if r.name == "composer"] == expected


@pytest.mark.slow
def test_agents_past_their_timeout_are_killed_with_everything_below(tmp_path):
    """The hanging command's child has left its session, as torchrun's workers
    do; the timeout kills it too."""
    hang = ["bash", "-c", f"setsid bash -c 'echo $$ > {tmp_path}/pid; exec sleep 600' & wait"]
    start = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 2s: 2 commands side by side"):
        run_side_by_side([["true"], hang],
                         [tmp_path / "ended.log", tmp_path / "hang.log"], timeout=2)
    assert time.monotonic() - start < 15
    assert not alive(int((tmp_path / "pid").read_text()))
