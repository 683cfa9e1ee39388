"""``srun corelooper run CONFIG`` inside an allocation: one distributed run of all the step's tasks.

Each task of an ``srun`` step is one rank, as under Lightning's ``SLURMEnvironment``: Slurm's
variables give torch's launcher environment (what torchrun would set), so the core's backend
forms one process group of ``SLURM_STEP_NUM_TASKS`` ranks instead of N separate 1-process runs
that the run lock refuses after the first.

=====================  ============================================================
torch's variable       from Slurm
=====================  ============================================================
``RANK``               ``SLURM_PROCID``
``LOCAL_RANK``         ``SLURM_LOCALID``
``WORLD_SIZE``         ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``)
``GROUP_RANK``         ``SLURM_NODEID``
``MASTER_ADDR``        the first node of ``SLURM_STEP_NODELIST`` (task 0 runs there)
``MASTER_PORT``        ``MASTER_PORT`` when set, else 15000 + (job id % 1000) * 10 + step id % 10
=====================  ============================================================

Only in a step of several tasks (``SLURM_STEP_ID`` set: not the batch script itself) and only
when no launcher set ``RANK`` / ``WORLD_SIZE`` already (the ranks torchrun starts inside
``corelooper slurm``'s job keep torchrun's).
"""

from __future__ import annotations

import os
import re

FROM_SLURM = {"RANK": "SLURM_PROCID", "LOCAL_RANK": "SLURM_LOCALID", "GROUP_RANK": "SLURM_NODEID"}


def first_node(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu017`` from ``gpu[017-020,031],cpu1`` (as
    ``scontrol show hostnames`` would list it first; zero padding kept)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return nodelist
    name, ranges = match.groups()
    return name + re.split(r"[-,]", ranges)[0] if ranges else name


def srun_environment(env: os._Environ | dict[str, str]) -> dict[str, str]:
    """torch's launcher variables for this srun task, or ``{}`` when not in a step of several tasks
    (or a launcher already set them)."""
    if "RANK" in env or "WORLD_SIZE" in env or "SLURM_STEP_ID" not in env:
        return {}
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    if not tasks.isdigit() or int(tasks) < 2 or any(v not in env for v in FROM_SLURM.values()):
        return {}
    job, step = env.get("SLURM_JOB_ID", "0"), env.get("SLURM_STEP_ID", "0")
    port = 15000 + (int(job) % 1000) * 10 + int(step) % 10 if job.isdigit() and step.isdigit() else 29500
    out = {name: env[slurm] for name, slurm in FROM_SLURM.items()}
    out.update(
        WORLD_SIZE=tasks,
        MASTER_ADDR=first_node(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "localhost")),
        MASTER_PORT=env.get("MASTER_PORT") or str(port),
    )
    return out


def adopt_srun_environment() -> dict[str, str]:
    """Set torch's launcher variables from Slurm's in this process (see the module); returns them."""
    found = srun_environment(os.environ)
    os.environ.update(found)
    return found
