"""composer.compat: the only file naming torch's private APIs; each resolves on this torch,
and a missing one is one line naming it. In process, no launch."""
from __future__ import annotations

import logging
import re
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from composer import compat

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "composer" / "compat.py"

# torch.a._b anywhere: code, docstrings and comments
TORCH_PATH = re.compile(r"\btorch(?:\.\w+)*?\._[A-Za-z]\w*")
# a private name imported from a torch module, parenthesised lists included
FROM_TORCH = re.compile(r"^\s*from\s+torch[\w.]*\s+import\s+(\([^)]*\)|.*)$", re.M)
PRIVATE = re.compile(r"\b_[A-Za-z]\w*")
# a name as an attribute (mesh._flatten, super()._apply), a method defined, or quoted
TOKEN = re.compile(r"(?:\.|\bdef\s+|[\"'`])(_[A-Za-z]\w*)")


def _torch_private_names() -> set[str]:
    """The private attributes of the torch classes composer meets, and of their instances."""
    p = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=1.0)
    objects = [nn.Module(), nn.Linear(1, 1), torch.Tensor, p, torch.ScriptObject, DeviceMesh,
               DTensor, ColwiseParallel(), RowwiseParallel(), SequenceParallel(),
               PrepareModuleInput(), Schedule1F1B, PipelineScheduleSingle, PipelineScheduleMulti,
               PipelineStage, FSDPModule, compat.frozen_aware_mem_tracker(),
               compat.TorchDispatchMode(), optimizer,
               torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
               dist.ProcessGroup, dist.Work, torch.autograd.Function]
    return {n for o in objects for n in dir(o) if PRIVATE.fullmatch(n) and not n.endswith("__")}


def _is_private_op(name: str) -> bool:
    if name.startswith("_c10d"):
        return True
    for namespace in (torch.ops.aten, torch.ops.c10d):
        try:
            getattr(namespace, name)
            return True
        except AttributeError:
            pass
    return False


@pytest.fixture(scope="module")
def private_name():
    names = _torch_private_names()
    return lambda name: name in names or _is_private_op(name)


def _offenses(text: str, private_name) -> list[tuple[int, str]]:
    """(line, name) of each private torch name ``text`` spells."""
    found = [(m.start(), m.group()) for m in TORCH_PATH.finditer(text)]
    for m in FROM_TORCH.finditer(text):
        found += [(m.start(), name) for name in PRIVATE.findall(m.group(1))]
    found += [(m.start(1), m.group(1)) for m in TOKEN.finditer(text) if private_name(m.group(1))]
    return sorted({(text.count("\n", 0, at) + 1, name) for at, name in found})


def test_no_file_but_compat_spells_a_private_torch_name(private_name):
    sources = sorted(p for folder in ("composer", "models") for p in (ROOT / folder).rglob("*.py")
                     if p != COMPAT)
    assert len(sources) > 50
    offenders = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in sources
                 for line, name in _offenses(path.read_text(), private_name)]
    assert not offenders, "private torch names outside composer/compat.py:\n" + "\n".join(
        offenders)


def test_the_scan_finds_each_kind_of_private_name(private_name):
    bad = ["torch._grouped_mm(x, w)", "# see torch.cuda.memory._dump_snapshot",
           "from torch.utils._pytree import tree_map",
           "from torch.distributed.distributed_c10d import (\n    _resolve_process_group)",
           "mesh._flatten('dp')", "aten._scaled_mm.default", "module._parameters",
           "    def _apply(self, fn, recurse=True):", "ops = ('_grouped_mm',)",
           "op.namespace == '_c10d_functional'", "scheduler._last_lr = lrs",
           "self._param_to_grad_hook_handles"]
    for text in bad:
        assert _offenses(text, private_name), text
    good = ["self._meshes = {}", "def _check(key):", "torch.ops.aten.mm.default",
            "from torch.distributed.tensor import DTensor", "torch.__version__"]
    for text in good:
        assert not _offenses(text, private_name), text
    assert len(_offenses(COMPAT.read_text(), private_name)) > 20


