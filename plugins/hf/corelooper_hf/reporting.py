"""``train.report_to`` for every Hugging Face integration, and ``[hf] callbacks``: HF's own
``TrainerCallback``s in a ``corelooper run``, through one ``CallbackBridge`` per run.

* ``train.report_to = ["mlflow"]`` (or any name of ``INTEGRATIONS``: comet_ml, neptune, clearml,
  dvclive, trackio, swanlab, codecarbon, azure_ml, dagshub, flyte, kubeflow): HF's integration
  callback (``transformers.integrations.INTEGRATION_TO_CALLBACK``) runs as in HF's ``Trainer``,
  set up by its own environment variables (``MLFLOW_TRACKING_URI``, ``HF_DVCLIVE_LOG_MODEL``, ...).
  "tensorboard" and "wandb" stay corelooper-tensorboard's and corelooper-wandb's. ``"all"``
  (corelooper's default) loads corelooper's logger plugins: an HF integration runs only when
  ``report_to`` names it (HF 5's own default is ``"none"``).
* ``[hf] callbacks = ["mypkg.cb:MyCallback", { ref = "transformers:EarlyStoppingCallback", args =
  { early_stopping_patience = 2 } }]``: ``TrainerCallback`` classes (made with ``args``) or instances,
  named in the config, after the integrations (HF's order).

The callbacks get HF's ``(args, state, control, **kwargs)``. ``args`` is a ``TrainingArguments``
made from the run's ``[train]`` values that HF knows (``corelooper_hf.callbacks.training_arguments``;
``report_to=[]``),
which sets up no device and no process group: those stay corelooper's. One process reports:
corelooper fires ``on_log`` on rank 0 only, and HF's callbacks check ``state.is_world_process_zero``.

This module is also the entry point ``hf_integrations``: it declares the ``report_to`` names
(``corelooper_settings``), so the core accepts them and loads it only when ``train.report_to``
names one (or is "all"). The plugin ``hf`` (``corelooper_hf``, always loaded: ``[hf] callbacks``
need no ``report_to``) builds the bridge (``configure``). Reading the names imports nothing: the
table is static (``tests/test_report_to.py`` checks it against the installed transformers).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from corelooper.errors import ConfigError, PluginError

ENTRY_POINT = "hf_integrations"
SECTION = "hf"
BRIDGE = "hf.callbacks"  # the per-run bridge's name (``-p no:hf`` blocks it with the plugin)

# report_to name -> (HF's callback class, the modules it imports, what `pip install` brings them)
INTEGRATIONS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "azure_ml": ("AzureMLCallback", ("azureml.core.run",), "azureml-sdk"),
    "clearml": ("ClearMLCallback", ("clearml",), "clearml"),
    "codecarbon": ("CodeCarbonCallback", ("codecarbon",), "codecarbon"),
    "comet_ml": ("CometCallback", ("comet_ml",), "comet-ml"),
    "dagshub": ("DagsHubCallback", ("dagshub", "mlflow"), "dagshub mlflow"),
    "dvclive": ("DVCLiveCallback", ("dvclive",), "dvclive"),
    "flyte": ("FlyteCallback", ("flytekit",), "flytekit"),
    "kubeflow": ("KubeflowCallback", (), ""),  # no library: the TrainJob's controller sets its variables
    "mlflow": ("MLflowCallback", ("mlflow",), "mlflow"),
    "neptune": ("NeptuneCallback", ("neptune",), "neptune"),
    "swanlab": ("SwanLabCallback", ("swanlab",), "swanlab"),
    "trackio": ("TrackioCallback", ("trackio",), "trackio"),
}
# HF's integration names that a corelooper plugin answers itself (it declares them).
OWNED_BY_PLUGINS = {"tensorboard": "corelooper-tensorboard", "wandb": "corelooper-wandb"}
REPORT_TO = sorted(INTEGRATIONS)


def corelooper_settings() -> dict[str, Any]:
    """The ``report_to`` names HF's integration callbacks answer (read before any import)."""
    return {"report_to": list(REPORT_TO)}


def wanted_integrations(train) -> list[str]:
    """The HF integrations ``train.report_to`` names, in its order ("all" names none of them)."""
    names = [train.report_to] if isinstance(train.report_to, str) else list(train.report_to)
    return [] if "none" in names else [n for n in dict.fromkeys(names) if n in INTEGRATIONS]


