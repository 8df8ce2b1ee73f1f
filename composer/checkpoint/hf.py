"""Hugging Face folders: safetensors shards, their index and config.json, written
atomically; the names and conversions come from the model family's
StateDictAdapter (``ModelSpec.adapters.hf_adapter``), nothing here knows a family.

Everything works one tensor at a time, so a sharded or pipelined model is
loaded and a large model exported without holding a full copy in memory; a
rank loading a tensor that is stored as it is reads only its own slice of it.
Weights are read from safetensors only, never through pickle; safetensors (the
``hf`` extra) is imported where a file is read or written.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from composer.parallel.materialize import copy_full_into, full_tensor
from composer.spec import ModelSpec, StateDictAdapter
from composer.torch_compat import local_region

log = logging.getLogger(__name__)


def adapter_of(spec: ModelSpec, args: Any) -> StateDictAdapter:
    """The family's Hugging Face adapter for ``args``; ValueError if it has none."""
    if spec.adapters.hf_adapter is None:
        raise ValueError(f"model {spec.name!r} has no Hugging Face adapter "
                         f"(ModelSpec.adapters.hf_adapter)")
    return spec.adapters.hf_adapter(args)


def load_hf_parts(parts: list[nn.Module], folder: Path, spec: ModelSpec, args: Any,
                  skip: Callable[[str], bool]) -> None:
    """The Hugging Face folder's weights into every model part (through the family's
    adapter), without the keys ``skip`` names (a converter's own)."""
    for part in parts:
        load_hf_into(part, folder, adapter_of(spec, args), skip=skip)
    log.info("initial weights loaded from Hugging Face folder %s", folder)


def _export_names(names: Iterable[str], adapter: StateDictAdapter) -> dict[str, list[str]]:
    """Our name -> its Hugging Face names, keeping the first of names that share
    storage (a tied output is the embedding, stored once)."""
    out: dict[str, list[str]] = {}
    taken: set[str] = set()
    for ours in names:
        keys = adapter.hf_keys(ours)
        if not taken.intersection(keys):
            out[ours] = keys
            taken.update(keys)
    return out


def to_hf(state: dict[str, torch.Tensor], adapter: StateDictAdapter) -> dict[str, torch.Tensor]:
    """Our full state dict in Hugging Face names and layout."""
    out = {}
    for ours in _export_names(state, adapter):
        out.update(adapter.to_hf(ours, state[ours]))
    return out