def test_every_private_api_resolves_on_this_torch():
    compat.check_private_apis()
    assert len(compat.attention_ops()) == 4
    assert compat.scaled_and_grouped_mm_ops() <= {torch.ops.aten._scaled_mm.default,
                                                  torch.ops.aten._grouped_mm.default}
    assert compat.is_functional_collective(compat.functional_collective("all_reduce"))
    assert not compat.is_functional_collective(compat.c10d_base_op("allgather"))
    assert issubclass(compat.async_collective_tensor(), torch.Tensor)
    assert compat.mem_ref_type().PARAM is not None
    assert not compat.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert compat.profiler_enabled()


def test_flex_attention_still_refuses_cpu_backward_so_the_lift_is_needed():
    """When a torch release lets FlexAttention train on CPU itself, this fails: then
    ``compat.flex_backward_on_cpu`` (and its PRIVATE_APIS entry) can go."""
    from torch.nn.attention.flex_attention import flex_attention
    q = torch.randn(1, 1, 8, 4, dtype=torch.float64, requires_grad=True)
    assert compat.flex_refuses_cpu_backward()
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q)
    with compat.flex_backward_on_cpu():
        out = flex_attention(q, q, q)
    out.sum().backward()
    reference = torch.nn.functional.scaled_dot_product_attention(q.detach(), q.detach(),
                                                                 q.detach())
    torch.testing.assert_close(out.detach(), reference, rtol=1e-12, atol=1e-12)
    with pytest.raises(NotImplementedError):  # lifted for the context only
        flex_attention(q, q, q)


def test_cpu_lower_right_attention_is_sdpa_with_torchs_causal_bias():
    """The chunk of context parallel's all-gather on CPU: queries that are the last of
    the keys, without a mask, as SDPA with causal_lower_right computes it (float64,
    gradients too)."""
    from torch.nn.attention.bias import causal_lower_right
    torch.manual_seed(0)
    for queries, keys in ((8, 32), (8, 8)):
        q = torch.randn(2, 3, queries, 4, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(2, 3, keys, 4, dtype=torch.float64, requires_grad=True)
                for _ in range(2))
        ours = compat.cpu_lower_right(q, k, v, scale=0.3)
        reference = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(queries, keys), scale=0.3)
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
        grad = torch.randn_like(ours)
        for a, b in zip(torch.autograd.grad(ours, (q, k, v), grad),
                        torch.autograd.grad(reference, (q, k, v), grad)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_lower_right_bias_is_made_under_a_dispatch_mode():
    """torch's causal_lower_right fails while a dispatch mode is active (composer's memory
    tracker, comm_stats); composer's is made outside it and masks as torch's does."""
    from torch.nn.attention.bias import causal_lower_right

    class PassThrough(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    q, k = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4)
    with PassThrough():
        with pytest.raises(RuntimeError, match="Tensor subclass CausalBias"):
            causal_lower_right(3, 5)
        ours = torch.nn.functional.scaled_dot_product_attention(
            q, k, k, attn_mask=compat.lower_right_bias(3, 5))
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k, k, attn_mask=torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2))
    torch.testing.assert_close(ours, reference)


def test_the_tensor_wrappers_act_as_torch_does():
    a, b = torch.arange(3.0), torch.ones(2, dtype=torch.float64)
    groups = compat.group_tensors_by_device_and_dtype([[a, b]])
    assert sorted(str(dtype) for _, dtype in groups) == ["torch.float32", "torch.float64"]
    compat.foreach_mul_([a, b], 2.0)
    assert a.tolist() == [0.0, 2.0, 4.0] and b.tolist() == [2.0, 2.0]
    linear = nn.Linear(2, 2)
    own = compat.own_parameters(linear)
    assert set(own) == {"weight", "bias"} and own["weight"] is linear.weight
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(linear.parameters(), lr=1.0),
                                                  lambda step: 1.0)
    compat.set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]


