"""corelooper-auto-batch-size: find the largest micro-batch that fits, without changing training.

Turned on per run with ``auto_find_batch_size = true`` in ``[train]`` (the Hugging Face name);
options in ``[auto_batch_size]``. Installed but not turned on, it registers nothing that runs
during training. See README.md.
"""

from __future__ import annotations

from corelooper.errors import ConfigError

from .settings import DEFAULTS, SECTION

__all__ = ["RUN_PLUGIN_NAME"]
__version__ = "0.2.0"

#: Name under which the per-run part is registered (and saved in a checkpoint's plugins.json).
RUN_PLUGIN_NAME = "auto_batch_size.run"


def corelooper_config_sections():
    return {SECTION: dict(DEFAULTS)}


def corelooper_settings():
    """``auto_find_batch_size = true`` asks for this plugin: refused when it is not loaded."""
    return {"train": {"auto_find_batch_size": lambda value, train: {} if value else None}}


def corelooper_configure(config, plugins) -> None:
    if not getattr(config.train, "auto_find_batch_size", False):
        if SECTION in config.sections:
            raise ConfigError(
                f"The config has an [{SECTION}] section, but train.auto_find_batch_size is false, "
                "so the plugin would do nothing: set train.auto_find_batch_size = true to turn it "
                f"on, or remove the [{SECTION}] section."
            )
        plugins.set_inactive(SECTION, "train.auto_find_batch_size = false")
        return
    from .controller import AutoBatchSize  # imports torch: only when turned on

    controller = AutoBatchSize(config.section(SECTION), config.train)
    plugins.register(controller, RUN_PLUGIN_NAME)
    plugins.register_for_checkpointing(SECTION, controller)
