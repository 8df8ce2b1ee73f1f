"""The job configuration: defaults <- TOML file <- command-line overrides.

``schema`` holds the sections (the built-in dataclasses, the field helpers, the
registry components add their own sections to); ``parse`` reads a TOML file and
a command line into a validated ``JobConfig`` and writes one back as TOML. The
names below are the ones the rest of composer, and a plugin, import from here.

Imports: spec.
"""
from composer.config.parse import (
    config_from,
    import_plugins,
    load_toml,
    parse_args,
    set_value,
    to_toml,
    tomllib,
)
from composer.config.schema import (
    DTYPES,
    PIPELINE_SCHEDULES,
    SECTIONS,
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    ConfigError,
    Data,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Recovery,
    Training,
    Validation,
    bounded,
    choice,
    listed,
    register_section,
    sections,
)

__all__ = ["DTYPES", "PIPELINE_SCHEDULES", "SECTIONS", "ActivationCheckpoint", "Checkpoint",
           "Compile", "ConfigError", "Data", "Job", "JobConfig", "LRScheduler", "Metrics", "Model",
           "Optimizer", "Parallelism", "Profiling", "Recovery", "Training", "Validation", "bounded",
           "choice", "config_from", "import_plugins", "listed", "load_toml", "parse_args",
           "register_section", "sections", "set_value", "to_toml", "tomllib"]
