"""A rank reads only its slice of a Hugging Face folder's tensors that are stored as
they are held (``StateDictAdapter.stored_as``), and the rest whole: a region read is
the whole tensor cut, and each rank's part of uneven, empty, column, replicated and
strided shards is exact with only its bytes read (the numbers ``load_hf_into`` logs).
On real ranks, the HF parity launches load their folders so (tests/integration/test_hf_parity.py
checks the bytes each rank read)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from composer.checkpoint.hf import load_hf_into, open_hf
from composer.spec import StateDictAdapter
from composer.torch_compat import release_meshes

WHOLE = torch.arange(15, dtype=torch.float64).reshape(5, 3)


def write_folder(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    return folder


def test_a_region_read_is_the_whole_tensor_cut(tmp_path):
    """Rank 1's rows of 5 over 2 ranks (uneven), an empty part, a column part; the
    reader counts the bytes of the parts only, and refuses a stored shape that differs."""
    _, reader = open_hf(write_folder(tmp_path, {"w": WHOLE}))
    cases = {((3, 0), (2, 3)): WHOLE[3:5], ((5, 0), (0, 3)): WHOLE[5:],
             ((0, 2), (5, 1)): WHOLE[:, 2:]}
    for (offset, shape), expected in cases.items():
        part = reader.region("w", offset, shape)
        assert part.shape == expected.shape and torch.equal(part, expected), (offset, shape)
    assert (reader.bytes_read, reader.parts, reader.whole) == ((6 + 0 + 5) * 8, 3, 0)
    assert reader.size() == WHOLE.numel() * 8

    def refuse(stored):
        raise ValueError(f"file has {stored}")

    with pytest.raises(ValueError, match=r"file has \(5, 3\)"):
        reader.region("w", (0, 0), (5, 3), check=refuse)


def test_only_tensors_stored_as_they_are_are_read_in_slices():
    """Renamed tensors have a stored name; permuted (wq, wk, q/k norms), stacked
    (experts) and unstored (the balancing bias) ones have none."""
    from composer.models.llama.hf import LlamaAdapter
    from composer.models.llama.model import LlamaArgs
    from composer.models.qwen3.hf import Qwen3MoeAdapter
    from composer.models.qwen3.model import Qwen3MoeArgs
    llama = LlamaAdapter(LlamaArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32,
                                   tie_embeddings=True))
    assert llama.stored_as("layers.0.attention.wq.weight") is None
    v = "model.layers.0.self_attn.v_proj.weight"
    assert llama.stored_as("layers.0.attention.wv.weight") == v
    assert llama.stored_as("output.weight") == "model.embed_tokens.weight"  # tied
    moe = Qwen3MoeAdapter(Qwen3MoeArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32,
                                       n_experts=4, top_k=2, moe_hidden_dim=32))
    stored = {name: moe.stored_as(name) for name in (
        "layers.0.attention.wk.weight", "layers.0.attention.q_norm.weight",
        "layers.0.moe.experts.w1", "layers.0.moe.router.expert_bias",
        "layers.0.moe.router.gate.weight", "layers.0.ffn_norm.weight")}
    assert stored == {"layers.0.attention.wk.weight": None,
                      "layers.0.attention.q_norm.weight": None,
                      "layers.0.moe.experts.w1": None, "layers.0.moe.router.expert_bias": None,
                      "layers.0.moe.router.gate.weight": "model.layers.0.mlp.gate.weight",
                      "layers.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight"}


# ------------------------------------------------- each rank's part, rank by rank

class Prefixed(StateDictAdapter):
    """Our names under ``model.``, stored as they are."""

    def hf_keys(self, ours):
        return [f"model.{ours}"]

    def from_hf(self, ours, get):
        return get(f"model.{ours}")

    def stored_as(self, ours):
        return f"model.{ours}"


def odd_parts() -> dict[str, torch.Tensor]:
    """What the odd-shaped model holds: 5 rows over 2 ranks, 1 row (rank 1's part is
    empty), 5 columns (Shard(-1)), a replica, a strided shard (read whole)."""
    sizes = {"uneven": (5, 3), "single": (1, 4), "columns": (3, 5), "replica": (2,),
             "strided": (4, 2)}
    return {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
            + 100 * i for i, (name, shape) in enumerate(sizes.items())}


def odd_model(mesh) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from composer.torch_compat import strided_shard
    placements = {"uneven": Shard(0), "single": Shard(0), "columns": Shard(-1),
                  "replica": Replicate(), "strided": strided_shard(0, 2)}
    model = nn.Module()
    for name, t in odd_parts().items():
        zeros = distribute_tensor(torch.zeros_like(t), mesh, [placements[name]],
                                  src_data_rank=None)
        model.register_parameter(name, nn.Parameter(zeros))
    return model


class Reports(logging.Handler):
    """The numbers of each line ``load_hf_into`` logs: MiB read, the folder's MiB,
    tensors read whole, tensors read."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.numbers: list[tuple] = []

    def emit(self, record):
        self.numbers.append(record.args)


def load_reported(model: nn.Module, folder: Path, adapter: StateDictAdapter) -> dict:
    reports = Reports()
    logger = logging.getLogger("composer.checkpoint.hf")
    logger.setLevel(logging.INFO)
    logger.addHandler(reports)
    try:
        load_hf_into(model, folder, adapter)
    finally:
        logger.removeHandler(reports)
    [(read, size, whole, tensors)] = reports.numbers
    return {"read": read * 2**20, "size": size * 2**20, "whole": whole, "tensors": tensors}


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_its_own_part_of_odd_shards(tmp_path, rank):
    """Rank by rank of 2 (torch's in-process fake process group: each rank's part is
    computed from its place in the mesh alone, no data moves), every part of the
    odd-shaped model is exact and the rank reads only its parts (the strided shard
    whole). The real multi-rank loads are the HF parity launches'
    (tests/integration/test_hf_parity.py checks what their ranks read)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    folder = write_folder(tmp_path, {f"model.{n}": t for n, t in odd_parts().items()})
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        model = odd_model(init_device_mesh("cpu", (2,)))
        found = load_reported(model, folder, Prefixed(None))
        expected = {"uneven": [slice(0, 3), slice(3, 5)], "single": [slice(0, 1), slice(1, 1)]}
        for name, whole in odd_parts().items():
            local = model.get_parameter(name).to_local()
            if name in expected:
                assert torch.equal(local, whole[expected[name][rank]]), name
            elif name == "columns":
                assert torch.equal(local, whole[:, [slice(0, 3), slice(3, 5)][rank]]), name
            elif name == "replica":
                assert torch.equal(local, whole), name
    finally:
        dist.destroy_process_group()
        release_meshes()  # DTensor's caches keep the mesh, and with it this rank's place
    # float64 elements: rows of 5 cut 3 + 2, 1 row cut 1 + 0, 5 columns cut 3 + 2, a
    # replica of 2, a strided shard of 8 read whole
    elements = [9 + 4 + 9 + 2 + 8, 6 + 0 + 6 + 2 + 8][rank]
    assert found == {"read": elements * 8, "size": 44 * 8, "whole": 1, "tensors": 5}