def from_hf(state: dict[str, torch.Tensor], adapter: StateDictAdapter,
            names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Our tensors ``names`` from a Hugging Face state dict (a tied output reads
    the embedding)."""
    return {ours: adapter.from_hf(ours, state.__getitem__) for ours in names}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def writing_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``folder`` to fill; on success it replaces
    ``folder`` by renames, so a crash leaves the old folder (or none), never a
    half-written one."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    mode = 0o666 & ~_umask()  # safetensors writes its files 0600: serving accounts read them
    for file in tmp.rglob("*"):
        if file.is_file():
            file.chmod(mode)
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def _shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_shard_bytes`` (a larger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _shard_file(index: int, count: int) -> str:
    return ("model.safetensors" if count == 1
            else f"model-{index + 1:05d}-of-{count:05d}.safetensors")


def _write_hf(folder, shards: Iterable[dict[str, torch.Tensor]], count: int, config: dict,
              files: list | None, write: bool) -> None:
    """Consume ``shards`` (all ``count`` of them, also when not writing: producing
    them may be collective) and, if ``write``, save them as a Hugging Face folder."""
    if not write:
        for _ in shards:
            pass
        return
    from safetensors.torch import save_file
    weight_map, total = {}, 0
    with writing_folder(folder) as tmp:
        for index, shard in enumerate(shards):
            file = _shard_file(index, count)
            save_file({k: v.contiguous() for k, v in shard.items()}, tmp / file,
                      metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            total += sum(v.numel() * v.element_size() for v in shard.values())
        if count > 1:
            index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for extra in files or []:
            shutil.copy(extra, tmp / Path(extra).name)


def save_hf(folder, state_hf: dict[str, torch.Tensor], config: dict,
            max_shard_bytes: int = 5 * 2**30, files: list | None = None) -> None:
    """Write ``state_hf`` (Hugging Face names) and ``config`` as a Hugging Face
    model folder, replacing ``folder`` atomically; ``files`` (e.g. the tokenizer's)
    are copied in."""
    sizes = {k: v.numel() * v.element_size() for k, v in state_hf.items()}
    plan = _shard_plan(sizes, max_shard_bytes)
    shards = ({k: state_hf[k] for k in names} for names in plan)
    _write_hf(folder, shards, len(plan), config, files, write=True)


def hf_names(folder) -> list[str]:
    """Names of the tensors stored in a Hugging Face model folder."""
    return list(_weight_map(Path(folder)))


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    from safetensors import safe_open
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single.name)


class FolderReader:
    """``reader(name)`` reads one stored tensor of a Hugging Face folder whole,
    ``reader.region(...)`` only a region of it (safetensors slices the memory map),
    and the reader counts what it read: ``load_hf_into`` reports it."""

    def __init__(self, folder: Path):
        self.folder, self.weight_map = folder, _weight_map(folder)
        self.bytes_read, self.whole, self.parts = 0, 0, 0

    @contextmanager
    def _open(self, name: str):
        from safetensors import safe_open
        if name not in self.weight_map:
            raise ValueError(f"tensor {name!r} is missing from {self.folder}")
        with safe_open(self.folder / self.weight_map[name], framework="pt") as f:
            yield f

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def __call__(self, name: str) -> torch.Tensor:
        with self._open(name) as f:
            tensor = f.get_tensor(name)
        self.whole += 1
        return self._counted(tensor)

    def region(self, name: str, offset: Sequence[int], shape: Sequence[int],
               check: Callable[[tuple[int, ...]], None] = lambda shape: None) -> torch.Tensor:
        """The part of tensor ``name`` of ``shape`` at ``offset``, read after
        ``check(its whole shape)`` (which raises for a tensor of the wrong shape)."""
        with self._open(name) as f:
            stored = f.get_slice(name)
            check(tuple(stored.get_shape()))
            part = stored[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        self.parts += 1
        return self._counted(part)

    def size(self) -> int:
        """Bytes of tensor data the folder holds: its shards less their headers (a
        little-endian 8-byte length, then the header)."""
        total = 0
        for file in set(self.weight_map.values()):
            with open(self.folder / file, "rb") as f:
                header = int.from_bytes(f.read(8), "little")
            total += (self.folder / file).stat().st_size - 8 - header
        return total


def open_hf(folder) -> tuple[dict, FolderReader]:
    """config.json of a Hugging Face folder and its reader ``get``: ``get(name)``
    reads that one tensor from its shard (memory-mapped; nothing else is loaded)."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {folder}")
    config = json.loads((folder / "config.json").read_text())
    return config, FolderReader(folder)


def _local_region(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, shape) of this rank's part of ``param`` in its whole tensor; None
    where its placements are not plain shards and replicas (a strided shard, a
    pending sum), whose part is not one region."""
    if not isinstance(param, DTensor):
        return (0,) * param.dim(), tuple(param.shape)
    if not all(type(p) is Shard or type(p) is Replicate for p in param.placements):
        return None
    shape, offset = local_region(param.shape, param.device_mesh, param.placements)
    return tuple(offset), tuple(shape)


def _check_shape(name: str, adapter: StateDictAdapter, ours: tuple, stored: tuple) -> None:
    """Refuse a stored tensor whose shape is not the model's (a folder of another size)."""
    if tuple(stored) != tuple(ours):
        raise ValueError(f"{name} (Hugging Face {', '.join(adapter.hf_keys(name))}): model "
                         f"has shape {tuple(ours)}, file has {tuple(stored)}")


@torch.no_grad()
def _load_part(param: torch.Tensor, name: str, key: str, region: tuple,
               reader: FolderReader, adapter: StateDictAdapter) -> None:
    """Read only this rank's part of ``param`` from ``key``, stored unchanged."""
    check = partial(_check_shape, name, adapter, tuple(param.shape))
    part = reader.region(key, *region, check=check)
    local = param.to_local() if isinstance(param, DTensor) else param
    local.copy_(part.to(device=local.device, dtype=local.dtype))


def load_hf_into(model: nn.Module, folder, adapter: StateDictAdapter,
                 skip: Callable[[str], bool] = lambda name: False) -> None:
    """Fill every parameter ``model`` has (a whole model or a pipeline stage,
    plain or DTensor-sharded) but the ``skip`` ones (e.g. a converter's
    additions) from a Hugging Face folder; each rank keeps its slice. ``adapter``:
    the model family's names, ``spec.adapters.hf_adapter(args)``.

    A tensor stored as it is (``adapter.stored_as``) held as plain shards and
    replicas is read only where this rank holds it; one the adapter converts, or
    a strided shard, is read whole and cut. Each rank logs how much it read.

    >>> import tempfile
    >>> import torch
    >>> from safetensors.torch import save_file
    >>> from composer import StateDictAdapter, load_hf_into
    >>> class Prefixed(StateDictAdapter):  # Hugging Face's names: ours under "model."
    ...     def hf_keys(self, ours): return [f"model.{ours}"]
    ...     def from_hf(self, ours, get): return get(f"model.{ours}")
    ...     def stored_as(self, ours): return f"model.{ours}"  # a rename only
    >>> model = torch.nn.Linear(3, 2)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     save_file({"model.weight": torch.ones(2, 3), "model.bias": torch.zeros(2)},
    ...               f"{folder}/model.safetensors")
    ...     _ = open(f"{folder}/config.json", "w").write("{}")
    ...     load_hf_into(model, folder, Prefixed(3))
    >>> model.weight.sum().item(), model.bias.sum().item()
    (6.0, 0.0)
    """
    _, reader = open_hf(folder)
    for name, param in model.named_parameters():
        if skip(name):
            continue
        key = adapter.stored_as(name)
        region = None if key is None else _local_region(param)
        if region is not None:
            _load_part(param, name, key, region, reader, adapter)
            continue
        tensor = adapter.from_hf(name, reader)
        _check_shape(name, adapter, tuple(param.shape), tuple(tensor.shape))
        copy_full_into(param, tensor)
    for name, buffer in _persistent_buffers(model):  # stored where a library saves them
        if not skip(name) and adapter.stored_as(name) in reader.weight_map:
            buffer.copy_(reader(adapter.stored_as(name)))
    log.info("read %.1f MiB of the folder's %.1f MiB (%d of %d tensors whole)",
             reader.bytes_read / 2**20, reader.size() / 2**20, reader.whole,
             reader.whole + reader.parts)


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers ``model`` saves in its state dict (a transformers activation's
    constants, xIELU's), which its initialisation may not set again."""
    saved = model.state_dict(keep_vars=True)
    for name, buffer in model.named_buffers():
        if name in saved:
            yield name, buffer


def full_tensors(model: nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    """Each tensor of ``model``'s state dict, whole when called (a collective for a DTensor)."""
    return {name: partial(full_tensor, value) for name, value in model.state_dict().items()}


def export_parts(parts: list[nn.Module], converters: list, folder, spec: ModelSpec, args: Any,
                 dtype: torch.dtype, write: bool, files: list | None = None) -> None:
    """``export_hf`` of a run's model parts, each tensor as the converters say it is
    (LoRA's and QLoRA's: the adapters folded into the base); ``files`` are copied in."""
    for part in parts:
        tensors = full_tensors(part)
        for converter in converters:
            tensors = converter.checkpoint.export_tensors(part, tensors)
        export_hf(part, folder, spec, args, dtype, write=write, tensors=tensors, files=files)


def export_hf(model: nn.Module, folder, spec: ModelSpec, args: Any, dtype: torch.dtype,
              write: bool = True, max_shard_bytes: int = 5 * 2**30, files: list | None = None,
              tensors: dict[str, Callable[[], torch.Tensor]] | None = None) -> None:
    """Save ``model`` (of family ``spec``, arguments ``args``) as a Hugging Face
    folder in ``dtype``; ``tensors`` (default ``full_tensors(model)``) says what
    each tensor is, e.g. with LoRA adapters folded in (a converter's
    ``export_tensors``).

    Under FSDP/TP every rank must call this (gathering a DTensor is a collective
    over its mesh) and only the one with ``write`` saves. Tensors are gathered
    shard by shard, so memory holds one output shard at a time. Pipeline stages
    are not supported: each holds only part of the model.

    >>> import json
    >>> import tempfile
    >>> import torch
    >>> from safetensors import safe_open
    >>> from composer import Adapters, ModelSpec, StateDictAdapter, export_hf
    >>> class Prefixed(StateDictAdapter):  # Hugging Face's names: ours under "model."
    ...     def config(self, dtype): return {"model_type": "prefixed", "hidden": self.args}
    ...     def hf_keys(self, ours): return [f"model.{ours}"]
    ...     def to_hf(self, ours, tensor): return {f"model.{ours}": tensor}
    >>> spec = ModelSpec("linear", {"tiny": 3}, build=lambda d: torch.nn.Linear(d, 2),
    ...                  blocks=lambda model: [], adapters=Adapters(hf_adapter=Prefixed))
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     export_hf(torch.nn.Linear(3, 2), folder, spec, 3, torch.bfloat16)
    ...     config = json.load(open(f"{folder}/config.json"))
    ...     with safe_open(f"{folder}/model.safetensors", "pt") as f:
    ...         names, weight = sorted(f.keys()), f.get_tensor("model.weight")
    >>> config, names, weight.dtype
    ({'model_type': 'prefixed', 'hidden': 3}, ['model.bias', 'model.weight'], torch.bfloat16)
    """
    adapter = adapter_of(spec, args)
    tensors = full_tensors(model) if tensors is None else tensors
    names = _export_names(tensors, adapter)
    # refused on every rank alike, before any collective
    reference = spec.build_meta(args).state_dict()
    missing = set(_export_names(reference, adapter)) - set(names)
    if missing:
        raise ValueError(f"export needs the whole model; missing {sorted(missing)[:3]}")
    sizes = {ours: reference[ours].numel() * dtype.itemsize for ours in names}
    plan = _shard_plan(sizes, max_shard_bytes)

    def shard(ours_keys: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for ours in ours_keys:
            full = tensors[ours]()
            if write:  # the others only take part in the gather
                out.update(adapter.to_hf(ours, full.to("cpu", dtype)))
        return out

    shards = (shard(ours_keys) for ours_keys in plan)
    _write_hf(folder, shards, len(plan), adapter.config(dtype), files, write)
