"""python -m composer.planner: see composer/planner/cli.py."""
from composer.planner.cli import cli

cli()
