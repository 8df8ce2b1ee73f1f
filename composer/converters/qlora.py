"""QLoRA: LoRA on a base whose linears are stored in 4-bit NF4 (torchao's
``NF4Tensor``): ``model.converters = ["qlora"]``, the adapters as section
``lora`` says.

Every linear of every block (and, with ``lora.quantize_output``, the output
head) keeps its frozen weight as 4-bit codes in blocks of 64 elements, each
block with an int8 scale, the scales quantized again in blocks of 256: about
0.52 byte an element. The forward dequantizes a weight to the training dtype
when it multiplies with it; the adapters are LoRA's, in the training dtype.

The model is built, drawn and loaded as for LoRA, in the training dtype; once
its weights are final (``weights_loaded``) each is quantized whole by
``to_nf4``, so every layout holds the same quantized base, and each rank keeps
its FSDP2 shard of it. FSDP2 decides how to gather a weight when it wraps it:
``fsdp_view`` shows it NF4 tensors then, so it gathers codes and scales (half a
byte an element on the wire) and hands the linear an NF4 weight.

Limits, checked before any process group: the weights must divide into NF4's
blocks (under FSDP2, each shard too); tensor parallel cannot cut NF4 (torchao's
NF4 splits only along rows and has no sharded matmul); data parallel needs
FSDP2 (``parallelism.zero_stage`` 2 or 3); float8 and plain LoRA do not go
beside it.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from composer.converters.base import CostHints
from composer.converters.lora import LoRACheckpoint, LoRAConverter
from composer.parallel.materialize import full_tensor
from composer.parallel.tied import tied_groups

log = logging.getLogger(__name__)

BLOCK, SCALER_BLOCK = 64, 256       # torchao's NF4 blocks: codes per scale, scales per factor
QUANTUM = BLOCK * SCALER_BLOCK      # the elements one quantization factor covers


def nf4_bytes_per_element(itemsize: int) -> float:
    """An NF4 weight's bytes per element: 4-bit codes, an int8 scale per block,
    a factor (in the source dtype) per block of scales."""
    return 0.5 + 1 / BLOCK + itemsize / QUANTUM


class NF4Base:
    """Mixed in front of a linear's class: its weight is stored in NF4."""


@functools.cache
def _nf4_class(cls: type) -> type:
    return type(f"NF4{cls.__name__}", (NF4Base, cls), {})


def _to_nf4(weight: torch.Tensor):
    from torchao.quantization import to_nf4  # torchao: imported where it is used
    return to_nf4(weight, block_size=BLOCK, scaler_block_size=SCALER_BLOCK)


def _is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (a fake tensor mode's: it has one)."""
    return getattr(t, "fake_mode", None) is not None


def _is_nf4(t: torch.Tensor) -> bool:
    from torchao.quantization import NF4Tensor
    return isinstance(t, NF4Tensor)


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The linears of ``model`` (a whole model or a stage) whose weight is NF4, by FQN."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, NF4Base)}


def candidates(model: nn.Module, spec, quantize_output: bool) -> dict[str, nn.Linear]:
    """The linears QLoRA stores in NF4: every block's, and the output head's if asked."""
    inside = {id(m) for block in spec.held_blocks(model) for m in block.modules()}
    logits = spec.adapters.logits_modules
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and (
        id(m) in inside or (quantize_output and fqn.rsplit(".", 1)[-1] in logits))}


