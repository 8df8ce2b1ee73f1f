"""The parity matrix's layouts, their one-process references and the launches that run
them (``group_jobs``). The test suite runs each group once per session
(``tests/support/parity.py``'s fixtures); the checks are
``tests/integration/test_parity.py``'s.

float64 everywhere; the same global batch of 8 sequences per step on every layout.
"""
from __future__ import annotations

from composer.testing.harness import PARITY, Run

GLOBAL_BATCH = 8


def layout(nproc: int, zero: int, local: int, replicate: int = 1, accumulate: bool = False,
           tp: int = 1, sp: bool | str = True, pp: int = 1, schedule: str = "1F1B", cp: int = 1,
           extra: tuple = ()):
    args = ["--parallelism.zero_stage", str(zero), "--training.local_batch_size", str(local),
            "--parallelism.data_parallel_replicate_degree", str(replicate),
            "--parallelism.tensor_parallel_degree", str(tp),
            "--parallelism.context_parallel_degree", str(cp),
            "--parallelism.sequence_parallel", str(sp).lower(),
            "--parallelism.pipeline_parallel_degree", str(pp),
            "--parallelism.pipeline_parallel_schedule", schedule, *extra]
    nproc_dp = nproc // (tp * pp * cp)
    if accumulate:
        args += ["--training.global_batch_size", str(GLOBAL_BATCH)]
    assert (local * nproc_dp * (GLOBAL_BATCH // (local * nproc_dp) if accumulate else 1)
            == GLOBAL_BATCH)
    return nproc, args


MOE = ("--model.name", "moe", "--metrics.expert_load")
EP = "--parallelism.expert_parallel_degree"
AC = "--activation_checkpoint.mode"
MEMORY = "--metrics.memory_breakdown"  # observes only; the planner's memory test reads it
COMM = "--metrics.comm_stats"  # observes only
LORA = ("--model.converters", "lora", "--lora.rank", "4", "--lora.target_modules",
        "wq,wv,wo,w1,w2,output", "--data.format", "sft",
        "--data.dataset", "tests/data/sft_tiny.jsonl",
        "--optimizer.lr", "3e-2")  # adapters start at zero: a larger step shows them learn
# QLoRA: the same on a base stored in NF4 (the flavor whose linears divide into its blocks)
QLORA = ("--model.converters", "qlora", "--model.flavor", "debug256", "--lora.rank", "4",
         "--lora.target_modules", "wq,wv,wo,w1,w2", "--data.format", "sft", "--data.dataset",
         "tests/data/sft_tiny.jsonl", "--optimizer.lr", "3e-2")
# DPO on preference pairs with LoRA (reference: the same on one process): 8 pairs a step,
# 16 sequences; the loss is normalised by the global pairs. Under TP with loss parallel
# the per-token log-probabilities come from vocabulary-sharded logits.
DPO = ("--model.converters", "lora", "--lora.rank", "4", "--lora.target_modules",
       "wq,wv,wo,w1,w2,output", "--training.objective", "dpo", "--data.format", "preference",
       "--data.dataset", "tests/data/preference_tiny.jsonl", "--optimizer.lr", "3e-2")
# full fine-tuning: the reference is a frozen copy of the start, sharded like the policy
DPO_FULL = ("--training.objective", "dpo", "--data.format", "preference", "--data.dataset",
            "tests/data/preference_tiny.jsonl", "--optimizer.lr", "1e-3")
A2A = "--parallelism.context_parallel_method=alltoall"
# Qwen3 (the untied debug model: a tied one cannot be cut between stages)
QWEN3 = ("--model.name", "qwen3", "--model.overrides", "tie_embeddings=false")
QWEN3_MOE = ("--model.name", "qwen3_moe", "--metrics.expert_load")
# your own model (examples/my_model.py, named module:attribute): a tied head, and an
# untied one for the pipeline rows (a tied one cannot be cut between stages)
MY = ("--model.name", "examples.my_model:spec")
MY_UNTIED = (*MY, "--model.flavor", "tiny_untied")
CAUSAL = ("--data.document_mask", "false")
# samples at each validation: a KV cache under TP, whole padded windows under sequence and
# context parallel (under FSDP: test_eval.py's generations); each must be one process's
SAMPLES = ("--validation.generate", "ROMEO:", "--validation.generate_tokens", "8")
SAMPLED = ("tp2", "tp2_sp", "cp2")
# lm-eval tasks in training (a multiple-choice and a perplexity task): context parallel
# scores padded windows, its ranks sharing the logits (the split over data-parallel ranks:
# test_eval.py)
EVALS = ("--eval.tasks", "composer_tiny_qa,composer_tiny_text", "--eval.include_path",
         "tests/data/eval", "--eval.freq", "4", "--eval.limit", "2")
EVALUATED = ("cp2",)
RESET = ("--data.reset_positions", "true")
# FlexAttention (eager on CPU, trained with its device check lifted) against the SDPA
# references: causal and document masks as BlockMasks, under all-gather by global
# position and document, under all-to-all the model's own of the whole sequence
FLEX = ("--model.attention", "flex")
FLEX_ROWS = {  # name: (nproc, local batch, cp, tp, all-to-all)
    "x1": (1, 8, 1, 1, False), "cp2": (2, 8, 2, 1, False), "cp2_alltoall": (2, 8, 2, 1, True),
    "cp4": (4, 8, 4, 1, False), "cp4_alltoall": (4, 8, 4, 1, True)}
FLEX_LAYOUTS = {
    **{f"flex{'_causal' if causal else ''}_{name}": layout(
        nproc, zero=3, local=local, cp=cp, tp=tp,
        extra=(*FLEX, *(CAUSAL if causal else ()), *((A2A,) if a2a else ())))
       for causal in (False, True) for name, (nproc, local, cp, tp, a2a) in FLEX_ROWS.items()},
    "flex_cp2_fsdp2": layout(4, zero=3, local=4, cp=2, extra=FLEX),
    "flex_cp2_tp2": layout(4, zero=3, local=8, cp=2, tp=2, extra=FLEX)}
LAYOUTS = {
    "ddp_x2": layout(2, zero=0, local=4),
    "zero1_x2": layout(2, zero=1, local=4),
    "zero2_x2": layout(2, zero=2, local=4),
    # these two also hold tests/integration/test_dry_run.py's tracer to a real run
    "zero3_x2": layout(2, zero=3, local=4, extra=(MEMORY, COMM)),
    "hsdp_2x2": layout(4, zero=3, local=2, replicate=2, extra=(MEMORY, COMM)),
    # accumulation: FSDP2 reduce-scatters every microbatch (gradients stay sharded),
    # HSDP all-reduces over the replicas on the last, DDP and ZeRO-1 sync only there
    "zero3_x2_accumulate2": layout(2, zero=3, local=2, accumulate=True,
                                   extra=("--metrics.comm_stats",)),
    "hsdp_2x2_accumulate2": layout(4, zero=3, local=1, replicate=2, accumulate=True,
                                   extra=("--metrics.comm_stats",)),
    "zero1_x2_accumulate2": layout(2, zero=1, local=2, accumulate=True,
                                   extra=("--metrics.comm_stats",)),
    "ddp_x2_accumulate2": layout(2, zero=0, local=2, accumulate=True,
                                 extra=("--metrics.comm_stats",)),
    # tensor parallel; comm_stats only observes, and feeds test_comm.py
    "tp2": layout(2, zero=3, local=8, tp=2, sp=False,
                  extra=("--parallelism.loss_parallel", "false", "--metrics.comm_stats",
                         *SAMPLES)),
    "tp2_sp": layout(2, zero=3, local=8, tp=2, extra=("--metrics.comm_stats", MEMORY, *SAMPLES)),
    "tp4_sp": layout(4, zero=3, local=8, tp=4),
    "fsdp2_tp2": layout(4, zero=3, local=4, tp=2, extra=("--metrics.comm_stats",)),
    "hsdp_2x2_tp2": layout(8, zero=3, local=2, replicate=2, tp=2),
    "ddp2_tp2": layout(4, zero=0, local=4, tp=2),
    "tp2_sp_accumulate2": layout(2, zero=3, local=4, tp=2, accumulate=True),
    # pipeline parallel: 8 microbatches of one sequence unless a row says otherwise
    "pp2_gpipe": layout(2, zero=3, local=8, pp=2, schedule="GPipe",
                        extra=("--metrics.comm_stats",)),
    "pp2_1f1b": layout(2, zero=3, local=8, pp=2, extra=("--metrics.comm_stats",)),
    "pp4_1f1b": layout(4, zero=3, local=8, pp=4),
    "pp2_interleaved1f1b": layout(2, zero=3, local=8, pp=2, schedule="Interleaved1F1B"),
    "pp2_zbv": layout(2, zero=3, local=8, pp=2, schedule="ZBVZeroBubble"),
    "pp2_fsdp2": layout(4, zero=3, local=4, pp=2),
    "pp2_tp2": layout(4, zero=3, local=8, pp=2, tp=2),
    "pp2_fsdp2_tp2": layout(8, zero=3, local=4, pp=2, tp=2),
    "pp2_uneven_3_1": layout(2, zero=3, local=8, pp=2,
                             extra=("--parallelism.pipeline_parallel_last_stage_less_layers", "2")),
    # mixture of experts (reference: the MoE debug model on one process); the
    # router's statistics and aux loss must match too
    "moe_fsdp2": layout(2, zero=3, local=4, extra=MOE),
    "moe_ep2": layout(2, zero=3, local=4, extra=(*MOE, EP, "2", "--metrics.comm_stats")),
    "moe_ep2_fsdp4": layout(4, zero=3, local=2, extra=(*MOE, EP, "2", "--metrics.comm_stats")),
    "moe_hsdp_2x2_ep2": layout(4, zero=3, local=2, replicate=2, extra=(*MOE, EP, "2")),
    "moe_ep2_tp2": layout(4, zero=3, local=4, tp=2, extra=(*MOE, EP, "2", "--metrics.comm_stats")),
    "moe_pp2_ep2": layout(4, zero=3, local=4, pp=2, extra=(*MOE, EP, "2")),
    "moe_ep2_accumulate2": layout(2, zero=2, local=2, accumulate=True, extra=(*MOE, EP, "2")),
    # activation checkpointing recomputes in backward what forward computed: the
    # same numbers, and the routers count each token once
    "ac_full": layout(1, zero=3, local=8, extra=(AC, "full", MEMORY)),
    "ac_selective_layer": layout(1, zero=3, local=8, extra=(AC, "selective_layer")),
    "ac_selective_op": layout(1, zero=3, local=8, extra=(AC, "selective_op")),
    "ac_full_fsdp2_tp2": layout(4, zero=3, local=4, tp=2,
                                extra=(AC, "full", "--metrics.comm_stats")),
    "ac_selective_op_fsdp2_tp2": layout(4, zero=3, local=4, tp=2, extra=(AC, "selective_op")),
    "ac_selective_layer_pp2": layout(2, zero=3, local=8, pp=2,
                                     extra=(AC, "selective_layer",
                                            "--activation_checkpoint.every", "1")),
    "moe_ep2_ac_full": layout(2, zero=3, local=4, extra=(*MOE, EP, "2", AC, "full")),
    # LoRA fine-tuning on the SFT set (reference: the same LoRA run on one process):
    # frozen sharded base, sharded adapters, prompt targets masked out of the count
    "lora_fsdp2": layout(2, zero=3, local=4, extra=LORA),
    "lora_tp2": layout(2, zero=3, local=8, tp=2, extra=(*LORA, "--metrics.comm_stats")),
    "lora_fsdp2_tp2_ac_full": layout(4, zero=3, local=4, tp=2, extra=(*LORA, AC, "full")),
    "lora_pp2": layout(2, zero=3, local=8, pp=2, extra=LORA),
    # selective-op AC keeps the adapters' matmul outputs too (the planner's memory test)
    "lora_ac_selective_op": layout(1, zero=3, local=8, extra=(*LORA, AC, "selective_op", MEMORY)),
    "dpo_fsdp2": layout(2, zero=3, local=4, extra=DPO),
    "dpo_tp2": layout(2, zero=3, local=8, tp=2, extra=DPO),
    "dpo_fsdp2_accumulate2": layout(2, zero=3, local=2, accumulate=True, extra=DPO),
    "dpo_full_fsdp2": layout(2, zero=3, local=4, extra=DPO_FULL),
    # QLoRA (reference: the same NF4 base on one process): FSDP2 gathers the NF4
    # codes and scales, and every layout quantizes the same whole weights
    # memory: the NF4 base's shard and its dequantization in backward (test_parity.py)
    "qlora_fsdp2": layout(2, zero=3, local=4, extra=(*QLORA, COMM, MEMORY)),
    "qlora_zero2_x2_ac_full": layout(2, zero=2, local=4, extra=(*QLORA, AC, "full")),
    "qlora_hsdp_2x2": layout(4, zero=3, local=2, replicate=2, extra=QLORA),
    "qlora_pp2": layout(2, zero=3, local=8, pp=2, extra=QLORA),
    "qlora_pp2_fsdp2": layout(4, zero=3, local=4, pp=2, extra=QLORA),
    # Qwen3 dense and MoE (references: the same models on one process); the q/k
    # norms' gradients are summed over tp, the experts' routing matches
    "qwen3_fsdp2": layout(2, zero=3, local=4, extra=QWEN3),
    "qwen3_tp2_sp": layout(2, zero=3, local=8, tp=2, extra=QWEN3),
    "qwen3_fsdp2_tp2": layout(4, zero=3, local=4, tp=2, extra=QWEN3),
    "qwen3_pp2": layout(2, zero=3, local=8, pp=2, extra=QWEN3),
    "qwen3_moe_fsdp2": layout(2, zero=3, local=4, extra=QWEN3_MOE),
    "qwen3_moe_ep2": layout(2, zero=3, local=4, extra=(*QWEN3_MOE, EP, "2")),
    "qwen3_moe_tp2_sp": layout(2, zero=3, local=8, tp=2,
                               extra=(*QWEN3_MOE, "--metrics.comm_stats")),
    "qwen3_moe_pp2": layout(2, zero=3, local=8, pp=2, extra=QWEN3_MOE),
    # context parallel: each rank holds chunks r and 2cp-1-r of every sequence and
    # attends to the all-gathered keys and values
    "cp2": layout(2, zero=3, local=8, cp=2, extra=(MEMORY, *SAMPLES, *EVALS)),
    "cp4": layout(4, zero=3, local=8, cp=4),
    "cp2_fsdp2": layout(4, zero=3, local=4, cp=2, extra=("--metrics.comm_stats",)),
    "cp2_fsdp2_ac_full": layout(4, zero=3, local=4, cp=2,
                                extra=(AC, "full", "--metrics.comm_stats")),
    "cp2_ddp2": layout(4, zero=0, local=4, cp=2),
    "cp2_tp2_sp": layout(4, zero=3, local=8, cp=2, tp=2),
    "cp2_ac_full": layout(2, zero=3, local=8, cp=2, extra=(AC, "full")),
    "cp2_lora": layout(2, zero=3, local=8, cp=2, extra=LORA),
    "cp2_pp2": layout(4, zero=3, local=8, cp=2, pp=2),
    # the all-to-all (Ulysses) method: heads traded for the sequence
    "cp2_alltoall": layout(2, zero=3, local=8, cp=2, extra=(A2A,)),
    "cp4_alltoall": layout(4, zero=3, local=8, cp=4, extra=(A2A,)),
    "cp2_tp2_alltoall": layout(4, zero=3, local=8, cp=2, tp=2, extra=(A2A,)),
    "cp2_fsdp2_ac_full_alltoall": layout(4, zero=3, local=4, cp=2,
                                         extra=(A2A, AC, "full", "--metrics.comm_stats")),
    "cp2_fsdp2_alltoall": layout(4, zero=3, local=4, cp=2, extra=(A2A, "--metrics.comm_stats")),
    # MoE under context parallel: the auxiliary loss's per-sequence counts summed over cp
    "moe_cp2": layout(2, zero=3, local=8, cp=2, extra=MOE),
    "moe_cp2_fsdp2_ac_full": layout(4, zero=3, local=4, cp=2, extra=(*MOE, AC, "full")),
    "qwen3_moe_cp2_alltoall": layout(2, zero=3, local=8, cp=2, extra=(*QWEN3_MOE, A2A)),
    # expert parallel borrows ranks of dp_shard x cp: the cp ranks of a sequence
    # first (ep2 over cp2), then dp_shard (ep4 over fsdp2 x cp2)
    "moe_cp2_ep2": layout(2, zero=3, local=8, cp=2, extra=(*MOE, EP, "2")),
    "moe_cp2_fsdp2_ep4": layout(4, zero=3, local=4, cp=2, extra=(*MOE, EP, "4")),
    "qwen3_moe_cp2_ep2_alltoall": layout(2, zero=3, local=8, cp=2,
                                         extra=(*QWEN3_MOE, EP, "2", A2A)),
    "qwen3_cp2_tp2": layout(4, zero=3, local=8, cp=2, tp=2, extra=QWEN3),
    # packed documents are masked in every row above (data.document_mask is on by
    # default; the LoRA rows' padded SFT has none, so they run causal attention);
    # these rows attend causally across documents, or restart the positions
    "causal_cp2": layout(2, zero=3, local=8, cp=2, extra=CAUSAL),
    "causal_cp2_alltoall": layout(2, zero=3, local=8, cp=2, extra=(*CAUSAL, A2A)),
    "reset_cp2": layout(2, zero=3, local=8, cp=2, extra=RESET),
    "reset_cp2_pp2": layout(4, zero=3, local=8, cp=2, pp=2, extra=RESET),
    # a model composer has never seen, through its spec alone
    "my_model_fsdp2": layout(2, zero=3, local=4, extra=MY),
    "my_model_tp2": layout(2, zero=3, local=8, tp=2, extra=MY),
    "my_model_cp2": layout(2, zero=3, local=8, cp=2, extra=MY),
    "my_model_tp2_ac_full": layout(2, zero=3, local=8, tp=2, extra=(*MY, AC, "full")),
    "my_model_pp2": layout(2, zero=3, local=8, pp=2, extra=MY_UNTIED),
    "my_model_pp2_fsdp2": layout(4, zero=3, local=4, pp=2, extra=MY_UNTIED),
    # context parallel's all-gather without documents: each chunk over the keys before
    # it, causal to the lower right (no mask of queries x keys)
    "causal_cp4": layout(4, zero=3, local=8, cp=4, extra=CAUSAL),
    **FLEX_LAYOUTS,
}


# torch 2.13's schedule eval() cannot run V-shaped schedules; the trainer says so
NO_VALIDATION = ("pp2_zbv",)

# The inner loop (-m "not slow") runs one 2-rank row of each pass family; the
# references and these rows share one launch, the other rows another.
QUICK = ("zero3_x2", "tp2", "tp2_sp", "pp2_1f1b", "moe_ep2", "lora_tp2", "qlora_fsdp2", "ac_full",
         "cp2", "my_model_fsdp2", "dpo_tp2")
REFERENCES = {"llama3": (*SAMPLES, *EVALS), "moe": ("--model.name", "moe"), "llama3_lora": LORA,
              "llama3_qlora": QLORA, "llama3_dpo": DPO,
              "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "my_model": MY}
# the flex rows' SDPA references, in their launch
FLEX_REFERENCES = {"llama3": (), "llama3_causal": CAUSAL}
FULL_REFERENCES = {"llama3_causal": CAUSAL, "llama3_reset": RESET,  # for slow rows only
                   "llama3_dpo_full": DPO_FULL,
                   "my_model_untied": MY_UNTIED}


def model_of(args: list[str]) -> str:
    """The reference run a layout's run must match: its model (a spec named
    module:attribute by its module's last name), and DPO, QLoRA, LoRA, causal attention,
    restarting positions, an untied head or none of them."""
    model = args[args.index("--model.name") + 1] if "--model.name" in args else "llama3"
    model = model.split(":")[0].rpartition(".")[2]
    if "dpo" in args:  # with LoRA, or full fine-tuning against a frozen copy
        return f"{model}_dpo" if "lora" in args else f"{model}_dpo_full"
    for word, variant in (("qlora", "qlora"), ("lora", "lora"),
                          (CAUSAL[0], "causal"), (RESET[0], "reset"), ("tiny_untied", "untied")):
        if word in args:
            return f"{model}_{variant}"
    return model


def references(keys: dict) -> dict[str, Run]:
    return {f"reference_{key}": Run(1, PARITY + ["--metrics.expert_load",
                                                 "--training.local_batch_size",
                                                 str(GLOBAL_BATCH), *extra])
            for key, extra in keys.items()}


def group_of(name: str) -> str:
    """The launch a layout runs in: the quick rows, the flex rows (a launch of their own:
    in the full launch's process their jobs left gloo threads behind), or the rest."""
    return "quick" if name in QUICK else "flex" if name in FLEX_LAYOUTS else "full"


def group_jobs(group: str) -> dict[str, Run]:
    keys = {"quick": REFERENCES, "flex": FLEX_REFERENCES, "full": FULL_REFERENCES}[group]
    return {**references(keys),
            **{name: Run(nproc, PARITY + args) for name, (nproc, args) in LAYOUTS.items()
               if group_of(name) == group}}
