"""What the planner measures of a model whose spec gives no ``TransformerShape``.

``measure`` runs one training step of the converted model on fake tensors (shapes,
dtypes and devices but no data: ``composer.torch_compat.fake_tensor_mode``) at the job's
micro-batch and sequence length, parameters in the compute dtype, tracing the first two
blocks of each kind (blocks with alike parameters): the first stands for itself, the
second for the rest (the first's input needs no gradient where the embedding is
frozen). The model keeps the structure its forward walks: each block not traced is
replaced where it sits (in its nn.ModuleList, nn.Sequential, nn.ModuleDict or attribute)
by a ``StandIn`` without weights that hands the hidden states it is called with back as
its block's output, so a forward that loops over its own blocks, however it holds them,
runs as written. Its forward, the loss (``composer.trainer.loss.loss_sum``) and the
backward run. Per token, for each block traced and for what runs before the blocks (``first``: the
embedding) and after them (``last``: the head and the loss), it measures

- what autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``), by
  the piece's top-level module: each storage once, by identity (every fake tensor's
  ``data_ptr()`` is 0), parameters and buffers left out; and the forward's output
  (the logits), which the trainer holds until backward;
- what activation checkpointing keeps instead: a block's input (full), and the
  outputs of the ops selective-op AC saves;
- the widest tensors a block saves (a block's backward holds their gradients at
  once), what MoE experts save, and the last trainable parameter a block's forward
  reads (its backward's first gradient);
- FLOPs, forward and backward (``torch.utils.flop_counter.FlopCounterMode``), with
  attention as model FLOPs count it: the backward twice the forward, not the
  kernel's recomputation of the scores;
- the ops launched, forward and backward, views left out, and the bytes the
  memory-bound ones read and write (every op but the GEMMs and the fused attention
  kernels, which the time model prices by their FLOPs): a backward op belongs to the
  piece whose forward made its autograd node (nodes are numbered as they are made);
- the sizes the traffic and time model read: the residual stream's width (a
  block's input), the vocabulary (the logits), the attention heads (the attention
  kernel's q and k), the experts (the stacked weights of an MoE layer's ``experts``)
  and their top-k (the rows its experts get per token).

Tensor parallel's share: what is saved inside a module of the plan's ``norm`` style
lies on the residual stream, which sequence parallel cuts; of the rest, the part
that shrinks when the step runs again with the plan's sharded weights cut ``f`` ways
is what tp divides, the rest stays whole, as the shape path divides heads and hidden
features but not the linears' gathered inputs. An MoE layer's ``torch.bincount``
(its tokens per expert, which fake tensors cannot know) is taken as even: balanced
routing, as the shape path assumes; so are the tokens an expert gets from a router
written as a loop (``torch.where(chosen == i)`` on ``torch.topk``'s indices): an
``n``-way router's ``k`` choices per token give each expert ``tokens * k / n`` rows.
"""
from __future__ import annotations

import bisect
import copy
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from composer import torch_compat
from composer.parallel.activation import KEPT_OPS
from composer.parallel.tensor import sharded_dim
from composer.spec import DecoderSizes, ModelSpec
from composer.trainer.loss import loss_sum

# the GEMMs, which the time model prices by shape (composer.planner.roofline)
GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten.baddbmm.default}
WIDEST = 3  # SwiGLU's backward holds the gradients of its three hidden tensors at once
FIRST, LAST = "first", "last"


@dataclass(frozen=True)
class Split:
    """Bytes per token, by what divides them on a layout."""

    stream: float = 0.0  # on the residual stream: sequence parallel divides it by tp
    cut: float = 0.0     # in what tensor parallel cuts (heads, hidden features, vocabulary)
    whole: float = 0.0

    def share(self, tp: int, sequence_parallel: bool, cut: bool = True) -> float:
        """What one of ``tp`` ranks holds (``cut``: whether the cut part stays cut)."""
        stream = self.stream / tp if sequence_parallel else self.stream
        return stream + (self.cut / tp if cut else self.cut) + self.whole


