"""``python -m composer.cli``: the same command line as ``python -m composer.train``."""
from composer.cli.run import cli

cli()
