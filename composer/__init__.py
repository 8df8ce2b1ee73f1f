"""composer: composable parallelism for training transformer language models.

The library API for your own models and your own loop; the trainer
(``python -m composer.train``) uses the same functions.

- Describe a model: ``ModelSpec``, its hooks where it needs any (``ParallelHooks``,
  ``TrainingHooks``, ``Adapters``), its Hugging Face layout (``StateDictAdapter``);
  ``register_model`` makes it trainable by name.
- Lay out the devices: ``ParallelDims`` (degrees -> one DeviceMesh).
- Build: ``build_converters`` (float8, LoRA, QLoRA by name, with their settings),
  ``pipeline_stages`` (this rank's pipeline stages of the meta model),
  ``parallelize`` (tensor, context and expert parallel, activation checkpointing,
  compile, FSDP2/DDP, in that order), ``materialize`` (the same weights on every
  layout).
- Train: ``build_pipeline`` (a schedule to step the stages), ``local_positions``
  (the sequence positions a context-parallel rank holds), ``clip_grad_norm_`` (the
  global gradient norm of any layout).
- Save and load: ``Checkpointer`` and ``find_resume`` (DCP steps any layout
  resumes), ``export_hf`` and ``load_hf_into`` (Hugging Face folders, through a
  spec's adapter).

``docs/public_api.md`` lists them by purpose; ``examples/`` holds loops that use
nothing else.
"""
import composer.torch_compat.quiet  # noqa: F401 (first: known third-party lines stay quiet)
from composer import converters  # noqa: F401 (registers float8, lora, qlora and their sections)
from composer.checkpoint.dcp import Checkpointer, find_resume
from composer.checkpoint.hf import export_hf, load_hf_into
from composer.converters.base import build_converters
from composer.mesh import ParallelDims
from composer.models import register_model
from composer.parallel import parallelize
from composer.parallel.context import local_positions
from composer.parallel.materialize import materialize
from composer.parallel.pipeline import build_pipeline
from composer.parallel.stages import pipeline_stages
from composer.spec import Adapters, ModelSpec, ParallelHooks, StateDictAdapter, TrainingHooks
from composer.trainer import dpo  # noqa: F401 (registers the dpo section)
from composer.trainer.optim import clip_grad_norm_

__all__ = [
    # describe a model
    "Adapters", "ModelSpec", "ParallelHooks", "StateDictAdapter", "TrainingHooks",
    "register_model",
    # lay out the devices
    "ParallelDims",
    # build
    "build_converters", "materialize", "parallelize", "pipeline_stages",
    # train
    "build_pipeline", "clip_grad_norm_", "local_positions",
    # save and load
    "Checkpointer", "export_hf", "find_resume", "load_hf_into",
]
