"""The package list, found rather than written out, so a new subpackage is never left out.

pyproject.toml cannot express it: ``[tool.setuptools.packages.find]`` names what it finds
after the folder it finds it in, and ``models/`` must install as ``composer.models``
(``package-dir`` in pyproject.toml maps the folder). ``train_configs/`` holds no module:
it is listed by name, and installs as the data folder ``composer/train_configs/``.
Everything else is in pyproject.toml.
"""
from setuptools import find_packages, setup

MODELS = ["composer.models" + name[len("models"):]
          for name in find_packages(include=["models", "models.*"])]

setup(packages=find_packages(include=["composer", "composer.*"]) + MODELS
      + ["composer.train_configs"])
