"""composer.torch_compat: the only package naming torch's private APIs; each resolves on
this torch, a missing one is one line naming it, every patch is still needed and every
overridden private method still has the signature it overrides. In process, no launch."""
from __future__ import annotations

import gc
import inspect
import logging
import re
import weakref
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

from composer import torch_compat

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "composer" / "torch_compat"

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
               PipelineStage, FSDPModule, torch_compat.frozen_aware_mem_tracker(),
               torch_compat.TorchDispatchMode(), optimizer,
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


def test_no_file_outside_torch_compat_spells_a_private_torch_name(private_name):
    sources = sorted(p for folder in ("composer", "models") for p in (ROOT / folder).rglob("*.py")
                     if COMPAT not in p.parents)
    assert len(sources) > 50
    offenders = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in sources
                 for line, name in _offenses(path.read_text(), private_name)]
    assert not offenders, "private torch names outside composer/torch_compat/:\n" + "\n".join(
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
    assert len(_offenses((COMPAT / "names.py").read_text(), private_name)) > 20


def test_every_private_api_resolves_on_this_torch():
    torch_compat.check_private_apis()
    assert len(torch_compat.attention_ops()) == 4
    assert torch_compat.scaled_and_grouped_mm_ops() <= {torch.ops.aten._scaled_mm.default,
                                                  torch.ops.aten._grouped_mm.default}
    assert torch_compat.is_functional_collective(torch_compat.functional_collective("all_reduce"))
    assert not torch_compat.is_functional_collective(torch_compat.c10d_base_op("allgather"))
    assert issubclass(torch_compat.async_collective_tensor(), torch.Tensor)
    assert torch_compat.mem_ref_type().PARAM is not None
    assert not torch_compat.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert torch_compat.profiler_enabled()


def test_flex_attention_still_refuses_cpu_backward_so_the_lift_is_needed():
    """When a torch release lets FlexAttention train on CPU itself, this fails: then
    ``torch_compat.flex_backward_on_cpu`` (and its PRIVATE_APIS entry) can go."""
    from torch.nn.attention.flex_attention import flex_attention
    q = torch.randn(1, 1, 8, 4, dtype=torch.float64, requires_grad=True)
    assert torch_compat.flex_refuses_cpu_backward()
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q)
    with torch_compat.flex_backward_on_cpu():
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
        ours = torch_compat.cpu_lower_right(q, k, v, scale=0.3)
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

    class PassThrough(torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    q, k = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4)
    with PassThrough():
        with pytest.raises(RuntimeError, match="Tensor subclass CausalBias"):
            causal_lower_right(3, 5)
        ours = torch.nn.functional.scaled_dot_product_attention(
            q, k, k, attn_mask=torch_compat.lower_right_bias(3, 5))
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k, k, attn_mask=torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2))
    torch.testing.assert_close(ours, reference)


def test_the_tensor_wrappers_act_as_torch_does():
    a, b = torch.arange(3.0), torch.ones(2, dtype=torch.float64)
    groups = torch_compat.group_tensors_by_device_and_dtype([[a, b]])
    assert sorted(str(dtype) for _, dtype in groups) == ["torch.float32", "torch.float64"]
    torch_compat.foreach_mul_([a, b], 2.0)
    assert a.tolist() == [0.0, 2.0, 4.0] and b.tolist() == [2.0, 2.0]
    linear = nn.Linear(2, 2)
    own = torch_compat.own_parameters(linear)
    assert set(own) == {"weight", "bias"} and own["weight"] is linear.weight
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(linear.parameters(), lr=1.0),
                                                  lambda step: 1.0)
    torch_compat.set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]


