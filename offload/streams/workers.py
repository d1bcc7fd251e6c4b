"""Host workers: a thread that runs host-side work (an optimizer's update) in order, off the
calling thread, with events that say when it is done.

A worker is to the host what a stream is to the device: work submitted to it runs in submission
order, concurrently with the caller, and :meth:`HostWorker.record` gives an event that completes
once everything submitted so far has run. The copy engine waits on those events like on any other
(``CopyStreams.wait_host``), and the stream-ordering checker simulates workers the way it simulates
streams, so the ordering between host work and copies is checked too.

PyTorch's CPU kernels release the GIL, so a worker's tensor work runs in parallel with the caller
driving the device. An exception in submitted work is kept and raised in the caller's thread by
the next :meth:`HostWorker.raise_pending` (waiting on the worker's events calls it); work submitted
before that is skipped, since it may depend on what failed. Work on another worker that waits on
a failed worker's event runs after it without taking its error: the error is the caller's to see
(a disk write after a failed update writes what the update left, as the state in memory would keep it).
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch


_live: weakref.WeakSet[HostWorker] = weakref.WeakSet()
_on_worker = threading.local()  # .worker: the HostWorker whose thread this is


@atexit.register
def _close_live_workers() -> None:
    # A daemon thread still inside a PyTorch kernel when the interpreter tears down can abort
    # the process; let each finish its work and end first.
    for worker in list(_live):
        worker.close(timeout=10.0)


@dataclass(frozen=True)
class WorkerEvent:
    """Completes once the worker has run its first ``position`` submissions."""

    worker: HostWorker
    position: int

    def query(self) -> bool:
        return self.worker.finished >= self.position

    def synchronize(self) -> None:
        self.worker.wait_for(self.position)


class HostWorker:
    """One thread that runs submitted callables in order.

    Args:
        name: the thread's name (it shows in debuggers and profiles).
        num_threads: CPU threads its PyTorch kernels may use (``torch.set_num_threads`` in the
            worker thread); ``None`` leaves PyTorch's setting.
        device: the model's device, made the thread's current CUDA device: a new thread starts on
            GPU 0, and anything CUDA its work touches (a fused optimizer's scalars, freeing pinned
            memory, an event) would run there. ``None`` or a CPU device changes nothing.
    """

    def __init__(self, name: str, num_threads: int | None = None, device: torch.device | None = None) -> None:
        self.name = name
        self.num_threads = num_threads
        self.device = device
        self.submitted = 0
        self.finished = 0
        self._error: BaseException | None = None
        self._skip_through = 0  # submissions up to this one are skipped: they followed a failure
        self._condition = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, work: Callable[[], None]) -> None:
        """Queue ``work`` after everything submitted before."""
        self.submitted += 1
        self._queue.put((self.submitted, work))

    def record(self) -> WorkerEvent:
        """An event that completes once everything submitted so far has run."""
        return WorkerEvent(self, self.submitted)

    def wait_for(self, position: int) -> None:
        """Block until the first ``position`` submissions have run; raise what failed (in a
        thread that is not a worker's: an error is raised once, in the thread that submitted)."""
        with self._condition:
            self._condition.wait_for(lambda: self.finished >= position)
        if getattr(_on_worker, "worker", None) is None:
            self.raise_pending()

    def raise_pending(self) -> None:
        """Raise, in the caller's thread, the exception a submission raised (once)."""
        with self._condition:
            error, self._error = self._error, None
            if error is not None:
                self._skip_through = self.submitted
        if error is not None:
            raise error

    def close(self, timeout: float | None = None) -> None:
        """Let the thread finish what was submitted and end; wait up to ``timeout`` seconds."""
        self._queue.put(None)
        if timeout is not None and self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        _on_worker.worker = self
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        while True:
            item = self._queue.get()
            if item is None:
                return
            position, work = item
            with self._condition:
                skip = self._error is not None or position <= self._skip_through
            error = None
            if not skip:
                try:
                    work()
                except BaseException as raised:  # noqa: BLE001 - handed to the caller's thread
                    error = raised
            # Hold nothing of finished work while waiting for the next: it may keep its owner alive.
            item = work = None  # type: ignore[assignment]
            with self._condition:
                if error is not None:
                    self._error = error
                self.finished += 1
                self._condition.notify_all()
            # Let go of the work (an update holds its slice's gradients) before waiting for more.
            del item, work
