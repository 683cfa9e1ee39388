"""The digits example's metric, as a local plugin (``[plugins] local`` in config.toml)."""

from corelooper import hookimpl

from .data import accuracy


@hookimpl
def compute_metrics(predictions, label_ids):
    return accuracy(predictions, label_ids)
