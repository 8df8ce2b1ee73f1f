"""Every command a user runs besides training and planning: ``composer-generate``,
``composer-eval``, ``composer-convert-hf``, ``composer-merge-lora``, ``composer-tiny-hf``,
and ``python -m composer.tools.<name>`` (tokenize, inspect_data, dry_run,
pipeline_report, reference_pages). They read the library; the training loop never
imports them, except the dry run, which ``composer-train --dry-run`` runs.

Imports: torch_compat, spec, config, mesh, models, data, parallel, checkpoint,
converters, faults, inference, job, observe, trainer, planner.
"""
