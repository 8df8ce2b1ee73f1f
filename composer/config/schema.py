"""The job configuration's schema: every built-in section as a dataclass, the
field helpers that say which values a key allows, and the registry of the sections
components (converters, observers, plugins) add.

A field's metadata (``choice``, ``bounded``, ``listed``) is what the parser checks a
value against; a bad value becomes a ConfigError with one line naming the key, the
value and what is allowed, which the entry point turns into exit status 2.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float64")
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                      "ZBVZeroBubble", "DualPipeV")


class ConfigError(ValueError):
    """A one-line, user-facing description of a bad configuration."""


def choice(default: Any, choices: tuple, help: str = "") -> Any:
    return field(default=default, metadata={"choices": choices, "help": help})


def bounded(default: Any, low: float | None = None, high: float | None = None,
            help: str = "", also: tuple = ()) -> Any:
    """A number in [low, high]; ``also`` lists special values allowed outside it."""
    meta = {"low": low, "high": high, "also": also, "help": help}
    return field(default=default, metadata=meta)


def listed(default: list, choices: tuple = (), help: str = "") -> Any:
    return field(default_factory=lambda: list(default), metadata={"items": choices, "help": help})


@dataclass
class Job:
    """The run as a whole: its name, output folder, seed, device and plugins."""

    name: str = field(default="composer", metadata={
        "help": "the run's name: the W&B project (metrics.wandb) and the MLflow experiment "
                "(metrics.mlflow); also in the config.toml the run writes"})
    dump_folder: str = field(default="./outputs", metadata={
        "help": "where the run writes: metrics.jsonl, run.json and config.toml, TensorBoard "
                "(tb/), checkpoints, profiles, samples"})
    seed: int = bounded(0, 0, help="seeds the initial weights (the same on every layout) and "
                                   "the random numbers drawn after them (dropout, sampling)")
    device: str = choice("auto", ("auto", "cpu", "cuda"), "auto: CUDA + NCCL when GPUs are visible")
    collective_timeout_s: int = bounded(600, 1, help="seconds the rendezvous or a collective "
                                        "may wait for its peers before the run ends with a "
                                        "line naming the group it waited in")
    overwrite: bool = field(default=False, metadata={
        "help": "a run that does not resume may replace the records (run.json, metrics.jsonl, "
                "config.toml, tb/) of another run in job.dump_folder; false: refused"})
    plugins: list = field(default_factory=list, metadata={
        "help": "modules imported before any other key is read, so that the converters, "
                "observers and config sections they register exist (e.g. [\"my_pkg.plugin\"])"})


@dataclass
class Model:
    """Which model: a family and flavor, or a Hugging Face folder; converters, attention."""

    name: str = field(default="llama3", metadata={
        "help": "a registered family, or 'module:attribute' naming a ModelSpec (or a "
                "function returning one) in a module on the Python path, which is imported "
                "(so its code runs)"})
    flavor: str = field(default="", metadata={"help": "empty: the model's first flavor"})
    hf_path: str = field(default="", metadata={
        "help": "a Hugging Face model folder (config.json, safetensors): the model's sizes "
                "come from its config.json (model.flavor is ignored) and its weights are the "
                "start unless checkpoint.initial_load_path names others; no safetensors: "
                "drawn from the config"})
    hf_trust_remote_code: bool = field(default=False, metadata={
        "help": "run the code a Hugging Face folder ships (auto_map) to build its model"})
    converters: list = listed([], None,  # checked against the registered converters
                              "model transforms applied before the parallel passes: float8, "
                              "lora, qlora or a plugin's; each reads its own section, and "
                              "they run in the order they were registered")
    attention: str = choice("auto", ("auto", "sdpa", "flex"),
                            "the attention backend: sdpa (torch's fused kernels; masks of "
                            "packed documents dense), flex (FlexAttention: causal and document "
                            "masks as block masks, compiled on CUDA, eager on CPU) or auto "
                            "(flex on CUDA where the model's attention takes it, else sdpa)")
    overrides: str = field(default="", metadata={
        "help": "change the flavor's arguments: 'top_k=4,aux_loss_coef=0.0' (TOML values)"})


@dataclass
class Data:
    """The training data: dataset, tokenizer, sequence length, format and packing."""

    dataset: str = field(default="tinyshakespeare", metadata={
        "help": "tinyshakespeare (the built-in corpus), sft_tiny or preference_tiny (the "
                "shipped SFT and preference samples), a local .txt, .json/.jsonl or .parquet "
                "file or a folder of them, or a Hugging Face hub dataset name"})
    tokenizer: str = field(default="byte", metadata={
        "help": "byte (the built-in byte-level tokenizer), or a Hugging Face tokenizer.json "
                "file or a folder holding one"})
    seq_len: int = bounded(256, 1, help="tokens per sequence (each sequence also has seq_len "
                                        "targets, its tokens shifted by one)")
    text_field: str = field(default="text", metadata={
        "help": "text: the dataset's column that holds the documents"})
    val_fraction: float = bounded(0.05, 0.0, 0.5, help="share of the documents held out for "
                                                     "validation, spread evenly through the "
                                                     "dataset; 0: no validation")
    format: str = choice("text", ("text", "sft", "preference", "tokens"),
                         "text: packed documents, loss on every token; sft: prompt/response, "
                         "messages, instruction/input/output or conversations examples, loss on "
                         "the response tokens only; preference: prompt/chosen/rejected pairs "
                         "(training.objective='dpo'); tokens: data.dataset is a token folder "
                         "written by python -m composer.tools.tokenize, packed as text is and "
                         "memory-mapped (memory independent of its size)")
    columns: str = field(default="", metadata={
        "help": "sft: the dataset's column for each field composer reads, when named "
                "otherwise: \"prompt=question,response=answer\" (fields: prompt, response, "
                "messages, instruction, input, output, conversations)"})
    chat_template: str = field(default="auto", metadata={
        "help": "sft chats (messages): auto (the tokenizer's own template from its "
                "tokenizer_config.json, else the built-in one), builtin, or the path of a "
                "Jinja file"})
    sft_packing: bool = field(default=False, metadata={
        "help": "sft: pack several examples into each sequence (false: one example per "
                "sequence, padded)"})
    document_mask: bool | str = choice(
        "auto", ("auto", True, False),
        "packed sequences (text, sft_packing): attention stays inside each document and no "
        "target crosses into the next one; auto: on where the model takes documents "
        "(ModelSpec.parallel.attention_mask)")
    reset_positions: bool = field(default=False, metadata={
        "help": "with document_mask: rotary positions count from 0 in each document"})
    streaming: bool = field(default=False, metadata={
        "help": "text: read a local dataset as training reaches it instead of tokenising it "
                "whole at the start (for corpora larger than memory; hub datasets always "
                "stream)"})


@dataclass
class Training:
    """The loop: steps, batch sizes, dtypes, gradient clipping and the objective."""

    steps: int = bounded(100, 1, help="optimizer steps to train for")
    local_batch_size: int = bounded(8, 1, help="sequences each data-parallel rank takes per "
                                               "forward and backward (one accumulation step)")
    global_batch_size: int = bounded(-1, 1, also=(-1,),
                                     help="-1: local_batch_size x data-parallel degree")
    dtype: str = choice("float32", DTYPES, "parameter and compute dtype")
    mixed_precision_param: str = choice("auto", ("auto",) + DTYPES, "auto: training.dtype")
    mixed_precision_reduce: str = choice("auto", ("auto",) + DTYPES, "auto: training.dtype")
    max_norm: float = bounded(1.0, 0.0, help="0 disables gradient clipping")
    objective: str = choice("lm", ("lm", "dpo"),
                            "lm: next-token cross-entropy; dpo: preference tuning on pairs "
                            "(data.format='preference', section dpo; needs LoRA or QLoRA)")


@dataclass
class Optimizer:
    """The optimizer: AdamW or Adam, its learning rate, weight decay, betas and kernels."""

    name: str = choice("AdamW", ("AdamW", "Adam"), "torch.optim's AdamW (decoupled weight "
                       "decay) or Adam (weight decay added to the gradient)")
    lr: float = bounded(8e-4, 0.0, help="the peak learning rate, reached at the end of the "
                                        "warmup (lr_scheduler)")
    weight_decay: float = bounded(0.1, 0.0, help="weight decay of every trained parameter")
    beta1: float = bounded(0.9, 0.0, 1.0, help="decay rate of the gradient's running mean")
    beta2: float = bounded(0.95, 0.0, 1.0, help="decay rate of the squared gradient's running "
                                                "mean")
    eps: float = bounded(1e-8, 0.0, help="added to the update's denominator, for stability")
    implementation: str = choice("auto", ("auto", "fused", "foreach", "for-loop"),
                                 "the update's kernels; auto: fused (one kernel a step), or "
                                 "foreach where a converter stores a parameter as a tensor "
                                 "subclass (float8's all-gather weights)")


@dataclass
class LRScheduler:
    """The learning-rate schedule: a linear warmup, then a decay."""

    warmup_steps: int = bounded(10, 0, help="steps of linear warmup up to optimizer.lr "
                                            "(0: none)")
    decay_type: str = choice("linear", ("linear", "cosine", "wsd", "constant"),
                             "after the warmup: linear or cosine down to min_lr_factor x lr "
                             "at the last step; wsd: flat, then linear down to it over the "
                             "last decay_ratio of the steps after the warmup; constant: flat")
    decay_ratio: float = bounded(0.2, 0.0, 1.0, help="wsd: share of steps spent decaying")
    min_lr_factor: float = bounded(0.0, 0.0, 1.0, help="the lr at the end of the decay, as a "
                                                       "fraction of optimizer.lr")


@dataclass
class Parallelism:
    """The layout: data, tensor, pipeline, context and expert parallel degrees and options."""

    data_parallel_replicate_degree: int = bounded(1, 1, help="data-parallel replicas: each "
                                                             "holds a copy of the model, "
                                                             "sharded over its data_parallel_"
                                                             "shard_degree ranks (both > 1: "
                                                             "HSDP)")
    data_parallel_shard_degree: int = bounded(-1, 1, also=(-1,), help="-1: what is left")
    zero_stage: int = choice(3, (0, 1, 2, 3), "0 DDP, 1 +sharded optimizer, 2/3 FSDP2")
    tensor_parallel_degree: int = bounded(1, 1, help="ranks that split each layer's weights "
                                                     "(the model's tensor-parallel plan); the "
                                                     "innermost mesh dim, so keep it in a node")
    sequence_parallel: bool | str = choice(
        "auto", ("auto", True, False),
        "tensor parallel: the activations between the split matmuls (norms) are sharded on "
        "the sequence, not replicated, saving activation memory; auto: on where the model's "
        "tensor-parallel plan can cut the residual stream there")
    loss_parallel: bool = field(default=True, metadata={
        "help": "tensor parallel: the logits stay sharded on the vocabulary and the loss is "
                "computed on the shards (torch's loss_parallel), never gathering them whole"})
    pipeline_parallel_degree: int = bounded(1, 1, help="pipeline stages' ranks: each holds a "
                                                       "slice of the blocks, and microbatches "
                                                       "flow through them")
    pipeline_parallel_schedule: str = choice("1F1B", PIPELINE_SCHEDULES,
                                             "torch.distributed.pipelining's schedule; "
                                             "Interleaved1F1B, LoopedBFS, "
                                             "InterleavedZeroBubble, ZBVZeroBubble and "
                                             "DualPipeV hold several stages per rank")
    pipeline_parallel_microbatches: int = bounded(
        0, 1, also=(0,), help="0: the largest multiple of the stage count dividing the local batch")
    pipeline_parallel_stages_per_rank: int = bounded(
        0, 1, also=(0,), help="looped schedules; 0: 2 (single-stage schedules 1, V shapes 2)")
    pipeline_parallel_first_stage_less_layers: int = bounded(
        0, 0, help="the first stage holds this many fewer blocks (room for the embedding)")
    pipeline_parallel_last_stage_less_layers: int = bounded(
        0, 0, help="the last stage holds this many fewer blocks (room for the output and loss)")
    pipeline_parallel_stage_fqns: str = field(
        default="", metadata={"help": "explicit units per stage: 'a,b;c,d' (';' between stages)"})
    context_parallel_degree: int = bounded(1, 1, help="ranks that split each sequence; "
                                                      "attention exchanges keys and values "
                                                      "(or heads) between them")
    context_parallel_method: str = choice("allgather", ("allgather", "alltoall"),
                                          "allgather: K/V gathered over cp; alltoall: "
                                          "Ulysses, heads exchanged for the sequence")
    expert_parallel_degree: int = bounded(1, 1, help="MoE: ranks the experts are spread "
                                                     "over, borrowed from data_parallel_shard"
                                                     "_degree x context_parallel_degree "
                                                     "(must divide it)")


@dataclass
class Validation:
    """The loss on held-out documents every few steps, and greedy samples."""

    enable: bool = field(default=True, metadata={
        "help": "compute the loss on the held-out documents (data.val_fraction), logged as "
                "val_loss"})
    freq: int = bounded(50, 1, help="validate every this many steps (and at the last step)")
    steps: int = bounded(4, 1, help="global batches per evaluation")
    generate: list = field(default_factory=list, metadata={
        "help": "prompts the model continues at each validation, greedily, its samples "
                "logged and written to <dump folder>/samples.jsonl (empty: none)"})
    generate_tokens: int = bounded(32, 1, help="new tokens per validation sample")


@dataclass
class Metrics:
    """What each logged step reports: metrics.jsonl, TensorBoard, communication, memory, time."""

    log_freq: int = bounded(10, 1, help="log a line and a metrics.jsonl row every this many "
                                        "steps (and at the last step)")
    enable_tensorboard: bool = field(default=True, metadata={
        "help": "also write the rows as TensorBoard scalars to <dump_folder>/tb"})
    comm_stats: bool = field(default=False, metadata={
        "help": "count each step's collectives by phase, mesh dim and kind (count, bytes, "
                "ring bytes) into the row's comm column; multi-process runs, at a cost on "
                "every op"})
    step_anatomy: bool = field(default=True, metadata={
        "help": "time each logged step's phases and collectives (exposed / hidden) and "
                "name the slowest rank"})
    memory_breakdown: bool = field(default=False, metadata={
        "help": "peak memory per rank by category (parameters, gradients, optimizer state, "
                "activations); on CPU through torch's MemTracker, which slows each step"})
    expert_load: bool = field(default=False, metadata={
        "help": "MoE: log every layer's tokens per expert (n_layers x n_experts numbers a row)"})
    wandb: bool = field(default=False, metadata={
        "help": "also log the rows, the config and the run record to Weights & Biases "
                "(pip install 'composer-parallel[wandb]'): project job.name, files in "
                "<dump_folder>/wandb; offline unless WANDB_API_KEY or WANDB_MODE is set"})
    mlflow: bool = field(default=False, metadata={
        "help": "also log the rows, the config (as params) and the run record to MLflow "
                "(pip install 'composer-parallel[mlflow]'): experiment job.name"})
    mlflow_tracking_uri: str = field(default="", metadata={
        "help": "the MLflow tracking store; empty: sqlite:///<dump_folder>/mlflow.db, "
                "artifacts in <dump_folder>/mlartifacts"})


@dataclass
class Profiling:
    """A torch.profiler trace of a window of steps."""

    enable: bool = field(default=False, metadata={
        "help": "trace a window of steps with torch.profiler on every rank (Perfetto, "
                "TensorBoard); on CUDA also the allocator's history"})
    start_step: int = bounded(3, 1, help="the window's first step (the first steps warm up)")
    steps: int = bounded(2, 1, help="steps in the window")
    folder: str = field(default="profile", metadata={"help": "relative to job.dump_folder"})


@dataclass
class Checkpoint:
    """Saving, resuming and exporting: DCP steps, initial weights, Hugging Face exports."""

    enable: bool = field(default=False, metadata={
        "help": "save DCP steps to <dump_folder>/<folder>, and resume from one "
                "(checkpoint.load_step) where the folder holds a complete step"})
    folder: str = field(default="checkpoint", metadata={"help": "relative to job.dump_folder"})
    interval: int = bounded(500, 1, help="save every this many steps (and at the last step)")
    keep_latest_k: int = bounded(0, 0, help="0 keeps every checkpoint")
    async_mode: str = choice("disabled", ("disabled", "async"),
                             "async: write in the background while training goes on")
    load_step: int = bounded(-1, 0, also=(-1,), help="-1: the newest complete step")
    on_save_error: str = choice("stop", ("stop", "continue"),
                                "continue: a save that fails (disk full, an unwritable folder) "
                                "is logged and counted, and training goes on")
    initial_load_path: str = field(default="", metadata={
        "help": "weights to start from when there is nothing to resume: a DCP step folder "
                "or a Hugging Face safetensors folder"})
    initial_load_model_only: bool = field(default=True, metadata={
        "help": "a DCP step in initial_load_path: take its weights only (false: resume the "
                "whole run from it: optimizer, step, data position)"})
    export_dtype: str = choice("float32", DTYPES, "dtype of Hugging Face exports")
    last_save_in_hf: bool = field(default=False, metadata={
        "help": "also export the final weights as Hugging Face safetensors"})


@dataclass
class Recovery:
    """Keeping a long run going: skipping non-finite steps, rolling back loss spikes."""

    skip_nonfinite: bool = field(default=True, metadata={
        "help": "skip the update of a step whose loss or gradient norm is not finite"})
    spike_factor: float = bounded(0.0, 0.0,
                                  help="roll back when loss > factor x running mean; 0: off")
    spike_window: int = bounded(20, 1, help="steps in the running mean")
    max_rollbacks: int = bounded(3, 0, help="roll-backs allowed; the next spike ends the "
                                            "run (exit status 3)")


@dataclass
class ActivationCheckpoint:
    """Recomputing activations in backward, to save memory."""

    mode: str = choice("none", ("none", "full", "selective_layer", "selective_op"),
                       "recompute in backward: every block, every Nth block, or every block "
                       "but its matmul/attention outputs")
    every: int = bounded(2, 1, help="selective_layer: checkpoint every this-many-th block")


@dataclass
class Compile:
    """torch.compile of the blocks (and the loss)."""

    enable: bool = field(default=False, metadata={"help": "torch.compile each block"})
    backend: str = choice("inductor", ("inductor", "aot_eager", "eager"),
                          "torch.compile's backend: inductor (generated kernels), aot_eager "
                          "(traced, then run eagerly: to debug a compile), eager")
    loss: bool = field(default=False, metadata={"help": "compile the loss as well"})


@dataclass
class Planner:
    """The planner's view of the job: the cluster its predictions are for."""

    cluster: str = field(default="", metadata={
        "help": "the cluster that --validate predicts for and composer-plan's default "
                "--cluster: a built-in profile (e.g. h100-80gb; a wrong name lists them) or "
                "the path of a cluster TOML file; empty: the device this runs on (composer-plan: "
                "cpu)"})


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    validation: Validation = field(default_factory=Validation)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    recovery: Recovery = field(default_factory=Recovery)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    planner: Planner = field(default_factory=Planner)
    # the registered components' sections, by name (see register_section)
    components: dict = field(default_factory=lambda: {n: c() for n, c in SECTIONS.items()},
                             repr=False)

    def __getattr__(self, name: str) -> Any:
        """A registered component's section reads like a built-in one: ``cfg.lora``."""
        components = self.__dict__.get("components", {})
        if name in components:
            return components[name]
        raise AttributeError(f"{type(self).__name__} has no section {name!r}")


SECTIONS: dict[str, type] = {}  # the components' own sections: name -> dataclass


def register_section(name: str, section: type) -> None:
    """Make the dataclass ``section`` settable as ``[name]`` in TOML and
    ``--name.key`` on the command line, validated like a built-in section (its
    fields' metadata: ``choice``, ``bounded``, ``listed``). A component (a converter,
    an observer) registers the section it reads; registering the same class again
    (also from a reloaded module) replaces it, another class under a taken name is
    a ValueError."""
    if not dataclasses.is_dataclass(section):
        raise ValueError(f"config section {name!r}: {section!r} is not a dataclass")
    builtin = {f.name for f in dataclasses.fields(JobConfig)}
    taken = SECTIONS.get(name, section)
    same = (taken.__module__, taken.__qualname__) == (section.__module__, section.__qualname__)
    if name in builtin or not same:  # the same class again (a reloaded module) replaces it
        raise ValueError(f"config section {name!r} is taken")
    SECTIONS[name] = section


def sections(cfg: JobConfig) -> dict[str, Any]:
    """Every section of ``cfg`` by name: the built-in ones, then the components'."""
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "components"}
    return {**out, **cfg.components}
