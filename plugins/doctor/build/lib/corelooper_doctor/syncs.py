"""Host-device syncs per step, counted with torch's CUDA sync debug mode.

``torch.cuda.set_sync_debug_mode("warn")`` makes torch warn (a ``UserWarning``, "called a
synchronizing CUDA operation (Triggered internally at ...)") at every operation that makes the
host wait for the device through c10's synchronizing copies and stream syncs: ``.item()``,
``float(t)``/``bool(t)`` of a CUDA tensor, ``.cpu()``/``.tolist()`` to pageable memory,
``nonzero``, ``Stream.synchronize()``... (not ``torch.cuda.synchronize()``, events, nor
``torch.distributed``: torch does not flag those). The ``SyncCounter`` counts those warnings
instead of showing them: a filter that lets every one through (no "once per line"
de-duplication) and a ``warnings.showwarning`` that swallows only them and hands any other
warning on. The check costs nothing on operations that do not sync.

There is no device sync to count on the CPU (a "sync" there is a plain read), so the doctor
counts only on CUDA and logs nothing elsewhere; ``SyncCounter`` itself needs no GPU (the tests
emit the warning torch emits).
"""

from __future__ import annotations

import re
import warnings

#: The start of torch's warning (c10/cuda/CUDAFunctions.cpp, ``warn_or_error_on_sync``).
SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncCounter:
    """Counts torch's sync-debug warnings while installed; shows none of them."""

    def __init__(self) -> None:
        self.count = 0  # since the last take()
        self.taken = 0
        self._previous = None
        self._filter = None

    def install(self) -> None:
        warnings.filterwarnings("always", message=re.escape(SYNC_WARNING), category=UserWarning)
        self._filter = warnings.filters[0]
        self._previous = warnings.showwarning
        warnings.showwarning = self._show

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if issubclass(category, UserWarning) and str(message).startswith(SYNC_WARNING):
            self.count += 1
            return
        self._previous(message, category, filename, lineno, file, line)

    def take(self) -> int:
        """The syncs counted since the last call."""
        n, self.count = self.count, 0
        self.taken += n
        return n

    @property
    def total(self) -> int:
        return self.taken + self.count

    def uninstall(self) -> None:
        if self._previous is None:
            return
        if warnings.showwarning == self._show:  # else someone wrapped ours: leave theirs in place
            warnings.showwarning = self._previous
        if self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
            mutated = getattr(warnings, "_filters_mutated", None)  # drops the filters' cache
            if mutated is not None:
                mutated()
        self._previous = self._filter = None


def enable_sync_debug_mode(device) -> bool:
    """Turn torch's sync debug mode to "warn" on a CUDA device; False where there is nothing
    to count (not CUDA) or the user already chose a mode of their own (theirs is kept)."""
    if getattr(device, "type", None) != "cuda":
        return False
    import torch

    if torch.cuda.get_sync_debug_mode() != 0:
        return False
    torch.cuda.set_sync_debug_mode("warn")
    return True


def disable_sync_debug_mode() -> None:
    import torch

    torch.cuda.set_sync_debug_mode("default")


def start_counting(device) -> SyncCounter | None:
    """A counter when syncs can be counted on ``device`` (CUDA), else None."""
    if not enable_sync_debug_mode(device):
        return None
    counter = SyncCounter()
    counter.install()
    return counter


def stop_counting(counter: SyncCounter | None) -> None:
    if counter is None:
        return
    counter.uninstall()
    disable_sync_debug_mode()
