"""Everything about a job that is decided before the first collective.

``plan_job`` checks the whole configuration against the world size, the model
and the data, composing the checks each module exposes (they raise plain
ValueErrors naming the key), so bad input ends with one ConfigError line (exit
status 2 on every rank) instead of a hang. It decides; it builds nothing heavy:
the meta model once, no data tokenised, no loader. The data's checks are in
``composer.job.data``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from composer.checkpoint.dcp import check_shapes, everything, find_resume, problem
from composer.config import ConfigError, JobConfig, tomllib
from composer.converters import Converter, make_converters
from composer.converters.base import added_keys, export_key, saved_keys
from composer.faults.replicas import replica_groups
from composer.job.data import check_data, check_samples, config_errors, limit_documents, unreached
from composer.job.preflight import (
    check_dump_folder,
    check_memory_tracker,
    check_paths,
    check_profiling,
    check_sections_in_use,
    check_steps,
    check_trackers,
    needs,
)
from composer.mesh import ParallelDims
from composer.models import get_model_spec
from composer.parallel.attention import check_attention
from composer.parallel.context import check_cp
from composer.parallel.expert import check_ep, check_ep_tp
from composer.parallel.stages import V_SHAPED, PipelinePlan, plan_pipeline
from composer.parallel.tensor import check_tp, check_tp_styles, plan_of
from composer.spec import ModelSpec, NoSequenceParallel

log = logging.getLogger("composer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class Plan:
    """Everything decided before the first collective."""

    cfg: JobConfig
    spec: ModelSpec
    args: Any
    dims: ParallelDims
    device: torch.device
    rank: int
    accum_steps: int
    tokenizer: Any
    converters: list[Converter]
    validation: bool = False      # whether the run evaluates a held-out split
    pipeline: PipelinePlan | None = None
    resume: Path | None = None    # the checkpoint step to continue from
    initial: Path | None = None   # weights to start from when there is none

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.training.dtype]

    @property
    def loss_parallel(self) -> bool:
        return self.dims.tp > 1 and self.cfg.parallelism.loss_parallel

    def loss_context(self):
        """Sharded logits need loss_parallel around the loss and its backward."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def mixed_dtype(self, choice: str) -> torch.dtype:
        return self.dtype if choice == "auto" else DTYPES[choice]

    @property
    def label(self) -> str:
        return f"{self.cfg.model.name}/{self.cfg.model.flavor}"


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("job.device='cuda': no CUDA device is visible; "
                              "allowed here: auto, cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolve_model(cfg: JobConfig) -> tuple[ModelSpec, Any]:
    """The job's model spec and arguments. What the config leaves to the model is
    decided here and written back, so every later reader (and the run's record)
    sees it: an empty ``model.flavor`` is the spec's first, ``data.document_mask =
    "auto"`` is on where the model takes documents."""
    try:
        spec = get_model_spec(cfg.model.name)
    except KeyError as e:
        raise ConfigError(f"model.name={cfg.model.name!r}: {e.args[0]}") from None
    resolve_documents(cfg, spec)
    if cfg.model.hf_path:
        return spec, override_args(args_from_folder(cfg, spec), cfg.model.overrides)
    if not spec.flavors:
        where = ("; it is built from a Hugging Face folder: set model.hf_path"
                 if spec.adapters.hf_adapter is not None else "")
        raise ConfigError(f"model.name={cfg.model.name!r}: its spec has no flavors "
                          f"(ModelSpec.flavors: name -> the arguments build takes){where}")
    cfg.model.flavor = cfg.model.flavor or next(iter(spec.flavors))
    if cfg.model.flavor not in spec.flavors:
        raise ConfigError(f"model.flavor={cfg.model.flavor!r}: unknown for {spec.name}; "
                          f"allowed: {', '.join(spec.flavors)}")
    return spec, override_args(spec.flavors[cfg.model.flavor], cfg.model.overrides)


def resolve_documents(cfg: JobConfig, spec: ModelSpec) -> None:
    """``data.document_mask = "auto"``: on where the model takes documents."""
    if cfg.data.document_mask == "auto":
        cfg.data.document_mask = spec.parallel.attention_mask is not None
        if not cfg.data.document_mask:
            log.info("data.document_mask=auto: off, model %r takes no document boundaries "
                     "(ModelSpec.parallel.attention_mask): packed documents attend across "
                     "their boundaries", spec.name)


def args_from_folder(cfg: JobConfig, spec: ModelSpec) -> Any:
    """The arguments of ``model.hf_path``'s model, read by the family's Hugging Face
    adapter; the folder's name stands for the flavor."""
    m = cfg.model
    key = f"model.hf_path={m.hf_path!r}"
    if spec.adapters.hf_adapter is None:
        raise ConfigError(f"{key}: model {spec.name!r} has no Hugging Face adapter "
                          f"(ModelSpec.adapters.hf_adapter) to read a folder with")
    folder = Path(m.hf_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{key}: no config.json there; allowed: a Hugging Face model folder")
    if m.flavor and m.flavor != folder.name:
        log.info("model.flavor=%r is ignored: the model's sizes come from %s", m.flavor,
                 folder / "config.json")
    m.flavor = folder.name
    with config_errors(f"{key}: "):
        return spec.adapters.hf_adapter.args_from_folder(folder, m.hf_trust_remote_code)


def model_key(cfg: JobConfig) -> str:
    """The key that names the job's model: its Hugging Face folder, else its name."""
    m = cfg.model
    return f"model.hf_path={m.hf_path!r}" if m.hf_path else f"model.name={m.name!r}"


def hf_weights(cfg: JobConfig) -> Path | None:
    """``model.hf_path`` as the weights to start from, where it holds safetensors."""
    folder = Path(cfg.model.hf_path) if cfg.model.hf_path else None
    if folder is None or not any(folder.glob("*.safetensors")):
        if folder is not None:
            log.info("model.hf_path %s holds no safetensors: the weights are drawn", folder)
        return None
    return folder


def override_args(args: Any, text: str) -> Any:
    """``'key=value,...'`` (values in TOML syntax, bare words as strings) applied
    to a flavor's arguments: a dataclass (which validates itself again) or a dict."""
    if not text.strip():
        return args
    if not (dataclasses.is_dataclass(args) or isinstance(args, dict)):
        raise ConfigError(f"model.overrides={text!r}: the flavor is a {type(args).__name__}; "
                          f"overrides change a dataclass's or a dict's keys")
    allowed = list(args) if isinstance(args, dict) else [f.name for f in dataclasses.fields(args)]
    changes = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in allowed:
            raise ConfigError(f"model.overrides={text!r}: {item.strip()!r} is not key=value "
                              f"with a key of the flavor; allowed keys: {', '.join(allowed)}")
        try:
            changes[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            changes[key] = value
    if isinstance(args, dict):
        return {**args, **changes}
    try:
        return dataclasses.replace(args, **changes)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.overrides={text!r}: {e}") from None


def resolve_sequence_parallel(cfg: JobConfig, spec: ModelSpec, meta: nn.Module) -> None:
    """``parallelism.sequence_parallel = "auto"``: on, unless tensor parallel runs and the
    model's plan cannot cut the residual stream on the sequence (it says why: a module
    on the stream it cannot cut, an attention mask built from a rank's slice)."""
    p = cfg.parallelism
    if p.sequence_parallel != "auto":
        return
    p.sequence_parallel = True
    if p.tensor_parallel_degree == 1 or spec.tp_plan is None:
        return
    try:
        plan_of(spec.tp_plan, meta, True, p.loss_parallel)
    except NoSequenceParallel as e:  # any other refusal is the tensor-parallel check's
        p.sequence_parallel = False
        log.info("parallelism.sequence_parallel=auto: off, %s", str(e).partition("; set ")[0])
    except ValueError:
        pass


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    try:
        groups, group = replica_groups(cfg)
        return ParallelDims(dp_replicate=p.data_parallel_replicate_degree,
                            dp_shard=p.data_parallel_shard_degree, cp=p.context_parallel_degree,
                            tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                            ep=p.expert_parallel_degree, world_size=world_size,
                            replica_groups=groups, replica_group=group)
    except ValueError as e:  # the library's plain error, as the CLI's one line
        raise ConfigError(str(e)) from None


def check_parallel(cfg: JobConfig, spec: ModelSpec, args: Any, meta: nn.Module,
                   dims: ParallelDims) -> None:
    """Tensor, context and expert parallel degrees, and the attention backend, against
    the model."""
    p, label = cfg.parallelism, f"{cfg.model.name}/{cfg.model.flavor}"
    with config_errors():
        check_attention(cfg.model.attention, meta, spec)
        if dims.tp > 1:
            check_tp(dims.tp, spec, args, label, cfg.data.seq_len, p.sequence_parallel,
                     p.zero_stage)
            check_tp_styles(dims.tp, spec, meta, p.sequence_parallel, p.loss_parallel,
                            cfg.checkpoint.enable)
        if dims.cp > 1 and unreached(spec, meta):
            raise ValueError(f"parallelism.context_parallel_degree={dims.cp}: "
                             f"{unreached(spec, meta)}; allowed: 1")
        if dims.cp > 1:
            check_cp(dims.cp, p.context_parallel_method, spec, args, cfg.data.seq_len, dims.tp,
                     p.sequence_parallel)
        if dims.ep > 1:
            check_ep(dims.ep, spec, meta, label, p.zero_stage)
        if dims.ep > 1 and dims.tp > 1:
            check_ep_tp(dims.ep, dims.tp, plan_of(spec.tp_plan, meta, p.sequence_parallel,
                                                  p.loss_parallel))


def warn_tp_across_nodes(dims: ParallelDims) -> None:
    """A TP group is tp consecutive ranks (tp is the mesh's innermost dim) and a
    node holds LOCAL_WORLD_SIZE consecutive ones: some group crosses a node
    boundary unless the ranks per node divide by tp (tp 4 crosses with 2 per node,
    and with 6: ranks 4-7 lie on two nodes)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dims.tp))
    if local % dims.tp:
        log.warning("tensor parallel x%d spans nodes (%d ranks per node): every block's "
                    "collectives cross the network", dims.tp, local)


def accumulation_steps(cfg: JobConfig, dims: ParallelDims) -> int:
    t = cfg.training
    per_step = t.local_batch_size * dims.data_degree
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size}: must be a multiple of "
            f"training.local_batch_size x data-parallel degree = {t.local_batch_size} x "
            f"{dims.data_degree} = {per_step}")
    return t.global_batch_size // per_step


def plan_validation(cfg: JobConfig, pipeline: PipelinePlan | None) -> bool:
    if not (cfg.validation.enable and cfg.data.val_fraction > 0):
        return False
    if pipeline is not None and pipeline.schedule in V_SHAPED:
        log.warning("validation is off: torch's schedule eval() cannot run the V-shaped %s",
                    pipeline.schedule)
        return False
    return True


def _initial(cfg: JobConfig, model: nn.Module, label: str, added) -> Path | None:
    """The weights to start from (``checkpoint.initial_load_path``), checked."""
    c = cfg.checkpoint
    if not c.initial_load_path:
        return hf_weights(cfg)
    initial = Path(c.initial_load_path)
    if (initial / "config.json").is_file():
        return initial  # Hugging Face: shapes are checked tensor by tensor on load
    if not initial.is_dir() or problem(initial):
        raise ConfigError(f"checkpoint.initial_load_path={c.initial_load_path!r}: not a Hugging "
                          f"Face folder (config.json) nor a complete DCP step "
                          f"({problem(initial) if initial.is_dir() else 'no such folder'})")
    with config_errors():
        check_shapes(initial, model, label, lambda k: not added(k))
    return initial


def check_hf(cfg: JobConfig, spec: ModelSpec, dims: ParallelDims,
             converters: list[Converter]) -> None:
    """Hugging Face import and export need the family's adapter and the whole model."""
    c = cfg.checkpoint
    hf_in = bool(c.initial_load_path) and (Path(c.initial_load_path) / "config.json").is_file()
    hf_in = hf_in or bool(cfg.model.hf_path)
    export = export_key(cfg, converters)
    if (export or hf_in) and spec.adapters.hf_adapter is None:
        raise ConfigError(f"{export or 'checkpoint.initial_load_path'}: model {spec.name!r} has "
                          f"no Hugging Face adapter (ModelSpec.adapters.hf_adapter)")
    if export or hf_in:
        needs(export or "checkpoint.initial_load_path", "hf", "safetensors")
    if export and dims.pp > 1:
        raise ConfigError(f"{export}: not with pipeline parallel (each stage holds part of the "
                          f"model); convert the last checkpoint with composer-convert-hf to-hf "
                          f"(LoRA: composer-merge-lora)")


def plan_checkpoint(cfg: JobConfig, converted: nn.Module, dims: ParallelDims, rank: int,
                    converters: list[Converter]) -> tuple[Path | None, Path | None]:
    """(step to resume from, initial weights), both checked against the converted
    meta model. A step that holds only part of the model (converters' ``saved``,
    e.g. LoRA's adapters) resumes on top of the initial weights."""
    c = cfg.checkpoint
    if (c.enable or c.initial_load_path) and cfg.parallelism.zero_stage == 1 and dims.dp_enabled:
        raise ConfigError("checkpoint.enable: parallelism.zero_stage=1 keeps its optimizer "
                          "state in a form DCP cannot save; allowed with checkpoints: 0, 2, 3")
    if cfg.recovery.spike_factor > 0 and not c.enable:
        raise ConfigError(f"recovery.spike_factor={cfg.recovery.spike_factor}: rolling back "
                          f"needs checkpoints; set checkpoint.enable = true")
    label = f"{cfg.model.name}/{cfg.model.flavor}"
    if cfg.model.converters:
        label += f" with {', '.join(cfg.model.converters)}"
    saved = saved_keys(converters)
    with config_errors():
        resume = (find_resume(Path(cfg.job.dump_folder) / c.folder, c.load_step, quiet=rank != 0)
                  if c.enable else None)
        if resume is not None:
            check_shapes(resume, converted, label, saved or everything)
    if resume is not None:
        if saved is None:
            return resume, None
    return resume, _initial(cfg, converted, label, added_keys(converters))


def plan_layout(cfg: JobConfig, spec: ModelSpec, args: Any, meta: nn.Module, world_size: int,
                rank: int, device: torch.device
                ) -> tuple[ParallelDims, list[Converter], PipelinePlan | None, int]:
    """The degrees, converters, pipeline stages and accumulation steps of a job,
    checked against the (unconverted) meta model; raises ConfigError. What the
    planner's search checks for every layout it tries."""
    dims = parallel_dims(cfg, world_size)
    with config_errors():
        converters = make_converters(cfg.model.converters, cfg, spec, args, dims, device)
        for converter in converters:
            converter.check(meta)
        for section in cfg.components.values():  # a component's own checks of its section
            if hasattr(section, "check"):
                section.check(cfg, dims)
    check_parallel(cfg, spec, args, meta, dims)
    with config_errors():
        pipeline = plan_pipeline(cfg.parallelism, spec, meta, dims.pp, dims.coords(rank)["pp"],
                                 cfg.training.local_batch_size)
    return dims, converters, pipeline, accumulation_steps(cfg, dims)


def plan_job(cfg: JobConfig, rank: int, world_size: int) -> Plan:
    """Check the whole job and decide its layout; raises ConfigError on bad input."""
    device = pick_device(cfg.job.device)
    check_sections_in_use(cfg)
    auto_documents = cfg.data.document_mask == "auto"
    spec, args = resolve_model(cfg)
    tracked = cfg.metrics.memory_breakdown and device.type != "cuda"
    if tracked:
        check_memory_tracker(cfg)
    check_profiling(cfg)
    check_trackers(cfg)
    with config_errors(f"{model_key(cfg)}: "):  # a model may refuse its arguments when built
        meta = spec.build_meta(args)  # the one meta model every check reads
    limit_documents(cfg, spec, meta, auto_documents)
    resolve_sequence_parallel(cfg, spec, meta)
    dims, converters, pipeline, accum = plan_layout(cfg, spec, args, meta, world_size, rank, device)
    if tracked:
        check_memory_tracker(cfg, accum)
    warn_tp_across_nodes(dims)
    tokenizer = check_data(cfg, spec, args, meta)
    check_samples(cfg, dims, tokenizer)
    check_hf(cfg, spec, dims, converters)
    for converter in converters:  # checkpoints hold the converted model's keys
        converter.convert(meta)
    check_paths(cfg, export_key(cfg, converters) is not None)
    resume, initial = plan_checkpoint(cfg, meta, dims, rank, converters)
    check_steps(cfg, resume)
    check_dump_folder(cfg, resume)
    return Plan(cfg, spec, args, dims, device, rank, accum, tokenizer, converters,
                plan_validation(cfg, pipeline), pipeline, resume, initial)
