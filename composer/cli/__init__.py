"""The command line: ``run_argv`` (arguments -> plan -> process groups -> Trainer -> exit
status), the ``composer-train`` console script, its ``--nproc`` launcher and ``--help``.

Imports: torch_compat, spec, config, mesh, models, data, parallel, checkpoint, converters,
faults, job, inference, observe, trainer, planner, tools.
"""
from composer.cli.run import cli, run_argv

__all__ = ["cli", "run_argv"]
