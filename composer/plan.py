"""Everything about a job that is decided before the first collective.

``plan_job`` validates the whole configuration against the world size, the
model and the data, so bad input ends with one ConfigError line (exit status 2
on every rank) instead of a hang.
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
from torch.distributed.tensor.parallel import loss_parallel

from composer.checkpoint.dcp import check_shapes, find_resume, problem
from composer.config import ConfigError, JobConfig, tomllib
from composer.data import DataLoader, build_tokenizer
from composer.converters.lora import convert_lora, is_adapter, linear_names
from composer.mesh import ParallelDims
from composer.parallel.pipeline import (V_SHAPED, parse_stage_fqns, split_units, stage_ids,
                                        stages_per_rank)
from composer.parallel.tied import tied_groups
from composer.spec import ModelSpec
from composer.models import get_model_spec

log = logging.getLogger("composer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
NOT_YET = {"context_parallel_degree": "context"}


@dataclass
class PipelinePlan:
    """How the model is cut into stages and which of them this rank runs."""

    schedule: str
    units: list[str]
    stage_units: list[list[str]]  # per stage, in stage order
    ids: list[int]                # this rank's stages
    microbatches: int


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
    train_data: DataLoader
    val_data: DataLoader | None
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


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("job.device='cuda': no CUDA device is visible; allowed here: auto, cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolve_model(cfg: JobConfig) -> tuple[ModelSpec, Any]:
    try:
        spec = get_model_spec(cfg.model.name)
    except KeyError as e:
        raise ConfigError(f"model.name={cfg.model.name!r}: {e.args[0]}") from None
    if cfg.model.flavor not in spec.flavors:
        raise ConfigError(f"model.flavor={cfg.model.flavor!r}: unknown for {spec.name}; "
                          f"allowed: {', '.join(spec.flavors)}")
    return spec, override_args(spec.flavors[cfg.model.flavor], cfg.model.overrides)


def override_args(args: Any, text: str) -> Any:
    """``'key=value,...'`` (values in TOML syntax, bare words as strings) applied
    to a flavor's dataclass arguments, which validate themselves again."""
    if not text.strip():
        return args
    allowed = [f.name for f in dataclasses.fields(args)]
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
    try:
        return dataclasses.replace(args, **changes)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.overrides={text!r}: {e}") from None


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    for key, name in NOT_YET.items():
        if getattr(p, key) != 1:
            raise ConfigError(f"parallelism.{key}={getattr(p, key)}: {name} parallelism is "
                              f"not available in this version; allowed: 1")
    try:
        return ParallelDims(dp_replicate=p.data_parallel_replicate_degree,
                            dp_shard=p.data_parallel_shard_degree, cp=p.context_parallel_degree,
                            tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                            ep=p.expert_parallel_degree, world_size=world_size)
    except ValueError as e:  # the library's plain error, as the CLI's one line
        raise ConfigError(str(e)) from None


def _check_divides(cfg: JobConfig, key: str, degree: int, sizes: dict[str, int]) -> None:
    for name, size in sizes.items():
        if size % degree:
            raise ConfigError(f"{key}={degree} does not divide the model's {name}={size} "
                              f"({cfg.model.name}/{cfg.model.flavor})")


def check_tensor_parallel(cfg: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims) -> None:
    """Every size TP splits must divide by tp; warn when the TP group leaves the node."""
    tp, key = dims.tp, "parallelism.tensor_parallel_degree"
    if tp == 1:
        return
    if spec.tp_plan is None:
        raise ConfigError(f"{key}={tp}: model {spec.name!r} has no tensor-parallel plan; allowed: 1")
    _check_divides(cfg, key, tp, spec.tp_divisible(args))
    if cfg.parallelism.sequence_parallel and cfg.data.seq_len % tp:
        raise ConfigError(f"{key}={tp} does not divide data.seq_len={cfg.data.seq_len}, "
                          f"which sequence parallel splits")
    if cfg.parallelism.zero_stage == 1:
        raise ConfigError(f"{key}={tp}: parallelism.zero_stage=1 shards plain tensors only; "
                          f"allowed with tensor parallel: zero_stage 0, 2, 3")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", tp))
    if tp > local:
        log.warning("tensor parallel x%d spans nodes (%d ranks per node): every block's "
                    "collectives cross the network", tp, local)


