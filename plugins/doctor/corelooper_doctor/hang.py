"""The hang watchdog: a thread on every rank that notices when its rank stops making progress,
dumps every thread's Python stack (``faulthandler``), compares the ranks' progress through the
rendezvous store (not the stuck process group) and ends the run with one paragraph naming the
rank that is behind and where it is.

Progress is an event of the loop: the doctor's step, epoch, log, evaluation and save hooks stamp
it with the ``time.perf_counter()`` (monotonic) read the time split makes anyway (three attribute
writes, no lock, no I/O); inside a step nothing stamps, so a stuck forward, backward or optimizer
step counts from the step's start. The thread publishes it to the store every few seconds.
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from .settings import MIN_ADAPTIVE_TIMEOUT

EXIT_CODE = 6  # a training failure (corelooper.errors.TrainingError); the launcher reports 7
_KEY = "corelooper_doctor/"


def default_store():
    """The process group's rendezvous store (a TCPStore under torchrun), or None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        pass
    return None


def where(frame) -> dict:
    """The innermost Python frame of a stack, and the collective it waits in, if any."""
    inner = frame
    collective = None
    f = frame
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if collective is None and "torch/distributed/" in path and "elastic" not in path:
            collective = f.f_code.co_name
        f = f.f_back
    return {
        "function": inner.f_code.co_name,
        "file": os.path.basename(inner.f_code.co_filename),
        "line": inner.f_lineno,
        "collective": collective,
    }


class Watchdog:
    def __init__(
        self,
        output_dir: str,
        rank: int,
        world: int,
        timeout: float,
        step_factor: float,
        store=None,
        exit_fn=os._exit,
    ) -> None:
        self.dir = Path(output_dir) / "doctor"
        self.rank, self.world = rank, world
        self.timeout, self.step_factor = timeout, step_factor
        self.store = store
        self.exit_fn = exit_fn
        self.step, self.event = 0, "start"
        self.last = time.perf_counter()  # the training thread's clock (monotonic)
        self.long_phase = True  # the first step (compilation, warm-up) gets the full timeout
        self.step_times: list[float] = []
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="corelooper-doctor-watchdog", daemon=True)
        self.poll = max(0.2, min(5.0, timeout / 10))

    # -- from the training thread (cheap) -------------------------------------------------------
    def progress(self, step: int, event: str, now: float | None = None) -> None:
        """``now``: a ``time.perf_counter()`` the caller already read (one clock read per hook)."""
        self.step, self.event, self.last = step, event, time.perf_counter() if now is None else now

    def step_time(self, seconds: float) -> None:
        if len(self.step_times) < 1000:
            self.step_times.append(seconds)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    # -- the thread ------------------------------------------------------------------------------
    def effective_timeout(self) -> float:
        if self.long_phase or self.step_factor <= 0 or len(self.step_times) < 3:
            return self.timeout
        adaptive = self.step_factor * statistics.median(self.step_times)
        return min(self.timeout, max(adaptive, MIN_ADAPTIVE_TIMEOUT))

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            stalled = time.perf_counter() - self.last
            other = self._store_get("hang")
            if stalled > self.effective_timeout() or other is not None:
                self._on_hang(stalled)
                return

    def _store_get(self, key: str):
        if self.store is None:
            return None
        try:
            if not self.store.check([_KEY + key]):
                return None
            return self.store.get(_KEY + key).decode()
        except Exception:  # the store went away with its host: judge locally
            return None

    def _store_set(self, key: str, value: str) -> None:
        if self.store is not None:
            try:
                self.store.set(_KEY + key, value)
            except Exception:
                pass

    def _on_hang(self, stalled: float) -> None:
        self._store_set("hang", str(self.rank))
        self.dir.mkdir(parents=True, exist_ok=True)
        frame = sys._current_frames().get(self._main)
        me = {
            "rank": self.rank,
            "step": self.step,
            "event": self.event,
            "stalled": round(stalled, 1),
            **(where(frame) if frame is not None else {}),
        }
        with open(self.dir / f"hang-rank{self.rank}.txt", "w") as f:
            f.write(
                f"# rank {self.rank}: no progress for {stalled:.1f} s, last event {self.event} "
                f"at step {self.step}\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self._nccl_trace()
        self._store_set(f"rank/{self.rank}", json.dumps(me))
        if self.rank == 0:
            ranks = self._collect(me)
            message = paragraph(ranks, self.world, str(self.dir))
            (self.dir / "hang-report.txt").write_text(message + "\n")
            (self.dir / "hang-report.json").write_text(json.dumps(ranks, indent=1))
            print(message, file=sys.stderr, flush=True)
            self._record(message)
            self._store_set("reported", "1")
        else:
            self._wait_for("reported", 20.0)
        self.exit_fn(EXIT_CODE)

    def _collect(self, me: dict) -> list[dict]:
        ranks = {0: me}
        deadline = time.monotonic() + 15.0
        while len(ranks) < self.world and time.monotonic() < deadline:
            for r in range(1, self.world):
                if r not in ranks:
                    got = self._store_get(f"rank/{r}")
                    if got:
                        ranks[r] = json.loads(got)
            time.sleep(0.2)
        return [ranks[r] for r in sorted(ranks)]

    def _wait_for(self, key: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self._store_get(key) is None:
            time.sleep(0.2)

    def _nccl_trace(self) -> None:
        """NCCL's flight recorder (needs TORCH_NCCL_TRACE_BUFFER_SIZE > 0), when available."""
        try:
            import torch

            if not torch.cuda.is_available():
                return
            data = torch._C._distributed_c10d._dump_nccl_trace()
            (self.dir / f"hang-rank{self.rank}-nccl.pickle").write_bytes(data)
        except Exception:
            pass

    def _record(self, message: str) -> None:
        try:
            from corelooper.cli.api import record_child_error

            from corelooper.errors import TrainingError

            record_child_error(TrainingError(message), EXIT_CODE)
        except Exception:
            pass


def _place(r: dict) -> str:
    if r.get("function") is None:
        return f"after {r.get('event')}"
    return f"{r['function']} ({r['file']}:{r['line']})"


def paragraph(ranks: list[dict], world: int, folder: str) -> str:
    """ "rank 1 has been in f (x.py:3) for 62 s while rank 0 waits in all_reduce at step 3"."""
    waiting = [r for r in ranks if r.get("collective")]
    behind = [r for r in ranks if not r.get("collective")]
    if not behind:  # all in collectives: the ones at the earliest step are behind
        low = min(r["step"] for r in ranks)
        behind = [r for r in ranks if r["step"] == low]
        waiting = [r for r in ranks if r["step"] != low]
    missing = sorted(set(range(world)) - {r["rank"] for r in ranks})
    who = "; ".join(
        f"rank {r['rank']} has been in {_place(r)}"
        + (f" (waiting in {r['collective']})" if r.get("collective") else "")
        + f" for {r['stalled']:.0f} s at step {r['step']}"
        for r in behind
    )
    text = f"doctor: the run hung: {who}"
    if waiting:
        text += " while " + ", ".join(
            f"rank {r['rank']} waits in {r['collective']} at step {r['step']}" for r in waiting
        )
    if missing:
        text += f"; ranks {missing} did not answer (dead, or their watchdog could not run)"
    return (
        text + f". Every rank's Python stacks are in {folder}/hang-rank*.txt. A rank that "
        "stops in a hook or the data loader, or a collective that only some ranks call, hangs "
        "the others; [doctor] hang_timeout (and train.ddp_timeout) bound the wait."
    )
