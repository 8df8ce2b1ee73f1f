"""What LoRA and QLoRA save per rank: model state of LoRA and QLoRA next to full
fine-tuning.

1. Analytic, on the meta device, for train_configs/llama3_{8b,70b}_lora.toml:
   per rank on 8 ranks, everything sharded over all of them (FSDP x TP), with
   b bytes per element of ``training.dtype`` (torch's AdamW keeps its two
   moments in the parameter dtype):
       params P b/8   grads T b/8   AdamW 2 T b/8
   (P parameters, T trainable: the adapters for LoRA, P for full fine-tuning).
   Under TP the adapter matrix that TP replicates (A of a column-wise linear,
   B of a row-wise one) is sharded by FSDP only, so the 70B LoRA rows are a
   slight underestimate; next to the frozen base they are negligible anyway.
   QLoRA beside LoRA, per rank on 8 ranks: the base as stored (NF4 block
   linears at 0.5 + 1/64 + b/16384 bytes an element, the rest in b bytes),
   beside its formula, and the planner's peak for each layout (LoRA as its
   config; QLoRA FSDP2 over 8, its 70B config; both on h100-80gb).
2. Measured: the real trainer on 2 CPU ranks, FSDP2 (ZeRO-3), float32, a
   debug model widened so that parameter state outweighs activations, once
   full fine-tuning, once LoRA and once QLoRA; each category of rank 0's step
   peak (``metrics.memory_breakdown``, last step) beside its formula
   (params 4P/2, QLoRA's as above, grads 4T/2, AdamW 8T/2). The categories are those alive at
   the moment of the peak: full fine-tuning peaks in the optimizer step (no
   activations left; the default foreach AdamW adds a parameter-sized
   temporary to its state), LoRA in the forward/backward (no adapter
   gradients yet).

References: table 1 puts LoRA beside full fine-tuning of the same model (analytic
formulas); table 2 puts QLoRA's stored base beside LoRA's, and the planner's predicted
peak of each; table 3 puts each measured category beside its formula (the analytic
minimum), and LoRA beside full fine-tuning (LoRA/full). With ``--json`` every row of the
three tables is printed as one list, each with its ``table`` ("analytic", "qlora",
"measured").

    OMP_NUM_THREADS=1 python benchmarks/bench_lora.py [--json]
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from composer.config import parse_args
from composer.converters.lora import convert_lora
from composer.converters.qlora import candidates, nf4_bytes_per_element
from composer.job.plan import resolve_model
from composer.planner import layout_of, load_cluster, load_model, predict
from composer.testing.harness import launch, read_metrics
from composer.testing.report import bench_parser, emit_tables

CONFIGS = ("train_configs/llama3_8b_lora.toml", "train_configs/llama3_70b_lora.toml")
# each LoRA config and its QLoRA layout (no tensor parallel: NF4 cannot be cut by it)
QLORA = {"train_configs/llama3_8b_lora.toml": ["--config", "train_configs/llama3_8b_lora.toml",
                                                "--model.converters", "qlora"],
         "train_configs/llama3_70b_lora.toml": ["--config", "train_configs/llama3_70b_qlora.toml"]}
RANKS = 8
BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
GIB = 2**30
RESOLUTION = 1e-5  # GiB: the measured table's last digit

NPROC = 2
WIDE = "dim=512,n_layers=8,n_heads=8,n_kv_heads=4"
LORA = ["--model.converters", "lora", "--lora.target_modules", "wq,wk,wv,wo,w1,w2,w3",
        "--lora.rank", "8"]
RUN = ["--model.overrides", WIDE, "--parallelism.zero_stage", "3", "--training.dtype", "float32",
       "--data.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "3",
       "--metrics.log_freq", "1", "--metrics.memory_breakdown", "true",
       "--metrics.enable_tensorboard", "false", "--validation.enable", "false"]
MEASURED = ("params", "grads", "optimizer", "activations", "other", "peak")

ANALYTIC_COLUMNS = ["config", "dtype", "trainable params (M)", "params (M)", "AdamW LoRA",
                    "AdamW full", "full/LoRA AdamW", "grads + AdamW LoRA", "grads + AdamW full",
                    "params + grads + AdamW LoRA", "params + grads + AdamW full",
                    "full/LoRA state"]
QLORA_COLUMNS = ["model", "NF4 elements (B)", "params (B)", "LoRA base", "QLoRA base",
                 "LoRA/QLoRA", "LoRA planned peak", "QLoRA planned peak"]
MEASURED_COLUMNS = ["category", "LoRA", "LoRA formula", "QLoRA", "QLoRA formula", "full",
                    "full formula", "LoRA/full"]


def counts(cfg) -> tuple[int, int, int]:
    """(P without adapters, P with them, T = the adapters) of the configured model.

    Hand count, 8B at rank 16 (dim 4096, kv 1024, ffn 14336), r (in + out) each:
    wq, wo 16*8192; wk, wv 16*5120; w1, w2, w3 16*18432 -> 1,310,720 a block,
    x 32 blocks = 41,943,040 adapter parameters (what this returns as T).
    """
    spec, args = resolve_model(cfg)
    model = spec.build_meta(args)
    base = sum(p.numel() for p in model.parameters())
    convert_lora(model, cfg.lora, spec.adapters.lora_targets)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return base, total, trainable


def nf4_elements(cfg) -> int:
    """Elements of the weights QLoRA stores in NF4 (every block linear)."""
    spec, args = resolve_model(cfg)
    model = spec.build_meta(args)
    return sum(m.weight.numel() for m in candidates(model, spec, cfg.lora.quantize_output).values())


def qlora_base(cfg, b: int, ranks: int) -> float:
    """Bytes per rank of the base as QLoRA stores it."""
    base, _, _ = counts(cfg)
    nf4 = nf4_elements(cfg)
    return (nf4 * nf4_bytes_per_element(b) + (base - nf4) * b) / ranks


def planned(argv: list[str]) -> tuple[float, float]:
    """The planner's (params, peak) per rank, GiB, on one node of h100-80gb."""
    cfg, _ = parse_args(argv)
    cluster = load_cluster("h100-80gb")
    m = predict(layout_of(cfg, load_model(cfg), RANKS, cluster.device), cluster).peak.gib()
    return m["params"], m["peak"]


