"""What the test suite and the benchmarks share, installed with the package as
``torch.testing`` is: ``harness`` (real launches with a hard timeout, many training jobs
in one launch), ``jobs`` (the launch's job runner), ``parity`` (the parity matrix's
layouts and their one-process references) and ``report`` (a benchmark's table and JSON).

Imports: torch_compat, spec, config, mesh, models, data, parallel, checkpoint,
converters, faults, inference, job, observe, trainer, planner, tools, cli.
"""
