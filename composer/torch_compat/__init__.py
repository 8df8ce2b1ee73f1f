"""torch's private APIs, named here and nowhere else; written and tested for torch 2.13.

torch changes its private APIs between releases without notice, so a torch upgrade is
checked against this one package (``tests/unit/test_torch_compat.py`` keeps the rest of
the tree free of them):

- ``names``: lookups only (private attributes, ops and modules), each resolved once and
  one RuntimeError line naming it when this torch lacks it;
- ``hooks``: subclasses that override a private method of torch's (nn.Module's
  ``_apply``, a ParallelStyle's, MemTracker's);
- ``patches``: process-wide patches, each for the length of a context;
- ``kernels``: an autograd kernel over aten's private CPU attention ops;
- ``quiet``: torch's and torchao's known lines kept off the console;
- ``version``: the tested torch. ``pyproject.toml`` pins its minor; importing composer
  with another one warns, and the command line exits 2 with one line unless
  ``COMPOSER_UNTESTED_TORCH=1``.

Imports: nothing of composer.
"""
from composer.torch_compat.hooks import (
    AfterApplyHook,
    LinearPartitionHook,
    StyleApplyHook,
    frozen_aware_mem_tracker,
)
from composer.torch_compat.kernels import (
    cpu_lower_right,
)
from composer.torch_compat.names import (
    PRIVATE_APIS,
    PYTREE_LOGGER,
    TorchDispatchMode,
    as_process_group,
    async_collective_tensor,
    attention_kernels,
    attention_ops,
    c10d_base_op,
    check_private_apis,
    cpu_attention_ops,
    dump_cuda_memory_snapshot,
    fake_tensor_mode,
    flatten_mesh,
    foreach_mul_,
    forget_compiled_code,
    functional_collective,
    group_tensors_by_device_and_dtype,
    grouped_mm,
    init_fake_process_group,
    is_functional_collective,
    is_strided_shard,
    local_region,
    lower_right_bias,
    mem_ref_type,
    missing_api,
    next_node_number,
    own_parameters,
    pending_collectives,
    private,
    profiler_enabled,
    real_tensors,
    record_cuda_memory_history,
    release_meshes,
    replicate_ddp,
    replicate_fsdp,
    require,
    resolve_process_group,
    running_node_number,
    scalar_read_op,
    scaled_and_grouped_mm_ops,
    set_last_lr,
    stop_cuda_memory_history,
    strided_shard,
    unbox_work,
    unflatten_mesh,
    untracked_views,
)
from composer.torch_compat.patches import (
    flex_backward_on_cpu,
    flex_refuses_cpu_backward,
    sharding_meta_apart,
)
from composer.torch_compat.version import (
    UNTESTED_TORCH_ENV,
    WRITTEN_FOR,
    check_torch_version,
    minor,
    untested_torch,
)

check_torch_version()

__all__ = [
    "AfterApplyHook",
    "LinearPartitionHook",
    "PRIVATE_APIS",
    "PYTREE_LOGGER",
    "StyleApplyHook",
    "TorchDispatchMode",
    "UNTESTED_TORCH_ENV",
    "WRITTEN_FOR",
    "as_process_group",
    "async_collective_tensor",
    "attention_kernels",
    "attention_ops",
    "c10d_base_op",
    "check_private_apis",
    "check_torch_version",
    "cpu_attention_ops",
    "cpu_lower_right",
    "dump_cuda_memory_snapshot",
    "fake_tensor_mode",
    "flatten_mesh",
    "forget_compiled_code",
    "flex_backward_on_cpu",
    "flex_refuses_cpu_backward",
    "foreach_mul_",
    "frozen_aware_mem_tracker",
    "functional_collective",
    "group_tensors_by_device_and_dtype",
    "grouped_mm",
    "init_fake_process_group",
    "is_functional_collective",
    "is_strided_shard",
    "local_region",
    "lower_right_bias",
    "mem_ref_type",
    "minor",
    "missing_api",
    "next_node_number",
    "own_parameters",
    "pending_collectives",
    "private",
    "profiler_enabled",
    "real_tensors",
    "record_cuda_memory_history",
    "release_meshes",
    "replicate_ddp",
    "replicate_fsdp",
    "require",
    "resolve_process_group",
    "running_node_number",
    "scalar_read_op",
    "scaled_and_grouped_mm_ops",
    "set_last_lr",
    "sharding_meta_apart",
    "stop_cuda_memory_history",
    "strided_shard",
    "unbox_work",
    "unflatten_mesh",
    "untested_torch",
    "untracked_views",
]