def qlora_row(path: str) -> dict:
    cfg, _ = parse_args(["--config", path])
    qcfg, _ = parse_args(QLORA[path])
    b = BYTES[cfg.training.dtype]
    _, total, trainable = counts(cfg)
    lora_base = state(total, trainable, b, RANKS)["params"] / GIB
    q_formula = qlora_base(qcfg, b, RANKS) / GIB
    (_, lora_peak), (_, q_peak) = planned(["--config", path]), planned(QLORA[path])
    return {"table": "qlora", "model": cfg.model.flavor,
            "NF4 elements (B)": nf4_elements(qcfg) / 1e9, "params (B)": counts(cfg)[0] / 1e9,
            "LoRA base": lora_base, "QLoRA base": q_formula, "LoRA/QLoRA": lora_base / q_formula,
            "LoRA planned peak": lora_peak, "QLoRA planned peak": q_peak}


def qlora_table() -> tuple[str, list[dict]]:
    heading = (f"LoRA and QLoRA per rank on {RANKS} ranks (GiB): the frozen base as stored, "
               f"and the planner's peak (h100-80gb; LoRA as its config, QLoRA FSDP2 x{RANKS})")
    return heading, [qlora_row(path) for path in CONFIGS]


def state(params: int, trainable: int, b: int, ranks: int) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and AdamW state, all sharded over ``ranks``."""
    return {"params": params * b / ranks, "grads": trainable * b / ranks,
            "optimizer": 2 * trainable * b / ranks}


def analytic_row(path: str) -> dict:
    cfg, _ = parse_args(["--config", path])
    base, total, trainable = counts(cfg)
    b = BYTES[cfg.training.dtype]
    lora, full = state(total, trainable, b, RANKS), state(base, base, b, RANKS)
    opt = lora["optimizer"] / GIB, full["optimizer"] / GIB
    grad_opt = [(s["grads"] + s["optimizer"]) / GIB for s in (lora, full)]
    whole = [sum(s.values()) / GIB for s in (lora, full)]
    return {"table": "analytic", "config": Path(path).stem, "dtype": cfg.training.dtype,
            "trainable params (M)": trainable / 1e6, "params (M)": base / 1e6,
            "AdamW LoRA": opt[0], "AdamW full": opt[1], "full/LoRA AdamW": opt[1] / opt[0],
            "grads + AdamW LoRA": grad_opt[0], "grads + AdamW full": grad_opt[1],
            "params + grads + AdamW LoRA": whole[0], "params + grads + AdamW full": whole[1],
            "full/LoRA state": whole[1] / whole[0]}


def analytic_table() -> tuple[str, list[dict]]:
    heading = (f"Model state per rank on {RANKS} ranks (GiB), LoRA beside full fine-tuning "
               "of the same model")
    return heading, [analytic_row(path) for path in CONFIGS]


def measure(folder: Path, extra: list[str]) -> dict[str, float]:
    """Rank 0's memory breakdown (GiB) at the last step of a real run."""
    result = launch(["--job.dump_folder", str(folder), *RUN, *extra], nproc=NPROC, timeout=240)
    if result.returncode != 0:
        raise RuntimeError(f"exit {result.returncode}\n{result.stderr[-3000:]}")
    return read_metrics(folder)[-1]["memory"][0]


def measured_table(tmp: Path) -> tuple[str, list[dict]]:
    cfg = parse_args(["--model.overrides", WIDE, *LORA])[0]
    base, total, trainable = counts(cfg)
    formula = {"lora": state(total, trainable, 4, NPROC), "full": state(base, base, 4, NPROC)}
    formula["qlora"] = {**formula["lora"], "params": qlora_base(cfg, 4, NPROC)
                        + (total - base) * 4 / NPROC}
    got = {"lora": measure(tmp / "lora", LORA), "full": measure(tmp / "full", []),
           "qlora": measure(tmp / "qlora", [*LORA, "--model.converters", "qlora"])}
    heading = (f"Measured on {NPROC} CPU ranks, FSDP2, float32, debug + {WIDE} "
               f"({base / 1e6:.2f}M params; LoRA rank 8 on all block linears: "
               f"{trainable / 1e6:.3f}M trainable), rank 0 at the last step's peak (GiB)")
    rows = []
    for k in MEASURED:
        row = {"table": "measured", "category": k}
        for mode, name in (("lora", "LoRA"), ("qlora", "QLoRA"), ("full", "full")):
            ref = formula[mode].get(k)
            row[name] = got[mode][k]
            row[f"{name} formula"] = None if ref is None else ref / GIB
        row["LoRA/full"] = (got["lora"][k] / got["full"][k] if got["full"][k] >= RESOLUTION
                            else None)
        rows.append(row)
    return heading, rows


def main(argv: list[str] | None = None) -> int:
    args = bench_parser(__doc__).parse_args(argv)
    tables = [(*analytic_table(), ANALYTIC_COLUMNS), (*qlora_table(), QLORA_COLUMNS)]
    with tempfile.TemporaryDirectory() as tmp:
        tables.append((*measured_table(Path(tmp)), MEASURED_COLUMNS))
    emit_tables(tables, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
