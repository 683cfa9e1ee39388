"""Errors users see: one paragraph naming what is wrong and how to fix it."""

from __future__ import annotations


class CorelooperError(Exception):
    """Base of every error corelooper reports to users without a traceback."""

    exit_code = 2


class ConfigError(CorelooperError):
    """A config file, key or value is wrong."""


class PluginError(CorelooperError):
    """A plugin failed to load, or raised inside one of its hooks."""

    exit_code = 3


class DataError(CorelooperError):
    """A dataset, sample or collator produced something the loop cannot use."""

    exit_code = 4


class CheckpointError(CorelooperError):
    """A checkpoint is missing, incomplete, or does not match the model."""

    exit_code = 5


class TrainingError(CorelooperError):
    """The model or the training step itself failed."""

    exit_code = 6