def test_the_subclass_hooks_are_called():
    class Tied(compat.AfterApplyHook, nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.after_apply()

        def after_apply(self) -> None:
            self.b.weight = self.a.weight

    model = Tied().to_empty(device="cpu").double()
    assert model.b.weight is model.a.weight and model.a.weight.dtype == torch.float64

    class Style(compat.LinearPartitionHook, ColwiseParallel):
        def partition_linear(self, name, module, device_mesh, partition):
            self.seen = (name, partition.__func__)

    style = Style()
    style._partition_linear_fn("w", None, None)
    assert style.seen == ("w", ColwiseParallel._partition_linear_fn)


def test_the_process_group_wrappers_on_a_one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
        flat = compat.flatten_mesh(mesh, "ab")
        assert flat.mesh_dim_names == ("ab",)
        split = compat.unflatten_mesh(mesh, "b", (1, 1), ("c", "d"))
        assert split.mesh_dim_names == ("a", "c", "d")
        group = mesh.get_group("a")
        assert compat.resolve_process_group(group.group_name) is group
        assert compat.as_process_group(group) is group and compat.as_process_group(1) is None
        seen = []

        class Boxed(compat.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is torch.ops.c10d.allreduce_.default:
                    seen.append((args, out))
                return out

        with Boxed():
            dist.all_reduce(torch.ones(2), group=group)
        (args, out), = seen
        boxed = [a for a in args if isinstance(a, torch.ScriptObject)]  # the group, the op
        assert [compat.as_process_group(a) for a in boxed] == [group, None]
        compat.unbox_work(out[-1]).get_future().wait()
    finally:
        dist.destroy_process_group()


def test_a_missing_api_is_one_line_naming_it():
    with pytest.raises(RuntimeError) as info:
        compat._private("torch.distributed.device_mesh", "DeviceMesh._no_such_api")
    message = str(info.value)
    assert "\n" not in message
    assert "torch.distributed.device_mesh.DeviceMesh._no_such_api" in message
    assert f"torch {compat.WRITTEN_FOR}" in message and torch.__version__ in message
    with pytest.raises(RuntimeError, match=r"torch\._no_such_module\.x "):
        compat._private("torch._no_such_module", "x")

    renamed = type("RenamedStyle", (), {"__module__": "torch.fake"})  # a torch without it
    with pytest.raises(RuntimeError, match=r"torch\.fake\.RenamedStyle\._partition_linear_fn"):
        type("Hooked", (compat.LinearPartitionHook, renamed), {})


def test_the_version_check_warns_once_on_another_minor(caplog):
    with caplog.at_level(logging.WARNING, logger="composer.compat"):
        assert compat.check_torch_version("2.13.1+cu128")
        assert not caplog.records
        assert not compat.check_torch_version("2.14.0")
    assert len(caplog.records) == 1 and "2.13" in caplog.text and "2.14.0" in caplog.text


def test_dtensor_shape_inference_stays_out_of_the_memory_tracker():
    """Rank 0 of 4 (torch's fake group) holds a quarter of a 4 MiB DTensor. A new op's
    first sharding propagation runs it on the global shape; under a dry run's fake mode
    the tracker counted that whole tensor, unless the propagation runs apart."""
    compat.init_fake_process_group(0, 4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        peaks = []
        for apart in (False, True):
            compat.release_meshes()  # empties the propagation caches: each pass afresh
            with compat.fake_tensor_mode() as fake:
                grad = DTensor.from_local(torch.empty(256, 1024), mesh, [Shard(0)],
                                          run_check=False)
                tracker = compat.frozen_aware_mem_tracker()
                with tracker, (compat.sharding_meta_apart() if apart else nullcontext()):
                    torch.linalg.vector_norm(grad * 2.0)
                peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
            del fake
        assert peaks[1] < 2 * 2**20 < 4 * 2**20 <= peaks[0], peaks
    finally:
        dist.destroy_process_group()
        compat.release_meshes()
