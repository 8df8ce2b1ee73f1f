"""Convert a model family's weights (any with a Hugging Face adapter) between our DCP
checkpoints and Hugging Face folders.

    composer-convert-hf to-hf CHECKPOINT_DIR OUT_DIR --flavor 8B
        [--dtype bfloat16] [--model llama3]
    composer-convert-hf from-hf HF_DIR OUT_DIR [--flavor 8B]
        [--dtype float32] [--model qwen3]

``--model`` is what ``model.name`` takes: a registered family, or your own spec as
``package.module:attribute`` (its module is imported, so its code runs).

A checkpoint holds the model under the key "model" (as the trainer saves it);
the written one holds only that. One process, CPU, no process group. to-hf
keeps the checkpoint's dtype until the final cast; from-hf takes its shapes
from config.json unless a flavor is given, and its dtype from config.json
unless --dtype is. Bad input exits with status 2 and one ``error:`` line.

The whole model is held in CPU memory (to-hf: in the checkpoint's dtype).
For a model that does not fit, a training run can read Hugging Face weights
straight into its sharded model (``composer.checkpoint.hf.load_hf_into``) and write them
shard by shard (``composer.checkpoint.hf.export_hf``).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from composer.checkpoint.hf import (
    adapter_of,
    export_hf,
    hf_names,
    load_hf_into,
    open_hf,
    writing_folder,
)
from composer.models import MODELS, get_model_spec
from composer.parallel.tied import tied_groups
from composer.spec import ModelSpec

WITH_HF = sorted(name for name, spec in MODELS.items() if spec.adapters.hf_adapter is not None)

MODEL_KEY = "model"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    to_hf = commands.add_parser("to-hf", help="DCP checkpoint -> Hugging Face folder")
    to_hf.add_argument("checkpoint")
    to_hf.add_argument("out")
    to_hf.add_argument("--flavor", required=True)
    to_hf.add_argument("--dtype", default="bfloat16")
    to_hf.add_argument("--max-shard-gib", type=float, default=5.0)
    from_hf = commands.add_parser("from-hf", help="Hugging Face folder -> DCP checkpoint")
    from_hf.add_argument("hf")
    from_hf.add_argument("out")
    from_hf.add_argument("--flavor")
    from_hf.add_argument("--dtype")
    for command in (to_hf, from_hf):
        command.add_argument("--model", default="llama3",
                             help=f"{', '.join(WITH_HF)}, or package.module:attribute")
    return parser


def hf_spec(name: str) -> ModelSpec:
    """The model ``--model`` names, with a Hugging Face adapter."""
    try:
        spec = get_model_spec(name)
    except (KeyError, ImportError) as e:
        raise ValueError(f"--model {name}: {e.args[0] if e.args else e}") from None
    if spec.adapters.hf_adapter is None:
        raise ValueError(f"--model {name}: it has no Hugging Face adapter "
                         f"(ModelSpec.adapters.hf_adapter); with one: {', '.join(WITH_HF)}")
    return spec


def _flavor(spec: ModelSpec, name: str):
    if name not in spec.flavors:
        raise ValueError(f"unknown flavor {name!r} for {spec.name}; "
                         f"known: {', '.join(spec.flavors)}")
    return spec.flavors[name]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}; use e.g. bfloat16, float32, float64")
    return dtype


def _cpu_model(spec: ModelSpec, args, dtype: torch.dtype) -> nn.Module:
    """Uninitialised weights on the CPU (they are all about to be overwritten)."""
    return spec.build_meta(args).to(dtype).to_empty(device="cpu")


def _checkpoint_dtype(checkpoint: Path, model: nn.Module) -> torch.dtype:
    """Check the checkpoint has every tensor of ``model`` at its shape; return
    the stored dtype, so that loading does not round."""
    if not (checkpoint / ".metadata").exists():
        raise ValueError(f"{checkpoint} is not a DCP checkpoint (no .metadata)")
    stored = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    dtypes = set()
    for name, tensor in model.state_dict().items():
        entry = stored.get(f"{MODEL_KEY}.{name}")
        if entry is None:
            raise ValueError(f"{checkpoint} has no {MODEL_KEY}.{name}")
        if tuple(entry.size) != tuple(tensor.shape):
            raise ValueError(f"{name}: the flavor has shape {tuple(tensor.shape)}, "
                             f"{checkpoint} has {tuple(entry.size)}")
        dtypes.add(entry.properties.dtype)
    return max(dtypes, key=lambda d: d.itemsize)


def to_hf_command(ns: argparse.Namespace) -> None:
    spec = hf_spec(ns.model)
    args, checkpoint = _flavor(spec, ns.flavor), Path(ns.checkpoint)
    dtype = _dtype(ns.dtype)
    model = _cpu_model(spec, args, _checkpoint_dtype(checkpoint, spec.build_meta(args)))
    dcp.load({MODEL_KEY: model.state_dict()}, checkpoint_id=checkpoint)
    export_hf(model, ns.out, spec, args, dtype, max_shard_bytes=int(ns.max_shard_gib * 2**30))


def _check_all_used(folder: str, model: nn.Module, adapter, tied: bool) -> None:
    """A flavor with fewer layers would otherwise silently drop some."""
    used = {key for name in model.state_dict() for key in adapter.hf_keys(name)}
    if tied:  # transformers may store a tied head under its own name
        used.add("lm_head.weight")
    unused = sorted(set(hf_names(folder)) - used)
    if unused:
        raise ValueError(f"{len(unused)} tensors of {folder} have no place in the model, "
                         f"e.g. {unused[0]}")


def from_hf_command(ns: argparse.Namespace) -> None:
    spec = hf_spec(ns.model)
    config, _ = open_hf(ns.hf)
    adapter = spec.adapters.hf_adapter
    args = _flavor(spec, ns.flavor) if ns.flavor else adapter.args_from_config(config)
    dtype = _dtype(ns.dtype or config.get("dtype") or config.get("torch_dtype") or "float32")
    model = _cpu_model(spec, args, dtype)
    adapter = adapter_of(spec, args)
    _check_all_used(ns.hf, model, adapter, tied=bool(tied_groups(spec.build_meta(args))))
    load_hf_into(model, ns.hf, adapter)
    with writing_folder(ns.out) as tmp:
        dcp.save({MODEL_KEY: model.state_dict()}, checkpoint_id=tmp)


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    command = to_hf_command if ns.command == "to-hf" else from_hf_command
    try:
        command(ns)
    except KeyError as error:  # a config.json without a required entry
        print(f"error: config.json has no {error}", file=sys.stderr)
        return 2
    except (ValueError, OSError, SafetensorError, CheckpointException) as error:
        # a CheckpointException carries the failing rank's traceback: its last line says why
        lines = str(error).strip().splitlines() or [repr(error)]
        print(f"error: {lines[-1]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
