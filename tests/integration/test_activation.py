"""Activation checkpointing and the memory breakdown.

Numerical parity of every AC mode (alone, with FSDP2 x TP2, with PP2 and with
expert parallel) lives in the parity matrix (tests/integration/test_parity.py, rows ac_*).
Here: which blocks each mode wraps, what it saves, and the memory it measures.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from composer.models import llama
from composer.observe.memory import CATEGORIES, MemoryMeter
from composer.parallel.activation import apply_ac
from composer.testing.harness import train

ARGS = llama.flavors["debug"]


def debug_model(mode: str, every: int = 2) -> torch.nn.Module:
    model = llama.spec.build_meta(ARGS)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    apply_ac(llama.spec.blocks(model), mode, every)
    return model


def one_step(mode: str, seq_len: int = 256) -> tuple[dict, list[torch.Tensor]]:
    """Peak memory by category of one AdamW step, and the gradients."""
    model = debug_model(mode)
    optimizer = torch.optim.AdamW(model.parameters())
    meter = MemoryMeter(torch.device("cpu"), [model], [optimizer])
    tokens = torch.randint(0, ARGS.vocab_size, (4, seq_len),
                           generator=torch.Generator().manual_seed(1))
    with meter.step():
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return meter.last, grads


def wrapped(model: torch.nn.Module) -> list[int]:
    return [i for i, b in enumerate(llama.spec.blocks(model)) if hasattr(b.forward, "__wrapped__")]


@pytest.mark.parametrize("mode,every,blocks", [("none", 2, []), ("full", 2, [0, 1, 2, 3]),
                                               ("selective_layer", 2, [1, 3]),
                                               ("selective_layer", 3, [2]),
                                               ("selective_layer", 1, [0, 1, 2, 3]),
                                               ("selective_op", 2, [0, 1, 2, 3])])
def test_each_mode_wraps_its_blocks(mode, every, blocks):
    assert wrapped(debug_model(mode, every)) == blocks


def test_module_names_and_weights_are_unchanged():
    plain, checkpointed = debug_model("none"), debug_model("full")
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()


@pytest.fixture(scope="module")
def steps():
    return {mode: one_step(mode) for mode in ("none", "full", "selective_layer", "selective_op")}


def test_recomputation_gives_the_same_gradients(steps):
    reference = steps["none"][1]
    for mode in ("full", "selective_layer", "selective_op"):
        for ours, ref in zip(steps[mode][1], reference):
            torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


def test_full_ac_keeps_a_fraction_of_the_activations(steps):
    """Without AC each block keeps ~20 tensors of its input's size or larger
    (norms, q/k/v, attention, the 3 feed-forward projections); full AC keeps
    each block's input and, at the peak, one block being recomputed. On the
    debug model (4 blocks, sequences of 255) that measured 25%; the bound
    is the issue's 35%. Selective modes land in between."""
    act = {mode: memory["activations"] for mode, (memory, _) in steps.items()}
    assert act["full"] <= 0.35 * act["none"], act
    assert act["full"] < act["selective_op"] < act["none"], act
    assert act["full"] < act["selective_layer"] < act["none"], act


def test_the_breakdown_adds_up_and_counts_parameters_exactly(steps):
    memory, _ = steps["none"]
    param_bytes = 4 * sum(p.numel() for p in debug_model("none").parameters())
    assert memory["params"] == param_bytes
    assert memory["peak"] == sum(memory[k] for k in CATEGORIES if k != "peak")


@pytest.mark.slow
def test_a_run_logs_every_ranks_breakdown(tmp_path):
    rows = train(tmp_path, 2, ["--training.steps", "2", "--data.seq_len", "64",
                               "--training.local_batch_size", "2", "--metrics.log_freq", "1",
                               "--metrics.enable_tensorboard", "false",
                               "--validation.enable", "false",
                               "--activation_checkpoint.mode", "full",
                               "--metrics.memory_breakdown"])
    model = llama.spec.build_meta(ARGS)
    gib = 4 / 2**30
    total = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    block = sum(p.numel() for p in model.layers["0"].parameters())
    for row in rows:
        assert len(row["memory"]) == 2 and all(r.keys() == set(CATEGORIES) for r in row["memory"])
        assert row["memory_activations_gib"] == max(r["activations"] for r in row["memory"])
        for rank in row["memory"]:
            # FSDP2 x2: half of every parameter, and at the peak at most the
            # root (kept gathered) and one block unsharded
            assert (total / 2 * gib - 2e-6 <= rank["params"]
                    <= (total / 2 + root + block) * gib + 2e-6)
            assert 0 < rank["activations"] < rank["peak"]
    # from step 2 on AdamW holds two moments of each parameter shard
    for rank in rows[1]["memory"]:
        assert rank["optimizer"] == pytest.approx(2 * total / 2 * gib, abs=2e-6)
