"""composer: composable parallelism for training transformer language models.

The library API for your own models: describe the model with a ``ModelSpec``,
build it on the meta device, ``parallelize`` it over ``ParallelDims``'s mesh,
``materialize`` its weights, and train with ``clip_grad_norm_`` finishing the
gradients of any layout.
"""
from composer.init import materialize
from composer.mesh import ParallelDims
from composer.optim import clip_grad_norm_
from composer.parallel import parallelize
from composer.spec import ModelSpec

__all__ = ["ModelSpec", "ParallelDims", "clip_grad_norm_", "materialize", "parallelize"]
