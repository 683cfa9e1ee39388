"""corelooper-elastic-resume: resume a run saved on N processes on M processes, sample-exactly
(``corelooper_elastic_resume.geometry`` says how).

Two providers of the core's resume contract:

* ``resume_config`` (``Loop.__init__``, before any plugin is configured): the config with the batch
  geometry that keeps the checkpoint's global batch on this world size (one line says so), or
  a refusal naming the process counts that work;
* ``resume_position`` (while the checkpoint loads): the saved position in the epoch, rewritten
  as this run's micro-batches: no sample repeated, none skipped.

Without this plugin the core resumes on the world size a checkpoint was saved on and refuses
another one (exit 5). A stream (``IterableDataset``) read by corelooper-streaming resumes on
another world size when it is read globally (``train.stream_split``).
"""

from __future__ import annotations

from corelooper import hookimpl

from .geometry import adapt, settle

__version__ = "0.2.0"


@hookimpl
def resume_config(config, plugins, directory, world_size, dataset, announce):
    return settle(config, plugins, directory, world_size, dataset, announce)


@hookimpl
def resume_position(loop, state, directory):
    return adapt(loop, state, str(directory))
