"""``python -m composer.train``: the trainer's command line (``composer.cli.run``), under
torchrun or as one process. The Trainer itself is ``composer.trainer``."""
from composer.cli.run import cli

if __name__ == "__main__":
    cli()
