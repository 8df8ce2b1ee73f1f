"""The job: everything decided and checked before the first process group.

``plan.plan_job`` turns a ``JobConfig`` into a ``Plan`` (the model's spec and
arguments, the degrees, converters, pipeline stages, accumulation steps, checkpoint to
resume), or raises ``ConfigError`` naming the key. It calls the checks in one order:
the sections in use and the folders (``preflight``), the model's arguments, the
converters' and every registered component's own checks of the layout, each pass's
check of its degree (``composer.parallel``), the data against the model (``data``),
Hugging Face import and export, the checkpoint to resume, the steps and the dump folder.
``groups`` then makes the job's process groups.

Imports: torch_compat, spec, config, mesh, models, data, parallel, checkpoint,
converters, faults.
"""
