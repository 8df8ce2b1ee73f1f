"""A user's model module that fails while it is imported (tests/integration/test_config.py):
naming it in model.name is one line, exit 2, not a traceback."""
spec = 1 / 0