@dataclass
class Piece:
    """A traced block, or what runs before (``first``) or after (``last``) the blocks."""

    saved: dict[str, Split] = field(default_factory=dict)  # by the piece's top-level module
    kept: Split = Split()    # the outputs selective-op AC keeps
    widest: Split = Split()  # the WIDEST widest saved tensors
    routed: Split = Split()  # what MoE experts save
    input_bytes: float = 0.0  # a block's input
    flops: float = 0.0        # forward and backward; ``last`` holds all outside the blocks
    last_param: str | None = None  # the last trainable parameter read, under the block
    traffic: Split = Split()  # bytes the memory-bound ops read and write, forward and backward
    launches: int = 0         # ops launched in a microbatch's forward and backward (no views)


@dataclass(frozen=True)
class Profile(DecoderSizes):
    """A traced model: the sizes the planner reads (as a TransformerShape's) and its
    pieces, measured at one compute dtype and sequence length."""

    compute_dtype: torch.dtype
    seq_len: int
    n_experts: int
    top_k: int
    moe_layers: frozenset[int]
    blocks: list[Piece]  # per layer; alike blocks share one
    first: Piece
    last: Piece

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def flops_per_token(self) -> float:
        return self.last.flops + sum(b.flops for b in self.blocks)


def _ref(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _attention_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _attention_backward(grad, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return 2 * sdpa_flop_count(query, key, value)  # the gradients' four matmuls


class RoutedRows:
    """A router written as a loop, as balanced routing gives it: each expert's tokens
    are the true entries of a mask shaped like the last ``torch.topk``'s indices
    (``torch.where(chosen == i)``): ``1 / n`` of them, ``n`` the width ``topk`` chose from.
    Fake tensors know neither the mask nor its count."""

    def __init__(self):
        self.last: tuple[tuple[int, ...], int] | None = None  # (indices' shape, of n)

    def saw_topk(self, scores: torch.Tensor, out) -> None:
        self.last = (tuple(out[1].shape), scores.shape[-1])

    def rows(self, mask: torch.Tensor) -> int | None:
        """The rows an expert gets from ``mask``; None where it is no share of the choices."""
        if self.last and mask.dtype == torch.bool and tuple(mask.shape) == self.last[0]:
            return mask.numel() // self.last[1]
        return None


class _EvenCounts(TorchFunctionMode):
    """What fake tensors cannot know of routing, as balanced routing gives it, in real
    tensors: ``torch.bincount`` as even counts over its ``minlength`` bins; the indices
    of an expert's share of the choices (``torch.where(mask)``, ``nonzero``,
    ``argwhere``: ``RoutedRows``)."""

    WHERE = {torch.where, torch.nonzero, torch.Tensor.nonzero, torch.argwhere}

    def __init__(self):
        super().__init__()
        self.routed = RoutedRows()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.bincount:
            return self._bincount(args, kwargs)
        if func in self.WHERE and len(args) + len(kwargs) == 1:
            mask = args[0] if args else next(iter(kwargs.values()))
            rows = self.routed.rows(mask)
            if rows is not None:
                return self._true_entries(func, mask, rows)
        out = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk):
            self.routed.saw_topk(args[0], out)
        return out

    @staticmethod
    def _bincount(args, kwargs):
        bins = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
        if not bins:
            raise ValueError("torch.bincount without minlength: its bins are unknown on "
                             "fake tensors")
        total = args[0].numel()
        with torch_compat.real_tensors():
            return torch.tensor([total // bins + (i < total % bins) for i in range(bins)])

    @staticmethod
    def _true_entries(func, mask: torch.Tensor, rows: int):
        with torch_compat.real_tensors():
            index = torch.zeros(rows, mask.dim(), dtype=torch.long)
        if func is torch.where:
            return tuple(index.unbind(1))
        return index


class StandIn(nn.Module):
    """A block the trace skips, where it sits: no weights; it hands back the hidden states
    it is called with (its first argument, or its first tensor by keyword) in the place
    of the first tensor of what its traced twin returned (a tensor, or a tuple)."""

    def __init__(self, twin: list):
        super().__init__()
        self.twin = twin  # [what the traced block of its kind returned last]

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else next(v for v in kwargs.values()
                                           if isinstance(v, torch.Tensor))
        out = self.twin[0] if self.twin else hidden
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            return type(out)([hidden, *out[1:]])
        return hidden


def stand_in(model: nn.Module, names: list[str], alike: list[int]) -> nn.Module:
    """``model`` with each block (of ``names``) that is not traced (``alike[i] != i``)
    replaced, where it sits, by a ``StandIn`` for the traced block of its kind."""
    outputs: dict[int, list] = {}
    for i, traced in enumerate(alike):
        if traced == i:
            continue
        if traced not in outputs:
            outputs[traced] = []
            model.get_submodule(names[traced]).register_forward_hook(
                partial(_remember, outputs[traced]))
        parent, _, name = names[i].rpartition(".")
        setattr(model.get_submodule(parent), name, StandIn(outputs[traced]))
    return model


def _remember(store: list, module, args, output) -> None:
    store[:] = [output]


class _Recorder(torch_compat.TorchDispatchMode):
    """What one traced step saves, keeps and reads, per piece, in bytes per token."""

    def __init__(self, model: nn.Module, blocks: list[str], styles: dict[str, str],
                 experts: set[str], tokens: int):
        super().__init__()
        self.blocks, self.styles, self.experts, self.tokens = set(blocks), styles, experts, tokens
        self.excluded = {_ref(t) for t in (*model.parameters(), *model.buffers())}
        self.params = {_ref(p): n for n, p in model.named_parameters() if p.requires_grad}
        self.seen: set = set()
        self.seen_kept: set = set()
        self.piece, self.stack, self.forward = FIRST, [], True
        self.saved: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.widths: dict[str, list[float]] = defaultdict(list)
        self.kept: dict[str, float] = defaultdict(float)
        self.routed: dict[str, float] = defaultdict(float)
        self.inputs: dict[str, float] = {}
        self.last_param: dict[str, str] = {}
        self.flops: dict[str, float] = {}
        self.dim = self.expert_rows = 0
        self.heads: tuple[int, int, int] = (0, 0, 0)
        self.attention = torch_compat.attention_ops()
        self.priced = (torch_compat.attention_kernels() | torch_compat.scaled_and_grouped_mm_ops()
                       | GEMMS)
        self.aliases = torch_compat.untracked_views()
        self.traffic: dict[str, float] = defaultdict(float)
        self.launches: dict[str, int] = defaultdict(int)
        self.numbers: list[tuple[int, str]] = [(0, FIRST)]  # the first node of each piece
        for name, module in model.named_modules():
            module.register_forward_pre_hook(partial(self._enter, name), with_kwargs=True)
            module.register_forward_hook(partial(self._leave, name))

    def _bytes(self, tensors) -> float:
        refs = {_ref(t): t.untyped_storage().nbytes() for t in tensors
                if isinstance(t, torch.Tensor)}
        return sum(n for ref, n in refs.items() if ref not in self.excluded) / self.tokens

    def _enter(self, name: str, module, args, kwargs) -> None:
        self.stack.append(name)
        if name in self.blocks:
            self.piece, self.dim = name, args[0].shape[-1]
            self.inputs[name] = self._bytes([*args, *kwargs.values()])
            self.numbers.append((torch_compat.next_node_number(), name))
        if name in self.experts:
            self.expert_rows = args[0].shape[0]

    def _leave(self, name: str, module, args, output) -> None:
        self.stack.pop()
        if name in self.blocks:
            self.piece = LAST
            self.numbers.append((torch_compat.next_node_number(), LAST))

    def _child(self) -> str:
        """The piece's top-level module now running (of a block: the block's child)."""
        if self.piece in self.blocks:
            at = self.stack.index(self.piece) + 1
            return self.stack[at].rpartition(".")[2] if at < len(self.stack) else "block"
        if len(self.stack) > 1:
            return self.stack[1]
        return "model" if self.stack else "loss"

    def add(self, t: torch.Tensor, child: str | None = None) -> None:
        """Count the storage of ``t`` (saved for backward) once."""
        ref = _ref(t)
        if ref in self.excluded or ref in self.seen:
            return
        self.seen.add(ref)
        size = t.untyped_storage().nbytes() / self.tokens
        stream = bool(self.stack) and self.styles.get(self.stack[-1]) == "norm"
        self.saved[(self.piece, child or self._child())][0 if stream else 1] += size
        if not stream:
            self.widths[self.piece].append(size)
        if any(name in self.experts for name in self.stack):
            self.routed[self.piece] += size

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.forward:
            self._note(func, args, out)
        made = tensors_in(out)
        if made and not func.is_view and func not in self.aliases:  # a kernel ran
            piece = self.piece if self.forward else self._backward_piece()
            self.launches[piece] += 1
            if func not in self.priced:
                moved = [*tensors_in((args, kwargs)), *made]
                self.traffic[piece] += sum(t.nbytes for t in moved) / self.tokens
        return out

    def _backward_piece(self) -> str:
        """The piece whose forward made the autograd node running now."""
        number = torch_compat.running_node_number()
        if number is None:
            return LAST
        return self.numbers[bisect.bisect_right(self.numbers, (number, "\uffff")) - 1][1]

    def _note(self, func, args, out) -> None:
        if func in KEPT_OPS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and _ref(t) not in self.seen_kept:
                    self.seen_kept.add(_ref(t))
                    self.kept[self.piece] += t.untyped_storage().nbytes() / self.tokens
        if func in self.attention and not self.heads[0]:
            self.heads = (args[0].shape[1], args[1].shape[1], args[0].shape[-1])
        for t in args:
            if isinstance(t, torch.Tensor) and _ref(t) in self.params:
                self.last_param[self.piece] = self.params[_ref(t)]

    def count_flops(self, counter: FlopCounterMode, root: str) -> None:
        counts = counter.get_flop_counts()
        for name in self.blocks:
            self.flops[name] = sum(counts.get(f"{root}.{name}", {}).values()) / self.tokens
        self.flops[LAST] = counter.get_total_flops() / self.tokens - sum(self.flops.values())

    def widest(self, piece: str) -> float:
        return sum(sorted(self.widths[piece])[-WIDEST:])


def tensors_in(tree) -> list[torch.Tensor]:
    """The tensors in ``tree``, through tuples, lists and dicts' values."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = tree.values()
    elif not isinstance(tree, (tuple, list)):
        return []
    return [t for item in tree for t in tensors_in(item)]


def _materialize(model: nn.Module, compute: torch.dtype, storage: torch.dtype) -> nn.Module:
    """``model`` (on meta) with fake tensors for its own: floating parameters in the
    compute dtype (as FSDP2 casts them), floating buffers in the storage dtype; tied
    parameters stay tied."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, dtype: torch.dtype, param: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return made[id(t)]

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, fake(p, compute, True))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, fake(b, storage, False))
    return model


# styles whose module's forward sees whole tensors on a rank (its output gathered, its
# input whole): their weights are cut, their activations are not
WHOLE_ON_A_RANK = ("colwise_gathered", "rowwise_split_input")


def _narrow(model: nn.Module, styles: dict[str, str], ways: int) -> None:
    """Cut each weight the tensor-parallel plan shards ``ways`` ways, as one rank holds it
    (but those of modules that run whole on a rank: ``WHOLE_ON_A_RANK``)."""
    for name, module in model.named_modules():
        if styles.get(name) in WHOLE_ON_A_RANK:
            continue
        weight = getattr(module, "weight", None)
        weight_shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        for pname, p in list(module.named_parameters(recurse=False)):
            dim = sharded_dim(styles.get(name), tuple(p.shape), weight_shape)
            if dim is not None:
                shape = list(p.shape)
                shape[dim] //= ways
                setattr(module, pname, nn.Parameter(torch.empty(shape, dtype=p.dtype),
                                                    requires_grad=p.requires_grad))


def _step(model: nn.Module, keep: list[str], styles: dict[str, str], experts: set[str],
          job: tuple, ways: int) -> tuple[_Recorder, int]:
    """One traced training step of ``model`` (on meta; pruned to ``keep``) with its sharded
    weights cut ``ways`` ways; (its recorder, the vocabulary)."""
    dtypes, batch, seq_len = job
    flops = FlopCounterMode(display=False, custom_mapping=dict(zip(
        torch_compat.cpu_attention_ops(), (_attention_forward, _attention_backward))))
    model = copy.deepcopy(model)
    with torch_compat.fake_tensor_mode():
        fake = _materialize(model, *dtypes)
        if ways > 1:
            _narrow(fake, styles, ways)
        recorder = _Recorder(fake, keep, styles, experts, batch * seq_len)
        tokens, targets = (torch.zeros(batch, seq_len, dtype=torch.long) for _ in range(2))
        with _EvenCounts(), flops, recorder:
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
                logits = fake(tokens)
                recorder.add(logits, "logits")
                loss = loss_sum(logits, targets)
            recorder.forward = False
            loss.backward()
        recorder.count_flops(flops, type(fake).__name__)
    return recorder, logits.shape[-1]


def _split(stream: float, rest: float, narrowed: float, ways: int) -> Split:
    cut = (rest - narrowed) * ways / (ways - 1) if ways > 1 else 0.0
    return Split(stream, cut, rest - cut)


def _piece(name: str, full: _Recorder, narrowed: _Recorder, ways: int, prefix: str) -> Piece:
    """Piece ``name`` from the step as is and the step with the sharded weights cut."""
    split = partial(_split, ways=ways)
    children = sorted(child for piece, child in full.saved if piece == name)
    saved = {child: split(*full.saved[(name, child)], narrowed.saved[(name, child)][1])
             for child in children}
    last = full.last_param.get(name)
    return Piece(saved, split(0.0, full.kept[name], narrowed.kept[name]),
                 split(0.0, full.widest(name), narrowed.widest(name)),
                 split(0.0, full.routed[name], narrowed.routed[name]),
                 full.inputs.get(name, 0.0), full.flops.get(name, 0.0),
                 last.removeprefix(prefix) if last else None,
                 split(0.0, full.traffic[name], narrowed.traffic[name]), full.launches[name])


def _alike(blocks: list[nn.Module]) -> list[int]:
    """Per block, the block traced for it: the first of its kind (blocks with alike
    parameters) for itself, the second for the rest, whose input may need a gradient
    where the first's does not (a frozen embedding's output)."""
    kinds: dict[Any, list[int]] = {}
    out = []
    for i, block in enumerate(blocks):
        kind = (type(block), tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                                   for n, p in block.named_parameters()))
        traced = kinds.setdefault(kind, [])
        if len(traced) < 2:
            traced.append(i)
        out.append(i if traced[-1] == i else traced[1])
    return out


