"""Developer tools run from the command line (``python -m composer.tools.<name>``):
they read the library, the training loop never imports them."""
