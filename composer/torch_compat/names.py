"""The private names of torch composer uses, looked up here and nowhere else.

Each is a lookup only: a DeviceMesh's flattened and unflattened views, the
functional-collective and c10d ops a dispatch mode sees, the boxed ProcessGroup and Work
those ops hand over, FSDP2's replicate, MemTracker's parts, the CUDA allocator's
history, aten's fused-attention, scaled and grouped matmuls, the foreach kernels, the
strided shard of packed weights, a DTensor shard's place in the whole. A name that has
gone raises one RuntimeError line naming it, instead of an AttributeError deep inside a
training step.

The names torch loads with ``import torch`` resolve when this module is imported; those
of torch.distributed and MemTracker's on first use (then cached), so importing it stays
cheap and the models, which use it, import nothing of torch.distributed.
"""
from __future__ import annotations

import functools
import importlib
import sys

import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from composer.torch_compat.version import WRITTEN_FOR


def missing_api(api: str) -> RuntimeError:
    """The one-line error for a private API this torch lacks."""
    return RuntimeError(f"composer needs torch's private API {api} (written for torch "
                        f"{WRITTEN_FOR}); this torch {torch.__version__} lacks it")


def private(module: str, attribute: str):
    """``attribute`` (a dotted path) of ``module``, importing ``module``; RuntimeError
    naming both when either is missing."""
    try:
        found = importlib.import_module(module)
        for name in attribute.split("."):
            found = getattr(found, name)
    except (ImportError, AttributeError):
        raise missing_api(f"{module}.{attribute}") from None
    return found


resolved = functools.cache(private)


def require(obj, name: str, api: str) -> None:
    if not hasattr(obj, name):
        raise missing_api(api)


# The lazily resolved APIs, (module, attribute), each checked by check_private_apis().
_FLATTEN = ("torch.distributed.device_mesh", "DeviceMesh._flatten")
_UNFLATTEN = ("torch.distributed.device_mesh", "DeviceMesh._unflatten")
_RESOLVE_GROUP = ("torch.distributed.distributed_c10d", "_resolve_process_group")
_PROCESS_GROUP = ("torch._C._distributed_c10d", "ProcessGroup")
_UNBOX_WORK = ("torch._C._distributed_c10d", "Work.unbox")
_PENDING_WORK = ("torch._C._distributed_c10d", "_get_work_registry_size")
_SCRIPT_TYPE = ("torch", "ScriptObject._type")
_ASYNC_TENSOR = ("torch.distributed._functional_collectives", "AsyncCollectiveTensor")
_REPLICATE_FSDP = ("torch.distributed._composable.replicate_with_fsdp", "replicate")
_REPLICATE_DDP = ("torch.distributed._composable.replicate", "replicate")
_MEM_TRACKER = ("torch.distributed._tools.mem_tracker", "MemTracker")
_MEM_TRACKED = ("torch.distributed._tools.mem_tracker",
                "MemTracker._track_module_params_and_buffers")
_MEM_REF_TYPE = ("torch.distributed._tools.mem_tracker", "_MemRefType")
_MEM_PEAK = ("torch.distributed._tools.mem_tracker", "MemTracker._update_peak_stats")
_MEM_TOTAL = ("torch.distributed._tools.mem_tracker", "_TOTAL_KEY")
_MOD_TRACKER = "torch.distributed._tools.mod_tracker"
_MULTI_GRAD_HOOK = (_MOD_TRACKER, "register_multi_grad_hook")
_RECORD_HISTORY = ("torch.cuda.memory", "_record_memory_history")
_DUMP_SNAPSHOT = ("torch.cuda.memory", "_dump_snapshot")
_DYNAMO = "torch._dynamo"
_PROFILER_ENABLED = ("torch.autograd.profiler", "_is_profiler_enabled")
_GROUPED_MM = ("torch", "_grouped_mm")
_STRIDED_SHARD = ("torch.distributed.tensor.placement_types", "_StridedShard")
_LOCAL_REGION = ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
_FAKE_MODE = ("torch._subclasses.fake_tensor", "FakeTensorMode")
_UNSET_FAKE = ("torch._subclasses.fake_tensor", "unset_fake_temporarily")
_FAKE_STORE = ("torch.testing._internal.distributed.fake_pg", "FakeStore")
_SCALAR_READ = ("torch", "ops.aten._local_scalar_dense.default")
_CPU_ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"
_MODULE_APPLY = ("torch.nn", "Module._apply")
# FlexAttention's device check, which refuses CPU inputs that require grad
_FLEX_DEVICE_CHECK = ("torch.nn.attention.flex_attention", "_validate_device")
_FLEX_MODULE = _FLEX_DEVICE_CHECK[0]
_NO_MODES = ("torch.utils._python_dispatch", "_disable_current_modes")
_SHARDING_META = ("torch.distributed.tensor._sharding_prop",
                  "ShardingPropagator._propagate_tensor_meta_non_cached")