def tp_ways(sizes: dict[str, int]) -> int:
    """The fewest ranks (> 1) tensor parallel could cut every size in ``sizes`` over (1: none)."""
    common = math.gcd(*sizes.values()) if sizes else 0
    return next((k for k in range(2, common + 1) if common % k == 0), 1)


def _sizes(recorder: _Recorder, vocab: int, model: nn.Module, experts: set[str],
           names: list[str]) -> dict:
    """The sizes the traffic and time model read, as the traced step showed them."""
    n_heads, n_kv_heads, head_dim = recorder.heads
    stacked = [next(model.get_submodule(e).parameters()).shape[0] for e in sorted(experts)]
    moe = frozenset(i for i, n in enumerate(names) if any(e.startswith(n + ".") for e in experts))
    return {"dim": recorder.dim, "n_layers": len(names), "n_heads": n_heads,
            "n_kv_heads": n_kv_heads, "head_dim": head_dim, "vocab_size": vocab,
            "n_experts": stacked[0] if stacked else 0,
            "top_k": recorder.expert_rows // recorder.tokens, "moe_layers": moe}


def measure(spec: ModelSpec, args: Any, model: nn.Module, styles: dict[str, str],
            dtypes: tuple[torch.dtype, torch.dtype], batch: int, seq_len: int) -> Profile:
    """The profile of ``model`` (converted, on meta) of ``spec`` and ``args``; ``styles``:
    module FQN -> its named TP style; ``dtypes``: (compute, storage). ValueError, in one
    line, where its step cannot run on fake tensors."""
    names = spec.block_names(model)
    alike = _alike(spec.blocks(model))
    keep = [names[i] for i in sorted(set(alike))]
    moe = spec.parallel.moe_modules(model) if spec.parallel.moe_modules else {}
    experts = {f"{name}.experts" for name in moe}
    pruned = stand_in(copy.deepcopy(model), names, alike)
    ways = tp_ways(spec.parallel.tp_divisible(args)) if spec.tp_plan is not None else 1
    step = partial(_step, pruned, keep, styles, experts, (dtypes, batch, seq_len))
    try:
        full, vocab = step(1)
        narrowed = step(ways)[0] if ways > 1 else full
    except Exception as e:  # the model's own code, on tensors it was not written for
        text = str(e).strip()
        raise ValueError(f"{type(e).__name__}: {text.splitlines()[0] if text else ''}") from None
    pieces = {name: _piece(name, full, narrowed, ways, f"{name}.") for name in keep}
    return Profile(**_sizes(full, vocab, model, experts, names), compute_dtype=dtypes[0],
                   seq_len=seq_len,
                   blocks=[pieces[names[i]] for i in alike],
                   first=_piece(FIRST, full, narrowed, ways, ""),
                   last=_piece(LAST, full, narrowed, ways, ""))
