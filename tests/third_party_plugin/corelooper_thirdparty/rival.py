"""Plugin ``thirdparty_rival``: provides the same hook as ``thirdparty`` (create_optimizer)."""

from __future__ import annotations


def corelooper_config_sections():
    return {"thirdparty_rival": {"optimizer": ""}}


def create_optimizer(loop, model):
    if loop.config.section("thirdparty_rival")["optimizer"] != "adagrad":
        return None
    import torch

    return torch.optim.Adagrad(model.parameters(), lr=loop.args.learning_rate)
