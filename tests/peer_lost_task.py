"""Two gloo processes: rank 1 leaves mid-run, rank 0's all-reduce inside a plugin's hook fails.
Rank 0 prints the class and the message of what ``explain_failure`` made of it (test_exit_contract)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from corelooper.errors import explain_failure
from corelooper.plugins import Plugins


class Waiting:  # a plugin whose hook waits on the other process, as the builtin preemption does
    def on_step_end(self) -> None:
        dist.all_reduce(torch.ones(1))


def main() -> None:
    rank = int(sys.argv[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    plugin = Waiting()
    plugin.on_step_end()  # both there: the group works
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed rank
    plugins = Plugins()
    plugins.register(plugin, "waiting")
    try:
        for _ in range(3):
            plugin.on_step_end()
    except Exception as e:  # noqa: BLE001 - what the loop would catch
        made = explain_failure(e, plugins, 7, "/tmp/out")
        print(type(made).__name__, getattr(made, "exit_code", None), made, flush=True)
        os._exit(0)
    print("no failure", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