def check_expert_parallel(cfg: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims) -> None:
    """Experts must spread evenly over ep, and their weights need FSDP's sharding."""
    ep, key = dims.ep, "parallelism.expert_parallel_degree"
    if ep == 1:
        return
    if spec.moe_modules is None:
        raise ConfigError(f"{key}={ep}: model {spec.name!r} has no experts; allowed: 1")
    layers = spec.moe_modules(spec.build_meta(args)).values()
    _check_divides(cfg, key, ep, {"n_experts": m.tokens_per_expert.numel() for m in layers})
    if cfg.parallelism.zero_stage < 2:
        raise ConfigError(f"{key}={ep}: parallelism.zero_stage={cfg.parallelism.zero_stage}; "
                          f"expert parallel needs FSDP, allowed: zero_stage 2, 3")


def _stage_units(p, spec: ModelSpec, model, stages: int) -> tuple[list[str], list[list[str]]]:
    units = spec.pipeline_units(model)
    try:
        if p.pipeline_parallel_stage_fqns:
            return units, parse_stage_fqns(p.pipeline_parallel_stage_fqns, units, stages)
        return units, split_units(units, spec.block_names(model), stages,
                                  p.pipeline_parallel_first_stage_less_layers,
                                  p.pipeline_parallel_last_stage_less_layers)
    except ValueError as e:
        key = "stage_fqns" if p.pipeline_parallel_stage_fqns else "degree"
        raise ConfigError(f"parallelism.pipeline_parallel_{key}: {e}") from None


def _check_tied(model, stage_units: list[list[str]]) -> None:
    """A weight shared by two stages would silently become two weights."""
    stage_of = {u: i for i, units in enumerate(stage_units) for u in units}
    for names in tied_groups(model):
        owners = {i for n in names for u, i in stage_of.items() if n.startswith(u + ".")}
        if len(owners) > 1:
            raise ConfigError(f"parallelism.pipeline_parallel_degree: tied parameters "
                              f"{', '.join(names)} would land on stages {sorted(owners)}; "
                              f"use an untied flavor or keep them on one stage")


def _microbatches(p, local_batch: int, stages: int) -> int:
    m = p.pipeline_parallel_microbatches
    if m == 0:
        fits = [k for k in range(stages, local_batch + 1, stages) if local_batch % k == 0]
        if not fits:
            raise ConfigError(f"training.local_batch_size={local_batch}: no multiple of the "
                              f"{stages} pipeline stages divides it; set "
                              f"parallelism.pipeline_parallel_microbatches")
        return fits[-1]
    if local_batch % m:
        raise ConfigError(f"parallelism.pipeline_parallel_microbatches={m} does not divide "
                          f"training.local_batch_size={local_batch}")
    return m


