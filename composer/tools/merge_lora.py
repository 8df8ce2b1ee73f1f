"""Fold a LoRA (or QLoRA) run's adapters into its base and write Hugging Face safetensors,
or (``--peft``) write the adapters themselves as a PEFT folder.

    composer-merge-lora --config CONFIG --adapters CHECKPOINT_STEP --out OUT_DIR
        [--dtype bfloat16] [--peft] [--section.key VALUE ...]

CONFIG (and its overrides) is the fine-tuning run's: it names the model, the
LoRA settings and the base (``checkpoint.initial_load_path``, a Hugging Face
folder or a DCP step; none: the seeded initial weights, as the run had).
CHECKPOINT_STEP is one of the run's adapter-only steps (``.../checkpoint/step-N``).
Each merged weight is W + alpha/rank * B A; for a QLoRA run W is what NF4 gives
back of the base weight (the weight its adapters were trained with). One process, CPU, the
whole model in memory; a run can instead merge in place at its end (``lora.merge_on_export``).
``--peft`` converts the step as ``lora.export = "peft"`` exports a run's last one: PEFT's
``adapter_config.json`` and ``adapter_model.safetensors`` with the tokenizer's files (the
base is not read).
Bad input exits with status 2 and one ``error:`` line.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from composer.checkpoint.dcp import Checkpointer, check_shapes, problem
from composer.checkpoint.hf import adapter_of, export_hf, load_hf_into
from composer.checkpoint.peft import export_peft
from composer.config import ConfigError, parse_args
from composer.converters.lora import convert_lora, init_with_adapters, is_adapter, merged_tensors
from composer.converters.qlora import round_trip
from composer.data import build_tokenizer
from composer.data.tokenizer import export_files
from composer.job.plan import DTYPES, resolve_model
from composer.parallel.materialize import materialize
from composer.trainer.build import default_dtype


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", required=True)
    parser.add_argument("--adapters", required=True, help="an adapter-only checkpoint step")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--peft", action="store_true",
                        help="write the adapters as a PEFT folder instead of merging them")
    return parser


def _build(cfg, spec, args) -> torch.nn.Module:
    """The run's model with adapters, weights as the run started them."""
    def meta():
        with default_dtype(DTYPES[cfg.training.dtype]):
            model = spec.build_meta(args)
        convert_lora(model, cfg.lora, spec.adapters.lora_targets)
        return model
    model = meta()
    materialize(model, meta, torch.device("cpu"), cfg.job.seed, init=init_with_adapters)
    return model


def merge(argv: list[str]) -> None:
    known, overrides = _parser().parse_known_args(argv)
    cfg, _ = parse_args(["--config", known.config, *overrides])
    if not {"lora", "qlora"} & set(cfg.model.converters):
        raise ConfigError(f"--config {known.config}: model.converters has no 'lora' or 'qlora'")
    reason = problem(Path(known.adapters)) if Path(known.adapters).is_dir() else "no such folder"
    if reason:
        raise ConfigError(f"--adapters {known.adapters}: not a complete checkpoint step ({reason})")
    spec, args = resolve_model(cfg)
    model = _build(cfg, spec, args)
    checkpoints = Checkpointer(Path(known.adapters).parent, [model], [], None, 0, False)
    base = cfg.checkpoint.initial_load_path
    if known.peft:
        to_peft(cfg, spec, args, model, checkpoints, known)
        return
    if base and (Path(base) / "config.json").is_file():
        load_hf_into(model, base, adapter_of(spec, args), skip=is_adapter)
    elif base:
        check_shapes(Path(base), model, "the base", lambda k: not is_adapter(k))
        checkpoints.load(Path(base), {}, model_only=True, keys=lambda k: not is_adapter(k))
    if "qlora" in cfg.model.converters:
        round_trip(model, spec, cfg.lora.quantize_output)
    label = f"{cfg.model.name}/{cfg.model.flavor} with LoRA rank {cfg.lora.rank}"
    check_shapes(Path(known.adapters), model, label, is_adapter)
    checkpoints.load(Path(known.adapters), {}, model_only=True, keys=is_adapter)
    export_hf(model, known.out, spec, args, DTYPES[known.dtype], tensors=merged_tensors(model))
    print(f"merged {known.adapters} into {base or 'the seeded base'}: {known.out}")


def to_peft(cfg, spec, args, model, checkpoints, known) -> None:
    """The step's adapters as a PEFT folder (the base weights are not needed)."""
    check_shapes(Path(known.adapters), model, "the adapters", is_adapter)
    checkpoints.load(Path(known.adapters), {}, model_only=True, keys=is_adapter)
    base = cfg.checkpoint.initial_load_path or cfg.model.hf_path
    with tempfile.TemporaryDirectory() as scratch:
        files = export_files(build_tokenizer(cfg.data.tokenizer), Path(scratch))
        export_peft([model], Path(known.out), adapter_of(spec, args), cfg.lora, base,
                    DTYPES[known.dtype], write=True, files=files)
    print(f"wrote the adapters of {known.adapters} as a PEFT folder: {known.out}")


def main(argv: list[str] | None = None) -> int:
    try:
        merge(sys.argv[1:] if argv is None else argv)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
