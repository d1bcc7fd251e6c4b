"""Process-wide hooks installed while something watches them, removed once the last watcher is
collected. What it does not hold: what the hooks do (``slice_entries.py``'s registration counter,
the Hugging Face cut's tables in ``offload/integrations/``).

Compiled autograd (torch 2.13) cannot trace a global module-registration hook, of any model: a
process that keeps one installed after its OffloadModels are gone cannot compile another model's
backward that way (docs/api.md, torch.compile). So every such hook the library installs lives only
as long as what needs it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.hooks import RemovableHandle


class WatchedHooks:
    """``hook`` registered with each of ``registers`` while a watcher lives."""

    def __init__(self, *registers: Callable[[Callable[..., Any]], RemovableHandle]) -> None:
        self._registers: Sequence[Callable[[Callable[..., Any]], RemovableHandle]] = registers
        self._handles: list[RemovableHandle] = []  # the installed hooks; empty while nothing watches
        self._watchers = 0  # watch() calls whose watcher lives
        # Reentrant: a collection inside watch() may run a watcher's finalizer on this thread.
        self._lock = threading.RLock()

    def watch(self, watcher: object, hook: Callable[..., Any]) -> None:
        """Install ``hook`` unless installed, until ``watcher`` and every other one is collected."""
        with self._lock:
            self._watchers += 1  # before installing: a finalizer run in between must not remove them
            if not self._handles:
                self._handles = [register(hook) for register in self._registers]
        weakref.finalize(watcher, self._unwatch)

    def _unwatch(self) -> None:
        with self._lock:
            self._watchers -= 1
            if self._watchers == 0:
                for handle in self._handles:
                    handle.remove()
                self._handles = []