def _check_schedule(schedule: str, m: int, pp: int, stages: int) -> None:
    """The constraints torch's schedules raise on, caught before any collective."""
    key = f"parallelism.pipeline_parallel_microbatches={m}"
    rounds = max(1, m // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
        raise ConfigError(f"{key}: {schedule} needs a multiple of its rounds "
                          f"(microbatches // pp = {rounds})")
    if schedule in ("1F1B", "DualPipeV") and m < stages:
        raise ConfigError(f"{key}: {schedule} needs at least as many microbatches as "
                          f"stages ({stages})")


def plan_pipeline(cfg: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims,
                  rank: int) -> PipelinePlan | None:
    p = cfg.parallelism
    if dims.pp == 1:
        return None
    if spec.pipeline_units is None:
        raise ConfigError(f"parallelism.pipeline_parallel_degree={dims.pp}: model "
                          f"{spec.name!r} names no pipeline units; allowed: 1")
    if p.zero_stage == 1:
        raise ConfigError(f"parallelism.pipeline_parallel_degree={dims.pp}: parallelism."
                          f"zero_stage=1 is not supported with pipeline parallel; allowed: 0, 2, 3")
    schedule = p.pipeline_parallel_schedule
    per_rank = stages_per_rank(schedule, p.pipeline_parallel_stages_per_rank)
    model = spec.build_meta(args)
    units, stage_units = _stage_units(p, spec, model, dims.pp * per_rank)
    _check_tied(model, stage_units)
    m = _microbatches(p, cfg.training.local_batch_size, len(stage_units))
    _check_schedule(schedule, m, dims.pp, len(stage_units))
    ids = stage_ids(dims.coords(rank)["pp"], dims.pp, per_rank, schedule)
    return PipelinePlan(schedule, units, stage_units, ids, m)


def accumulation_steps(cfg: JobConfig, dims: ParallelDims) -> int:
    t = cfg.training
    per_step = t.local_batch_size * dims.dp
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size}: must be a multiple of "
            f"training.local_batch_size x data-parallel degree = {t.local_batch_size} x "
            f"{dims.dp} = {per_step}")
    return t.global_batch_size // per_step


def build_data(cfg: JobConfig, args: Any, dims: ParallelDims, rank: int):
    d = cfg.data
    limit = getattr(args, "max_seq_len", None)
    if limit is not None and d.seq_len > limit:
        raise ConfigError(f"data.seq_len={d.seq_len}: longer than the model's maximum; "
                          f"allowed: 1..{limit}")
    try:
        tokenizer = build_tokenizer(d.tokenizer)
    except ValueError as e:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r}: {e}") from None
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r}: its {tokenizer.vocab_size} ids do "
                          f"not fit the model's vocab_size {args.vocab_size}")

    def loader(split: str) -> DataLoader:
        try:
            return DataLoader(d.dataset, tokenizer, d.seq_len, cfg.training.local_batch_size,
                              dims.dp_rank(rank), dims.dp, split=split,
                              val_fraction=d.val_fraction, text_field=d.text_field,
                              format=d.format, sft_packing=d.sft_packing)
        except ValueError as e:
            raise ConfigError(f"data.dataset={d.dataset!r}: {e}") from None

    use_val = cfg.validation.enable and d.val_fraction > 0
    return loader("train"), loader("validation") if use_val else None


def check_lora(cfg: JobConfig, spec: ModelSpec, args: Any) -> None:
    """Adapters on linears that exist, and exports and loads that keep them."""
    if "lora" not in cfg.model.converters:
        return
    lora, c = cfg.lora, cfg.checkpoint
    names = linear_names(spec.build_meta(args))
    unknown = [t for t in lora.target_modules if t not in names] or ([] if lora.target_modules else [""])
    if unknown:
        raise ConfigError(f"lora.target_modules={lora.target_modules}: {unknown[0]!r} is no linear of "
                          f"{cfg.model.name}/{cfg.model.flavor}; allowed: {', '.join(names)}")
    if "output" in lora.target_modules and getattr(args, "tie_embeddings", False):
        raise ConfigError("lora.target_modules: 'output' is tied to the embedding in "
                          f"{cfg.model.flavor}; its merged weight could not stay tied")
    if c.last_save_in_hf and not lora.merge_on_export:
        raise ConfigError("checkpoint.last_save_in_hf=true with LoRA: training leaves the base "
                          "unchanged; set lora.merge_on_export=true to export base + adapters")
    if c.initial_load_path and not c.initial_load_model_only:
        raise ConfigError("checkpoint.initial_load_model_only=false with LoRA: a LoRA run starts "
                          "from base weights only; allowed: true")


def _initial(cfg: JobConfig, spec: ModelSpec, args: Any, label: str) -> Path | None:
    """The weights to start from (``checkpoint.initial_load_path``), checked."""
    c = cfg.checkpoint
    if not c.initial_load_path:
        return None
    initial = Path(c.initial_load_path)
    if (initial / "config.json").is_file():
        return initial  # Hugging Face: shapes are checked tensor by tensor on load
    if not initial.is_dir() or problem(initial):
        raise ConfigError(f"checkpoint.initial_load_path={c.initial_load_path!r}: not a Hugging "
                          f"Face folder (config.json) nor a complete DCP step "
                          f"({problem(initial) if initial.is_dir() else 'no such folder'})")
    check_shapes(initial, spec.build_meta(args), label, lambda k: not is_adapter(k))
    return initial