def _empty_like(w: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``w``'s shape, dtype and placements, not NF4."""
    if isinstance(w, DTensor):
        local = w.to_local()
        return DTensor.from_local(torch.empty(local.shape, dtype=w.dtype, device=local.device),
                                  w.device_mesh, w.placements, run_check=False, shape=w.shape,
                                  stride=w.stride())
    return torch.empty(w.shape, dtype=w.dtype, device=w.device)


def quantized(w: torch.Tensor) -> torch.Tensor:
    """``to_nf4`` of the whole weight ``w`` (gathered if it is sharded), and this
    rank's shard of it where ``w`` is one: the same quantized base on every layout.
    A fake ``w`` (a dry run: shapes, no values) quantizes its shard alone, the same
    shapes for a world's share of the work."""
    if isinstance(w, DTensor) and _is_fake(w.to_local()):
        shard = _rebuilt(_to_nf4(w.to_local().detach()), True, n_blocks=w.numel() // BLOCK)
        return DTensor.from_local(shard, w.device_mesh, w.placements, run_check=False,
                                  shape=w.shape, stride=w.stride())
    nf4 = _to_nf4(full_tensor(w).detach())
    if not isinstance(w, DTensor):
        return nf4
    mesh = w.device_mesh
    for dim, placement in enumerate(w.placements):
        if isinstance(placement, Shard):  # FSDP2's rows
            nf4 = torch.chunk(nf4, mesh.size(dim))[mesh.get_local_rank(dim)]
    return DTensor.from_local(_own_storage(nf4), mesh, w.placements, run_check=False,
                              shape=w.shape, stride=w.stride())


def _own_storage(nf4):
    """``nf4`` (a chunk of an NF4 weight) with codes and scales of its own: torchao's
    chunk gives views into the whole weight's (a rank would keep the whole base alive),
    and its ``clone`` quantizes the dequantized values again (other codes)."""
    return _rebuilt(nf4, clone=True)


def _rebuilt(nf4, clone: bool = False, **meta):
    """``nf4`` made again from its parts (cloned with unit strides, which FSDP2's byte
    views need even of one element, or with other ``meta``: a shard quantized alone
    counts the whole weight's blocks, as torchao's chunk does)."""
    names, kept = nf4.__tensor_flatten__()
    inner = {name: getattr(nf4, name) for name in names}
    if clone:
        inner = {name: t.clone(memory_format=torch.contiguous_format) for name, t in inner.items()}
    return type(nf4).__tensor_unflatten__(inner, {**kept, **meta}, nf4.shape, nf4.stride())


@torch.no_grad()
def round_trip(model: nn.Module, spec, quantize_output: bool) -> None:
    """Give the linears QLoRA would store in NF4 the weights NF4 gives back
    (what its adapters were trained on), in place: for merging adapters into
    a base held whole, in the training dtype."""
    for m in candidates(model, spec, quantize_output).values():
        m.weight.copy_(_to_nf4(m.weight.detach()).get_original_weight())


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: an NF4 weight, or an FSDP2 shard of one, dequantized to its
    dtype before it is gathered."""
    if isinstance(t, DTensor) and _is_nf4(t.to_local()):
        t = DTensor.from_local(t.to_local().get_original_weight(), t.device_mesh, t.placements,
                               run_check=False, shape=t.shape, stride=t.stride())
    elif _is_nf4(t):
        return t.get_original_weight()
    return full_tensor(t)


class NF4Costs(CostHints):
    """NF4 weights are kept, and gathered by FSDP2, in NF4's bytes."""

    def gathered_itemsize(self, module: nn.Module, name: str) -> float | None:
        return self.stored_itemsize(module, name)

    def stored_itemsize(self, module: nn.Module, name: str) -> float | None:
        if not (isinstance(module, NF4Base) and name == "weight"):
            return None
        return nf4_bytes_per_element(module.weight.element_size())

    def unpacked_bytes(self, module: nn.Module, name: str, itemsize: int) -> float:
        """torchao dequantizes the whole weight for each matmul (forward and input
        gradient), holding at once both nibbles' codes as int64 (8 bytes an element),
        their values and scaled values (half the elements each) and the result."""
        if not (isinstance(module, NF4Base) and name == "weight"):
            return 0.0
        return 8 + 3 * itemsize


class QLoRAConverter(LoRAConverter):
    """``model.converters = ["qlora"]``: LoRA's adapters, checkpoints and export
    on a base whose block linears (and output head, if asked) are NF4."""

    def __init__(self, config, job):
        super().__init__(config, job)
        self.checkpoint = LoRACheckpoint(config, whole=dequantized, base=self.cfg.model.hf_path)
        self.costs = NF4Costs()

    def check(self, meta: nn.Module) -> None:
        others = [c for c in self.cfg.model.converters if c != "qlora"]
        if others:
            raise ValueError(f"model.converters={self.cfg.model.converters}: 'qlora' is LoRA on an "
                             f"NF4 base and takes no {others[0]!r} beside it")
        super().check(meta)
        d, p = self.dims, self.cfg.parallelism
        if d.tp > 1:
            raise ValueError(f"parallelism.tensor_parallel_degree={d.tp} with qlora: torchao's NF4 "
                             f"weights cannot be cut by tensor parallel (they split only along "
                             f"rows and have no sharded matmul); allowed: 1")
        if d.dp_enabled and p.zero_stage < 2:
            raise ValueError(f"parallelism.zero_stage={p.zero_stage} with qlora on {d.replicas} "
                             f"data-parallel ranks: DDP would broadcast the NF4 base, "
                             f"which torchao cannot; allowed: 2, 3 (FSDP2)")
        shards = d.dp_shard * d.cp if d.dp_enabled else 1
        if d.dp_enabled and shards == 1:
            raise ValueError("qlora with data_parallel_shard_degree x context_parallel_degree = 1 "
                             "under HSDP: torch's one-shard FSDP2 path drops NF4's gathered "
                             "scales; shard over at least 2 ranks")
        logits = set(self.spec.adapters.logits_modules)
        tied_head = any(name.rpartition(".")[0].rpartition(".")[2] in logits
                        for group in tied_groups(meta) for name in group)
        if self.config.quantize_output and tied_head:
            raise ValueError(f"lora.quantize_output=true: the output head of "
                             f"{self.cfg.model.flavor} is tied to the embedding, which cannot "
                             f"look up NF4 rows; allowed: false")
        for fqn, m in candidates(meta, self.spec, self.config.quantize_output).items():
            rows, cols = m.weight.shape
            if m.weight.numel() % (QUANTUM * shards) or rows % shards:
                over = (f", and over {shards} FSDP2 shards {rows} rows and each shard's"
                        if shards > 1 else "")
                raise ValueError(
                    f"model.converters=['qlora']: {fqn}.weight [{rows}, {cols}] of "
                    f"{self.spec.name}/{self.cfg.model.flavor} cannot be stored in NF4: its "
                    f"{m.weight.numel():,} elements{over} must divide into blocks of "
                    f"{BLOCK} x {SCALER_BLOCK} = {QUANTUM:,}; choose a flavor whose linears do "
                    f"(llama3: 'debug256' and up)")

    def convert(self, model: nn.Module) -> None:
        super().convert(model)
        for m in candidates(model, self.spec, self.config.quantize_output).values():
            m.__class__ = _nf4_class(type(m))

    @contextlib.contextmanager
    def fsdp_view(self, model: nn.Module):
        """FSDP2 sees NF4 weights (only their shapes: the model is on meta) and
        sets itself up to gather them as such; then the weights go back to the
        training dtype, to be drawn or loaded, until ``weights_loaded``. A meta weight has
        no values, so each shape is quantized once (torchao's chunked loop over a 70B
        model's weights took 36 s a rank on meta) and the others take its parts."""
        linears = quantized_linears(model).values()
        made: dict = {}
        for m in linears:
            w = m.weight.detach()
            key = (w.shape, w.dtype, w.device)
            nf4 = _rebuilt(made[key]) if key in made else _to_nf4(w)
            if w.is_meta:
                made[key] = nf4
            m.weight = nn.Parameter(nf4, requires_grad=False)
        try:
            yield
        finally:
            for m in linears:
                m.weight = nn.Parameter(_empty_like(m.weight), requires_grad=False)

    def weights_loaded(self, parts: list[nn.Module]) -> None:
        count = 0
        for part in parts:
            for m in quantized_linears(part).values():
                nf4 = quantized(m.weight)
                # The weight in the training dtype goes now (FSDP2 then no longer takes
                # it for the shard it keeps), and FSDP2's load hook takes the NF4 one.
                local = m.weight.to_local() if isinstance(m.weight, DTensor) else m.weight
                local.untyped_storage().resize_(0)
                m.load_state_dict({"weight": nf4}, strict=False, assign=True)
                count += 1
        log.info("qlora: %d linears stored in NF4 (blocks of %d, scales in blocks of %d)", count,
                 BLOCK, SCALER_BLOCK)