_FUNCTIONAL = "_c10d_functional"
_NEXT_NODE_NUMBER = ("torch._C._autograd", "_get_sequence_nr")
_RUNNING_NODE = ("torch._C", "_current_autograd_node")
_ATTENTION = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")
# torch's DTensor caches that hold device meshes (and so, through each mesh's registry,
# its process groups) for as long as the process lives: each entry's clear
_MESH_CACHES = (
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
    ("torch.distributed.tensor._sharding_prop",
     "ShardingPropagator._propagate_tensor_meta_cached.cache_clear"),
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"))
PRIVATE_APIS = (
    *_MESH_CACHES,
    _FLATTEN, _UNFLATTEN, _RESOLVE_GROUP, _PROCESS_GROUP, _UNBOX_WORK, _PENDING_WORK, _SCRIPT_TYPE,
    _ASYNC_TENSOR, _REPLICATE_FSDP, _REPLICATE_DDP, _MEM_TRACKER, _MEM_TRACKED, _MEM_REF_TYPE,
    _MEM_PEAK, _MEM_TOTAL, _MULTI_GRAD_HOOK,
    _RECORD_HISTORY, _DUMP_SNAPSHOT, _PROFILER_ENABLED, _GROUPED_MM, _STRIDED_SHARD,
    _LOCAL_REGION, _MODULE_APPLY, _FLEX_DEVICE_CHECK, _NO_MODES, _SHARDING_META,
    _FAKE_MODE, _UNSET_FAKE, _FAKE_STORE, _SCALAR_READ, _NEXT_NODE_NUMBER, _RUNNING_NODE,
    ("torch", f"ops.aten.{_CPU_ATTENTION}_backward"),
    ("torch", f"ops.{_FUNCTIONAL}.wait_tensor.default"),
    *(("torch", f"ops.c10d._{kind}_base_.default") for kind in ("allgather", "reduce_scatter")),
    *(("torch", f"ops.aten.{name}.default") for name in _ATTENTION))


def check_private_apis() -> None:
    """Resolve every private API named here (imports torch.distributed's): after a torch
    upgrade, the first one missing raises its line."""
    for module, attribute in PRIVATE_APIS:
        resolved(module, attribute)


# Resolved on import: torch loads these modules itself.
TorchDispatchMode = private("torch.utils._python_dispatch", "TorchDispatchMode")
group_tensors_by_device_and_dtype = private("torch.utils._foreach_utils",
                                            "_group_tensors_by_device_and_dtype")
foreach_mul_ = private("torch", "_foreach_mul_")


def set_last_lr(scheduler, lrs: list[float]) -> None:
    """Make ``lrs`` what ``scheduler.get_last_lr()`` returns (torch keeps it privately)."""
    require(scheduler, "_last_lr", "torch.optim.lr_scheduler.LRScheduler._last_lr")
    scheduler._last_lr = lrs


def own_parameters(module: nn.Module) -> dict:
    """``module``'s own parameters by name: nn.Module's live dict, not a copy, so an entry
    can be swapped for the length of a call without registering a parameter."""
    require(module, "_parameters", "torch.nn.Module._parameters")
    return module._parameters


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul: the rows of ``x`` up to each of ``offs`` (int32 running ends)
    times that group's ``weight[g]``, in one kernel (Hopper or newer)."""
    return resolved(*_GROUPED_MM)(x, weight, offs=offs)


def strided_shard(dim: int, parts: int):
    """DTensor's placement of a ``dim`` made of ``parts`` equal parts packed one after
    another, each sharded over the mesh dim: a rank holds its slice of every part."""
    return resolved(*_STRIDED_SHARD)(dim, split_factor=parts)


def is_strided_shard(placement) -> bool:
    """Whether ``placement`` is one of ``strided_shard``'s."""
    return isinstance(placement, resolved(*_STRIDED_SHARD))


def local_region(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's slice of a DTensor of global ``shape`` placed so on ``mesh``: the
    slice's shape and its offset in the whole, per dim."""
    return resolved(*_LOCAL_REGION)(shape, mesh, placements)


def flatten_mesh(mesh, name: str):
    """``mesh``'s dims flattened into one dim called ``name``."""
    return resolved(*_FLATTEN)(mesh, name)


def unflatten_mesh(mesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]):
    """``mesh`` with its dim ``dim`` split into dims ``names`` of ``sizes``."""
    return resolved(*_UNFLATTEN)(mesh, dim, sizes, names)


def functional_collective(name: str):
    """The default overload of the functional collective ``name`` (``all_reduce``,
    ``wait_tensor``, ...): what DTensor issues, as a dispatch mode sees it."""
    return resolved("torch", f"ops.{_FUNCTIONAL}.{name}.default")


def is_functional_collective(op) -> bool:
    """Whether the op overload ``op`` is a functional collective."""
    return op.namespace == _FUNCTIONAL


def c10d_base_op(kind: str):
    """The default overload of c10d's in-place ``allgather`` or ``reduce_scatter`` of one
    flat tensor (``dist.all_gather_into_tensor``, ``dist.reduce_scatter_tensor``)."""
    return resolved("torch", f"ops.c10d._{kind}_base_.default")


def resolve_process_group(name: str):
    """The ProcessGroup registered under ``name`` (a functional collective names its group)."""
    return resolved(*_RESOLVE_GROUP)(name)


def as_process_group(obj):
    """``obj`` as a ProcessGroup where it is one, plain or boxed as c10d ops hand it over;
    else None."""
    group = resolved(*_PROCESS_GROUP)
    if isinstance(obj, group):
        return obj
    if isinstance(obj, torch.ScriptObject) and resolved(*_SCRIPT_TYPE)(
            obj).qualified_name().endswith(".ProcessGroup"):
        return group.unbox(obj)
    return None


def release_meshes() -> None:
    """Empty torch's DTensor caches that keep device meshes alive. A mesh holds its
    process groups, and a gloo group's worker threads end only with the group: kept
    by these caches, they live into the interpreter's teardown, where one that takes
    the GIL (dropping a finished collective's tensors) aborts the process."""
    for module, attribute in _MESH_CACHES:
        resolved(module, attribute)()


def pending_collectives() -> int:
    """How many functional collectives this process issued and never waited for: those a
    step that was stopped midway (Ctrl-C, a fault) left in flight. torch warns about each
    at the process's end, from a static destructor, after leaking them anyway."""
    if "torch.distributed" not in sys.modules:
        return 0
    return resolved(*_PENDING_WORK)()


def unbox_work(work):
    """The Work a c10d op hands over boxed (a ScriptObject), unboxed (it has a future)."""
    return resolved(*_UNBOX_WORK)(work)


def async_collective_tensor() -> type:
    """The tensor subclass a functional collective returns until it is waited for."""
    return resolved(*_ASYNC_TENSOR)


def attention_ops() -> set:
    """The default overloads of aten's fused scaled-dot-product attention kernels."""
    return {resolved("torch", f"ops.aten.{name}.default") for name in _ATTENTION}


def scaled_and_grouped_mm_ops() -> set:
    """The default overloads of aten's scaled (float8) and grouped matmuls, those this
    torch build has."""
    aten = torch.ops.aten
    return {getattr(aten, name).default for name in ("_scaled_mm", "_grouped_mm")
            if hasattr(aten, name)}


def attention_kernels() -> set:
    """The fused attention kernels' forward and backward default overloads this build has."""
    aten = torch.ops.aten
    return {getattr(aten, name + end).default for name in _ATTENTION for end in ("", "_backward")
            if hasattr(aten, name + end)}


def untracked_views() -> set:
    """Ops that return a view autograd does not track as one (no kernel runs)."""
    return {torch.ops.aten._unsafe_view.default}


def next_node_number() -> int:
    """The sequence number autograd gives the next node it makes on this thread: a
    forward's nodes are numbered in the order it makes them."""
    return resolved(*_NEXT_NODE_NUMBER)()


def running_node_number() -> int | None:
    """The sequence number of the autograd node whose backward runs now (None outside one)."""
    node = resolved(*_RUNNING_NODE)()
    return None if node is None else node._sequence_nr()


def cpu_attention_ops() -> tuple:
    """The op packets of the CPU's fused attention kernel, its forward and its backward
    (torch's FLOP counter counts the CUDA kernels only)."""
    return tuple(resolved("torch", f"ops.aten.{_CPU_ATTENTION}{end}") for end in ("", "_backward"))


def fake_tensor_mode():
    """torch's FakeTensorMode: tensors made inside it have shapes, dtypes and devices but no
    data, and real or meta tensors its ops are given are taken as fake ones."""
    return resolved(*_FAKE_MODE)(allow_non_fake_inputs=True)


def real_tensors():
    """A context, inside a fake tensor mode, in which the tensors made are real again."""
    return resolved(*_UNSET_FAKE)()




def init_fake_process_group(rank: int, world_size: int) -> None:
    """The default process group as ``rank`` of ``world_size`` in this one process, with
    torch's test backend whose collectives return at once and move nothing (importing its
    module registers the backend)."""
    store = resolved(*_FAKE_STORE)()
    torch.distributed.init_process_group("fake", store=store, rank=rank, world_size=world_size)


def scalar_read_op():
    """The aten op a tensor's ``.item()`` (and ``.tolist()``, element by element) dispatches."""
    return resolved(*_SCALAR_READ)


def replicate_fsdp(module: nn.Module, **kwargs) -> nn.Module:
    """FSDP2's replicate (DDP on DTensors, taking FSDP's mixed-precision policy)."""
    return resolved(*_REPLICATE_FSDP)(module, **kwargs)


def replicate_ddp(module: nn.Module, **kwargs) -> nn.Module:
    """The composable form of classic DDP (bucketed all-reduce of plain tensors)."""
    return resolved(*_REPLICATE_DDP)(module, **kwargs)


def mem_ref_type():
    """MemTracker's enum of what a tensor is (PARAM, GRAD, OPT, ACT, ...)."""
    return resolved(*_MEM_REF_TYPE)








def record_cuda_memory_history(max_entries: int) -> None:
    """Start recording the CUDA allocator's history (for a memory snapshot)."""
    resolved(*_RECORD_HISTORY)(max_entries=max_entries)


def stop_cuda_memory_history() -> None:
    """Stop recording the CUDA allocator's history and drop it."""
    resolved(*_RECORD_HISTORY)(enabled=None)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the CUDA allocator's recorded history to ``path`` (a pickle memory_viz reads)."""
    resolved(*_DUMP_SNAPSHOT)(path)




def lower_right_bias(queries: int, keys: int):
    """torch's ``causal_lower_right(queries, keys)``, made outside any dispatch mode: the
    bias is an empty tensor subclass, which torch cannot create while a mode (composer's
    memory tracker, comm_stats) intercepts the empty tensor it starts from."""
    with resolved(*_NO_MODES)():
        return causal_lower_right(queries, keys)










def forget_compiled_code() -> None:
    """torch.compile's caches emptied, where it has run in this process: it would count
    graphs compiled earlier (another job's) against its recompile limit and fall back to
    eager."""
    if _DYNAMO in sys.modules:
        torch.compiler.reset()


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording now (a flag torch keeps, read at each call)."""
    return private(*_PROFILER_ENABLED)









# the logger torch's pytree warns on (composer.torch_compat.quiet demotes its known line)
PYTREE_LOGGER = "torch.utils._pytree"