def plan_checkpoint(cfg: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims,
                    rank: int) -> tuple[Path | None, Path | None]:
    """(step to resume from, initial weights), both checked against the model.
    A LoRA run resumes its adapters on top of the initial weights."""
    c = cfg.checkpoint
    lora = "lora" in cfg.model.converters
    if (c.enable or c.initial_load_path) and cfg.parallelism.zero_stage == 1 and dims.dp_enabled:
        raise ConfigError("checkpoint.enable: parallelism.zero_stage=1 keeps its optimizer "
                          "state in a form DCP cannot save; allowed with checkpoints: 0, 2, 3")
    if cfg.recovery.spike_factor > 0 and not c.enable:
        raise ConfigError(f"recovery.spike_factor={cfg.recovery.spike_factor}: rolling back "
                          f"needs checkpoints; set checkpoint.enable = true")
    hf_in = bool(c.initial_load_path) and (Path(c.initial_load_path) / "config.json").is_file()
    export = "checkpoint.last_save_in_hf" if c.last_save_in_hf else "lora.merge_on_export" if (
        lora and cfg.lora.merge_on_export) else None
    if (export or hf_in) and spec.name != "llama3":
        raise ConfigError(f"{export or 'checkpoint.initial_load_path'}: Hugging Face conversion "
                          f"exists for llama3 only, not {spec.name!r}")
    if export and dims.pp > 1:
        raise ConfigError(f"{export}: not with pipeline parallel (each stage holds part of the "
                          f"model); convert the last checkpoint with scripts/convert_hf.py to-hf "
                          f"(LoRA: scripts/merge_lora.py)")
    label = f"{cfg.model.name}/{cfg.model.flavor}"
    resume = (find_resume(Path(cfg.job.dump_folder) / c.folder, c.load_step, quiet=rank != 0)
              if c.enable else None)
    if resume is not None:
        if not lora:
            check_shapes(resume, spec.build_meta(args), label)
            return resume, None
        meta = spec.build_meta(args)
        convert_lora(meta, cfg.lora)
        check_shapes(resume, meta, f"{label} with LoRA rank {cfg.lora.rank}", is_adapter)
    return resume, _initial(cfg, spec, args, label)


def plan_job(cfg: JobConfig, rank: int, world_size: int) -> Plan:
    """Validate the whole job and load the data; raises ConfigError on bad input."""
    device = pick_device(cfg.job.device)
    spec, args = resolve_model(cfg)
    if "float8" in cfg.model.converters:
        from composer.converters.float8 import check_float8
        check_float8(cfg.float8, DTYPES[cfg.training.dtype], device)
    if cfg.metrics.memory_breakdown and cfg.compile.enable and device.type != "cuda":
        raise ConfigError("metrics.memory_breakdown=true with compile.enable=true on CPU: the "
                          "memory tracker cannot see inside compiled code; allowed: one of them")
    dims = parallel_dims(cfg, world_size)
    check_tensor_parallel(cfg, spec, args, dims)
    check_expert_parallel(cfg, spec, args, dims)
    check_lora(cfg, spec, args)
    pipeline = plan_pipeline(cfg, spec, args, dims, rank)
    accum = accumulation_steps(cfg, dims)
    train_data, val_data = build_data(cfg, args, dims, rank)
    if val_data is not None and pipeline is not None and pipeline.schedule in V_SHAPED:
        log.warning("validation is off: torch's schedule eval() cannot run the V-shaped %s",
                    pipeline.schedule)
        val_data = None
    resume, initial = plan_checkpoint(cfg, spec, args, dims, rank)
    return Plan(cfg, spec, args, dims, device, rank, accum, train_data, val_data, pipeline,
                resume, initial)