def configure(config, plugins) -> None:
    """The run's bridge: the integrations ``report_to`` names (when ``hf_integrations`` is loaded
    for this run) and the ``[hf] callbacks``; nothing when there are neither."""
    mine = sys.modules[__name__]
    loaded = next((name for name, info in plugins.info.items() if info.plugin is mine), None)
    names = wanted_integrations(config.train) if loaded else []
    if loaded and not names:
        plugins.set_inactive(
            loaded,
            'train.report_to names no Hugging Face integration ("all" loads corelooper\'s loggers; '
            'name one, e.g. report_to = ["mlflow"])',
        )
    refs = list(config.section(SECTION).get("callbacks") or [])
    if not names and not refs:
        return
    from .callbacks import ReportingBridge, make_handler, training_arguments

    callbacks = [integration_callback(name) for name in names] + user_callbacks(refs, config)
    plugins.register(ReportingBridge(training_arguments(config), make_handler(callbacks)), BRIDGE)


# -- HF's integration callbacks ----------------------------------------------------------------


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def missing_library_message(name: str) -> str | None:
    """The one paragraph for a ``report_to`` name whose library is not installed (None: it is)."""
    callback, modules, pip = INTEGRATIONS[name]
    missing = [m for m in modules if not _importable(m)]
    if not missing:
        return None
    return (
        f'train.report_to names "{name}": Hugging Face\'s {callback} reports it (run by corelooper-hf), '
        f"and it needs {' and '.join(missing)}, which is not installed in this environment "
        f'({sys.executable}). Install it with `pip install {pip}`, or remove "{name}" from train.report_to.'
    )


def integration_callback(name: str):
    """HF's callback for the ``report_to`` name, made as HF's ``Trainer`` makes it; a missing
    library or a refused set-up is a ``ConfigError`` (one paragraph), never a traceback."""
    message = missing_library_message(name)
    if message:
        raise ConfigError(message)
    import transformers
    from transformers.integrations import INTEGRATION_TO_CALLBACK

    cls = INTEGRATION_TO_CALLBACK.get(name)
    if cls is None:
        raise ConfigError(
            f'train.report_to names "{name}", which transformers {transformers.__version__} has no '
            f"integration for (it has {', '.join(sorted(INTEGRATION_TO_CALLBACK))}): upgrade transformers, "
            f'or remove "{name}" from train.report_to.'
        )
    try:
        return cls()
    except (RuntimeError, ImportError, ValueError) as e:  # HF's own check of what it needs
        disabled = f" ({var} is set)" if (var := f"DISABLE_{name.upper()}_INTEGRATION") in os.environ else ""
        raise ConfigError(
            f'train.report_to names "{name}", and Hugging Face\'s {cls.__name__} cannot start here{disabled}: '
            f'{e} Set it up as it asks, or remove "{name}" from train.report_to.'
        ) from None
    except Exception as e:
        raise PluginError(
            f'Hugging Face\'s {cls.__name__} (train.report_to "{name}", run by corelooper-hf) failed to '
            f'start: {type(e).__name__}: {e}. Remove "{name}" from train.report_to to run without it.'
        ) from e


# -- [hf] callbacks ------------------------------------------------------------------------------


def user_callbacks(refs: list, config) -> list:
    """``[hf] callbacks``: each a ``"module:Class"`` (or ``"module:instance"``) or a table
    ``{ ref = "module:Class", args = { ... } }``; imported as ``[model] factory`` is (the current
    folder and the config's folder are importable)."""
    from transformers import TrainerCallback

    from corelooper.config import import_object

    base = config.source.parent if config.source else None
    out = []
    for i, item in enumerate(refs):
        key = f"hf.callbacks[{i}]"
        ref, args = _ref_and_args(key, item)
        obj = import_object(ref, key, base)
        if isinstance(obj, type) and issubclass(obj, TrainerCallback):
            try:
                out.append(obj(**args))
            except Exception as e:
                shown = f"**{args}" if args else ""
                raise ConfigError(f"{key}: {obj.__name__}({shown}) failed: {type(e).__name__}: {e}") from None
        elif isinstance(obj, TrainerCallback) and not args:
            out.append(obj)
        elif isinstance(obj, TrainerCallback):
            raise ConfigError(f"{key}: {ref!r} is a callback object already; args apply to a class.")
        else:
            raise ConfigError(
                f"{key} = {ref!r} is {obj!r}, not a transformers.TrainerCallback (a subclass, or an instance)."
            )
    return out


def _ref_and_args(key: str, item: Any) -> tuple[str, dict]:
    if isinstance(item, str):
        return item, {}
    if isinstance(item, dict) and isinstance(item.get("ref"), str) and set(item) <= {"ref", "args"}:
        args = item.get("args", {})
        if isinstance(args, dict):
            return item["ref"], dict(args)
    raise ConfigError(
        f'{key} = {item!r}: expected "module:Class" or a table {{ ref = "module:Class", args = {{ ... }} }} '
        "(args: the class's keyword arguments)."
    )
