"""A rank reads only its slice of a Hugging Face folder's tensors that are stored as
they are held (``StateDictAdapter.stored_as``), and the rest whole: a region read is
the whole tensor cut, and on 2 ranks (gloo, FSDP2) a folder transformers wrote loads
into the ``hf`` family exactly as the whole-tensor path loads it, each rank reading
half the folder's bytes (the numbers ``load_hf_into`` logs)."""
from __future__ import annotations

import gc
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from composer.checkpoint.hf import load_hf_into, open_hf
from composer.spec import StateDictAdapter
from tests.harness import launch

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


# ---------------------------------------------------------------- on 2 ranks

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
    sizes = {"fsdp.uneven": (5, 3), "fsdp.single": (1, 4), "columns": (3, 5),
             "replica": (2,), "strided": (4, 2)}
    return {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
            + 100 * i for i, (name, shape) in enumerate(sizes.items())}


def odd_model(mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from composer.compat import strided_shard
    parts = {name: torch.zeros_like(t) for name, t in odd_parts().items()}
    model, model.fsdp = nn.Module(), nn.Module()
    model.fsdp.uneven = nn.Parameter(parts["fsdp.uneven"])
    model.fsdp.single = nn.Parameter(parts["fsdp.single"])
    fully_shard(model.fsdp, mesh=mesh)
    for name, placement in (("columns", Shard(-1)), ("replica", Replicate()),
                            ("strided", strided_shard(0, 2))):
        setattr(model, name, nn.Parameter(distribute_tensor(parts[name], mesh, [placement])))
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


def hf_model(folder: Path, mesh) -> nn.Module:
    """The ``hf`` family's model of ``folder``, FSDP2 over ``mesh``, in float64."""
    from torch.distributed.fsdp import fully_shard

    from composer.models import hf
    torch.set_default_dtype(torch.float64)
    model = hf.spec.build_meta(hf.HFLayout.args_from_folder(folder))
    for block in hf.blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model.to_empty(device="cpu")


def distributed_check(out: Path) -> None:
    """On every rank: the llama folder into the ``hf`` family read in slices and read
    whole, and the odd-shaped model; each rank records what it read and whether its
    parts are exact."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # every rank imports transformers' Llama at once, not once rank 0 has written the folder
    from transformers import LlamaForCausalLM  # noqa: F401

    from composer.models.hf import HFLayout
    from tests.hf_folders import make
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if rank == 0:
        make("llama", out / "llama")
    dist.barrier()
    args = HFLayout.args_from_folder(out / "llama")

    class Whole(HFLayout):
        def stored_as(self, ours):
            return None

    sliced, whole = hf_model(out / "llama", mesh), hf_model(out / "llama", mesh)
    found = {"sliced": load_reported(sliced, out / "llama", HFLayout(args)),
             "whole": load_reported(whole, out / "llama", Whole(args))}
    found["exact"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in
                         zip(sliced.parameters(), whole.parameters(), strict=True))
    odd = odd_model(mesh)
    found["odd"] = load_reported(odd, out / "odd", Prefixed(None))
    found["odd_exact"] = {name: torch.equal(p.full_tensor(), odd_parts()[name])
                          for name, p in odd.named_parameters()}
    (out / f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_each_rank_reads_its_half_and_loads_what_the_whole_read_loads(tmp_path):
    write_folder(tmp_path / "odd", {f"model.{n}": t for n, t in odd_parts().items()})
    result = launch([str(tmp_path)], nproc=2, timeout=180, program="tests/test_hf_slices.py")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, found in enumerate(ranks):
        sliced, whole = found["sliced"], found["whole"]
        assert found["exact"], rank
        assert sliced["whole"] == 0 and sliced["read"] <= 0.6 * sliced["size"], (rank, sliced)
        assert whole["whole"] == whole["tensors"] and whole["read"] == whole["size"], whole
        assert all(found["odd_exact"].values()), found["odd_exact"]
        # float64 elements: rows of 5 cut 3 + 2, 1 row cut 1 + 0, 5 columns cut 3 + 2, a
        # replica of 2, a strided shard of 8 read whole
        elements = [9 + 4 + 9 + 2 + 8, 6 + 0 + 6 + 2 + 8][rank]
        assert found["odd"] == {"read": elements * 8, "size": 44 * 8, "whole": 1, "tensors": 5}
    assert sum(found["sliced"]["read"] for found in ranks) == ranks[0]["sliced"]["size"]


if __name__ == "__main__":
    distributed_check(Path(sys.argv[1]))
    gc.collect()  # sharded tensors' cycles go while the interpreter is whole (composer.train.cli)
