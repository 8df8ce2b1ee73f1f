"""composer: composable parallelism for training transformer language models.

The library API for your own models: describe the model with a ``ModelSpec``
(its hooks, where it needs any, in ``ParallelHooks``, ``TrainingHooks`` and
``Adapters``), build it on the meta device, ``parallelize`` it over ``ParallelDims``'s mesh,
``materialize`` its weights, and train with ``clip_grad_norm_`` finishing the
gradients of any layout.
"""
from composer import converters  # noqa: F401 (registers float8, lora, qlora and their sections)
from composer.init import materialize
from composer.mesh import ParallelDims
from composer.models import register_model
from composer.optim import clip_grad_norm_
from composer.parallel import parallelize
from composer.spec import Adapters, ModelSpec, ParallelHooks, StateDictAdapter, TrainingHooks

__all__ = ["Adapters", "ModelSpec", "ParallelHooks", "StateDictAdapter", "TrainingHooks",
           "ParallelDims", "clip_grad_norm_", "materialize", "parallelize", "register_model"]
