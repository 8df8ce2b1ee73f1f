"""The trainer: a planned job's model, optimizers, data, observers, and its loop.

- ``trainer``: the ``Trainer``, the loop only;
- ``build``: the one place that knows the build order (meta model -> converters ->
  pipeline stages -> passes -> weights);
- ``batches``: this rank's loaders and a batch cut to its columns; ``validation``: the
  held-out loss; ``loss``: the summed cross-entropy and its reductions;
- ``objective``: what is minimised (language modelling; DPO, ``dpo``) behind one
  interface; ``optim``: optimizers, lr schedules, gradient clipping over any layout;
- ``saves``: the run's checkpoint steps, its starting weights and its exports.

Imports: torch_compat, spec, config, mesh, models, data, parallel, checkpoint,
converters, faults, inference, job, observe.
"""
