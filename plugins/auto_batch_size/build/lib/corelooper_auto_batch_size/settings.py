"""The plugin's config section and defaults (no torch: read by `corelooper --help` and `plugins`)."""

SECTION = "auto_batch_size"
DEFAULTS = {
    "probe": False,
    "min_micro_batch_size": 1,
    "eval": True,
}
