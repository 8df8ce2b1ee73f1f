"""The entry point: config -> plan -> mesh -> model -> passes -> weights -> loop.

    torchrun --nproc_per_node=4 -m composer.train --config train_configs/debug_model.toml

Everything that can be wrong with the input is found in ``plan_job``, before any
process group exists, so bad input ends with one line and exit status 2 on
every rank instead of a hang. This file is the only place that knows the order
of the passes.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from composer.comm import CommCounter
from composer.config import ConfigError, JobConfig, parse_args, to_toml
from composer.data import DataLoader, build_tokenizer
from composer.init import materialize
from composer.mesh import ParallelDims
from composer.metrics import MetricsLogger, peak_tflops
from composer.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from composer.parallel import parallelize
from composer.spec import ModelSpec
from models import get_model_spec

log = logging.getLogger("composer")

IGNORE_INDEX = -100
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
NOT_YET = {"pipeline_parallel_degree": "pipeline",
           "context_parallel_degree": "context", "expert_parallel_degree": "expert"}


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
    return spec, spec.flavors[cfg.model.flavor]


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    for key, name in NOT_YET.items():
        if getattr(p, key) != 1:
            raise ConfigError(f"parallelism.{key}={getattr(p, key)}: {name} parallelism is "
                              f"not available in this version; allowed: 1")
    return ParallelDims(dp_replicate=p.data_parallel_replicate_degree,
                        dp_shard=p.data_parallel_shard_degree, cp=p.context_parallel_degree,
                        tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, world_size=world_size)


def check_tensor_parallel(cfg: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims) -> None:
    """Every size TP splits must divide by tp; warn when the TP group leaves the node."""
    tp, key = dims.tp, "parallelism.tensor_parallel_degree"
    if tp == 1:
        return
    if spec.tp_plan is None:
        raise ConfigError(f"{key}={tp}: model {spec.name!r} has no tensor-parallel plan; allowed: 1")
    for name, size in spec.tp_divisible(args).items():
        if size % tp:
            raise ConfigError(f"{key}={tp} does not divide the model's {name}={size} "
                              f"({cfg.model.name}/{cfg.model.flavor})")
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
                              val_fraction=d.val_fraction, text_field=d.text_field)
        except ValueError as e:
            raise ConfigError(f"data.dataset={d.dataset!r}: {e}") from None

    use_val = cfg.validation.enable and d.val_fraction > 0
    return loader("train"), loader("validation") if use_val else None


def plan_job(cfg: JobConfig, rank: int, world_size: int) -> Plan:
    """Validate the whole job and load the data; raises ConfigError on bad input."""
    device = pick_device(cfg.job.device)
    spec, args = resolve_model(cfg)
    if cfg.model.converters:
        raise ConfigError(f"model.converters={cfg.model.converters}: no converters are "
                          f"available in this version; allowed: []")
    dims = parallel_dims(cfg, world_size)
    check_tensor_parallel(cfg, spec, args, dims)
    accum = accumulation_steps(cfg, dims)
    train_data, val_data = build_data(cfg, args, dims, rank)
    return Plan(cfg, spec, args, dims, device, rank, accum, train_data, val_data)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_meta(plan: Plan) -> nn.Module:
    with default_dtype(plan.dtype):
        return plan.spec.build_meta(plan.args)


def build_model(plan: Plan) -> nn.Module:
    """Meta build -> passes -> real weights, identical on every layout."""
    model = build_meta(plan)
    t, p = plan.cfg.training, plan.cfg.parallelism
    parallelize(model, plan.dims, plan.spec, zero_stage=p.zero_stage,
                sequence_parallel=p.sequence_parallel, loss_parallel=plan.loss_parallel,
                param_dtype=plan.mixed_dtype(t.mixed_precision_param),
                reduce_dtype=plan.mixed_dtype(t.mixed_precision_reduce))
    materialize(model, lambda: build_meta(plan), plan.device, plan.cfg.job.seed)
    return model


def autocast(plan: Plan):
    """FSDP2 and its replicate cast parameters themselves; classic DDP (ZeRO-1) and
    one process use autocast for the compute dtype."""
    param_dtype = plan.mixed_dtype(plan.cfg.training.mixed_precision_param)
    fsdp = plan.dims.dp_enabled and plan.cfg.parallelism.zero_stage != 1
    if param_dtype == plan.dtype or fsdp:
        return contextlib.nullcontext()
    return torch.autocast(plan.device.type, dtype=param_dtype)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy; half-precision logits are upcast, float64 stays float64.
    Vocabulary-sharded logits (loss parallel) give a DTensor loss."""
    logits = logits.flatten(0, 1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def local_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def all_reduce_sum(t: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Sum over the ranks that see different data."""
    if dist.is_initialized() and plan.dims.mesh("dp_cp").size() > 1:
        dist.all_reduce(t, group=plan.dims.mesh("dp_cp").get_group())
    return t


class Trainer:
    """Owns the model, optimizer, data and metrics of one run."""

    def __init__(self, plan: Plan):
        self.plan, cfg = plan, plan.cfg
        self.model = build_model(plan)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, plan.dims,
                                         cfg.parallelism.zero_stage)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.val_start = plan.val_data.state_dict() if plan.val_data else None
        self.tokens_per_step = plan.accum_steps * cfg.training.local_batch_size * cfg.data.seq_len
        param_dtype = plan.mixed_dtype(cfg.training.mixed_precision_param)
        self.metrics = MetricsLogger(
            cfg.job.dump_folder, plan.rank == 0, cfg.metrics.enable_tensorboard,
            cfg.training.steps, plan.spec.flops_per_token(plan.args, cfg.data.seq_len),
            peak_tflops(plan.device, param_dtype), plan.device)
        self.step = 0
        self.comm = (CommCounter(plan.dims.groups())
                     if cfg.metrics.comm_stats and dist.is_initialized() else None)

    def phase(self, name: str):
        return self.comm.in_phase(name) if self.comm else contextlib.nullcontext()

    def forward_backward(self, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate gradients over the microbatches; returns (global loss, global tokens).

        Each rank's loss is divided by the global target-token count and scaled
        by the dp degree, because data parallelism averages gradients over dp:
        the result is the gradient of the global mean loss on every layout.
        """
        plan, device = self.plan, self.plan.device
        tokens = sum((t != IGNORE_INDEX).sum() for _, t in batches).to(device)
        tokens = all_reduce_sum(tokens, plan)
        scale = plan.dims.dp / tokens.item()
        total = torch.zeros((), device=device, dtype=torch.float64)
        for i, (inputs, targets) in enumerate(batches):
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            with plan.loss_context():
                with autocast(plan), self.phase("forward"):
                    logits = self.model(inputs.to(device))
                with self.phase("loss"):
                    loss = loss_sum(logits, targets.to(device))
                with self.phase("backward"):
                    (loss * scale).backward()
            total += local_value(loss.detach())
        return all_reduce_sum(total, plan) / tokens, tokens

    def train_step(self) -> dict:
        batches = [self.plan.train_data.next_batch() for _ in range(self.plan.accum_steps)]
        lr = self.scheduler.get_last_lr()[0]
        if self.comm:
            self.comm.reset()
        with self.comm or contextlib.nullcontext():
            loss, _ = self.forward_backward(batches)
            with self.phase("optimizer"):
                grad_norm = clip_grad_norm_(self.params, self.plan.cfg.training.max_norm)
                self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.metrics.count(self.tokens_per_step)
        row = {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr}
        if self.comm:
            row["comm"] = self.comm.table()
        return row

    @torch.no_grad()
    def validate(self) -> float:
        data = self.plan.val_data
        data.load_state_dict(self.val_start)
        total = torch.zeros((), device=self.plan.device, dtype=torch.float64)
        tokens = torch.zeros((), device=self.plan.device, dtype=torch.int64)
        for _ in range(self.plan.cfg.validation.steps):
            inputs, targets = data.next_batch()
            with self.plan.loss_context(), autocast(self.plan):
                loss = loss_sum(self.model(inputs.to(self.plan.device)),
                                targets.to(self.plan.device))
            total += local_value(loss)
            tokens += (targets != IGNORE_INDEX).sum().to(self.plan.device)
        return (all_reduce_sum(total, self.plan) / all_reduce_sum(tokens, self.plan)).item()

    def due(self, freq: int) -> bool:
        return self.step % freq == 0 or self.step == self.plan.cfg.training.steps

    def fit(self) -> None:
        cfg = self.plan.cfg
        log.info("training %s/%s for %d steps: %d-way data parallel, %d-way tensor parallel, "
                 "%d accumulation step(s), %d tokens per device per step", cfg.model.name,
                 cfg.model.flavor, cfg.training.steps, self.plan.dims.dp, self.plan.dims.tp,
                 self.plan.accum_steps, self.tokens_per_step)
        while self.step < cfg.training.steps:
            row = self.train_step()
            validate = self.plan.val_data is not None and self.due(cfg.validation.freq)
            if validate:
                row["val_loss"] = self.validate()
            if validate or self.due(cfg.metrics.log_freq):
                row.update(self.metrics.throughput())
                row["epoch"] = self.plan.train_data.epoch
                self.metrics.report(self.step, row)


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt


def setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)


def init_distributed(plan: Plan, world_size: int) -> None:
    if world_size == 1:
        return
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    backend = "nccl" if plan.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=plan.cfg.job.collective_timeout_s))
    plan.dims.build_mesh(plan.device.type)


def run(plan: Plan, world_size: int) -> int:
    init_distributed(plan, world_size)
    trainer = None
    try:
        trainer = Trainer(plan)
        trainer.fit()
        return 0
    except KeyboardInterrupt:
        log.warning("interrupted at step %d; stopping", trainer.step if trainer else 0)
        return 130
    finally:
        if trainer is not None:
            trainer.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    setup_logging(rank)
    try:
        cfg, show = parse_args([a for a in argv if a != "--validate"])
        if show:
            print(to_toml(cfg), end="")
            return 0
        plan = plan_job(cfg, rank, world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if "--validate" in argv:
        log.info("config ok for %d rank(s)", world_size)
        return 0
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    return run(plan, world_size)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