def test_the_subclass_hooks_are_called():
    class Tied(torch_compat.AfterApplyHook, nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.after_apply()

        def after_apply(self) -> None:
            self.b.weight = self.a.weight

    model = Tied().to_empty(device="cpu").double()
    assert model.b.weight is model.a.weight and model.a.weight.dtype == torch.float64

    class Style(torch_compat.LinearPartitionHook, ColwiseParallel):
        def partition_linear(self, name, module, device_mesh, partition):
            self.seen = (name, partition.__func__)

    style = Style()
    style._partition_linear_fn("w", None, None)
    assert style.seen == ("w", ColwiseParallel._partition_linear_fn)


def test_the_process_group_wrappers_on_a_one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
        flat = torch_compat.flatten_mesh(mesh, "ab")
        assert flat.mesh_dim_names == ("ab",)
        split = torch_compat.unflatten_mesh(mesh, "b", (1, 1), ("c", "d"))
        assert split.mesh_dim_names == ("a", "c", "d")
        group = mesh.get_group("a")
        assert torch_compat.resolve_process_group(group.group_name) is group
        assert torch_compat.as_process_group(group) is group
        assert torch_compat.as_process_group(1) is None
        seen = []

        class Boxed(torch_compat.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is torch.ops.c10d.allreduce_.default:
                    seen.append((args, out))
                return out

        with Boxed():
            dist.all_reduce(torch.ones(2), group=group)
        (args, out), = seen
        boxed = [a for a in args if isinstance(a, torch.ScriptObject)]  # the group, the op
        assert [torch_compat.as_process_group(a) for a in boxed] == [group, None]
        torch_compat.unbox_work(out[-1]).get_future().wait()
    finally:
        dist.destroy_process_group()


def test_a_missing_api_is_one_line_naming_it():
    with pytest.raises(RuntimeError) as info:
        torch_compat.private("torch.distributed.device_mesh", "DeviceMesh._no_such_api")
    message = str(info.value)
    assert "\n" not in message
    assert "torch.distributed.device_mesh.DeviceMesh._no_such_api" in message
    assert f"torch {torch_compat.WRITTEN_FOR}" in message and torch.__version__ in message
    with pytest.raises(RuntimeError, match=r"torch\._no_such_module\.x "):
        torch_compat.private("torch._no_such_module", "x")

    renamed = type("RenamedStyle", (), {"__module__": "torch.fake"})  # a torch without it
    with pytest.raises(RuntimeError, match=r"torch\.fake\.RenamedStyle\._partition_linear_fn"):
        type("Hooked", (torch_compat.LinearPartitionHook, renamed), {})


def test_the_version_check_warns_once_on_another_minor(caplog):
    with caplog.at_level(logging.WARNING, logger="composer.torch_compat"):
        assert torch_compat.check_torch_version("2.13.1+cu128")
        assert not caplog.records
        assert not torch_compat.check_torch_version("2.14.0")
    assert len(caplog.records) == 1 and "2.13" in caplog.text and "2.14.0" in caplog.text


def test_dtensor_shape_inference_stays_out_of_the_memory_tracker():
    """Rank 0 of 4 (torch's fake group) holds a quarter of a 4 MiB DTensor. A new op's
    first sharding propagation runs it on the global shape; under a dry run's fake mode
    the tracker counted that whole tensor, unless the propagation runs apart."""
    torch_compat.init_fake_process_group(0, 4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        peaks = []
        for apart in (False, True):
            torch_compat.release_meshes()  # empties the propagation caches: each pass afresh
            with torch_compat.fake_tensor_mode() as fake:
                grad = DTensor.from_local(torch.empty(256, 1024), mesh, [Shard(0)],
                                          run_check=False)
                tracker = torch_compat.frozen_aware_mem_tracker()
                with tracker, (torch_compat.sharding_meta_apart() if apart else nullcontext()):
                    torch.linalg.vector_norm(grad * 2.0)
                peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
            del fake
        assert peaks[1] < 2 * 2**20 < 4 * 2**20 <= peaks[0], peaks
    finally:
        dist.destroy_process_group()
        torch_compat.release_meshes()


def test_torchs_mem_tracker_still_leaks_its_hooks_so_their_removal_is_needed():
    """torch's MemTracker hangs a multi-grad hook on each module's inputs and drops the
    handle; a hook whose backward never comes (a forward alone) keeps its tensors alive
    through a cycle the collector cannot see. When this fails torch frees them itself,
    and the tracker's swap of ``register_multi_grad_hook`` (``hooks.py``) can go."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def input_alive_after_a_forward(make_tracker) -> bool:
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        x = torch.randn(2, 4, requires_grad=True)
        with make_tracker():
            model(x)
        ref = weakref.ref(x)
        del x, model
        gc.collect()
        return ref() is not None

    assert input_alive_after_a_forward(MemTracker)
    assert not input_alive_after_a_forward(torch_compat.frozen_aware_mem_tracker)


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_overridden_private_method_keeps_the_signature_it_overrides():
    """Each of ``hooks.py``'s overrides of a private method takes what torch's takes: a
    torch that changes one fails here, not inside a training step."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor.parallel.style import ParallelStyle
    tracker = type(torch_compat.frozen_aware_mem_tracker())
    overrides = [(torch_compat.AfterApplyHook._apply, nn.Module._apply),
                 (torch_compat.StyleApplyHook._apply, ParallelStyle._apply),
                 (torch_compat.LinearPartitionHook._partition_linear_fn,
                  ColwiseParallel._partition_linear_fn),
                 (torch_compat.LinearPartitionHook._partition_linear_fn,
                  RowwiseParallel._partition_linear_fn),
                 (tracker._update_peak_stats, MemTracker._update_peak_stats),
                 (tracker._track_module_params_and_buffers,
                  MemTracker._track_module_params_and_buffers)]
    for ours, theirs in overrides:
        assert _parameters(ours) == _parameters(theirs), (ours.__qualname__, theirs)


def test_another_torch_minor_stops_the_command_line_in_one_line(monkeypatch, capsys):
    """``import composer`` only warns on another torch; the command line exits 2 with one
    line naming the tested minor, unless COMPOSER_UNTESTED_TORCH=1."""
    from composer.cli import run_argv
    from composer.planner.cli import main as plan_main
    monkeypatch.delenv(torch_compat.UNTESTED_TORCH_ENV, raising=False)
    assert torch_compat.untested_torch() is None  # this torch is the tested one
    line = torch_compat.untested_torch("2.14.0")
    assert line == ("error: composer is tested with torch 2.13.x; this is torch 2.14.0 "
                    "(install torch==2.13.*, or set COMPOSER_UNTESTED_TORCH=1 to go on at "
                    "your own risk)")
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    assert run_argv(["--training.steps", "1", "--validate"]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert plan_main(["--config", "debug_model"]) == 2  # composer-plan
    assert capsys.readouterr().err.splitlines() == [line]
    monkeypatch.setenv(torch_compat.UNTESTED_TORCH_ENV, "1")
    assert torch_compat.untested_torch() is None
