"""Host workers: a thread that runs host-side work (an optimizer's update) in order, off the
calling thread, with events that say when it is done.

A worker is to the host what a stream is to the device: work submitted to it runs in submission
order, concurrently with the caller, and :meth:`HostWorker.record` gives an event that completes
once everything submitted so far has run. A worker built ``by_key`` instead runs, of the work whose
waits are over, the one with the lowest key first (Note: [Updates in the next forward's order] in
``offload/optimizing/stepping.py``); each submission's event then says that it alone has run. The
copy engine waits on those events like on any other (``CopyStreams.wait_host``), and the
stream-ordering checker simulates workers the way it simulates streams, so the ordering between
host work and copies is checked too.

PyTorch's CPU kernels release the GIL, so a worker's tensor work runs in parallel with the caller
driving the device. An exception in submitted work is kept and raised in the caller's thread by
the next :meth:`HostWorker.raise_pending` (waiting on the worker's events calls it); work submitted
before that is skipped, since it may depend on what failed. Work on another worker that waits on
a failed worker's event runs after it without taking its error: the error is the caller's to see
(a disk write after a failed update writes what the update left, as the state in memory would keep it).
"""

from __future__ import annotations

import atexit
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch


_live: weakref.WeakSet[HostWorker] = weakref.WeakSet()
_on_worker = threading.local()  # .worker: the HostWorker whose thread this is


#: Seconds the interpreter's exit waits quietly for the host workers to finish what they hold; it
#: then says so on stderr and waits on.
EXIT_NOTE_SECONDS = 5.0


@atexit.register
def _close_live_workers() -> None:
    """Let every worker finish what it holds (the last step's updates, a state file being
    written) and end before the interpreter tears down: a daemon thread still inside a PyTorch
    kernel then aborts the process ("terminate called without an active exception"), with its
    work half done. No time limit: work left undone would be lost; past :data:`EXIT_NOTE_SECONDS`
    a line says what is waited for (Ctrl-C abandons it)."""
    workers = list(_live)
    for worker in workers:
        worker.close()
    deadline = time.monotonic() + EXIT_NOTE_SECONDS
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    busy = [worker for worker in workers if worker.is_alive()]
    if busy:
        queued = sum(worker.submitted - worker.finished for worker in busy)
        print(f"offload: finishing {queued} queued piece(s) of host work ({', '.join(sorted({w.name for w in busy}))}) "
              "before the interpreter exits; Ctrl-C abandons them", file=sys.stderr, flush=True)
        for worker in busy:
            worker.join()


@dataclass(frozen=True)
class WorkerEvent:
    """Completes once the worker has run its first ``position`` submissions, or, ``alone``, the
    ``position``-th submission (the same thing on a worker that runs in submission order)."""

    worker: HostWorker
    position: int
    alone: bool = False

    def query(self) -> bool:
        return self.worker.has_run(self.position, self.alone)

    def synchronize(self) -> None:
        self.worker.wait_for(self.position, self.alone)


@dataclass
class _Submission:
    position: int
    work: Callable[[], None] | None
    key: float
    ready: Callable[[], bool] | None  # whether its waits are over (None: nothing to wait for)


class HostWorker:
    """One thread that runs submitted callables in order (or, ``by_key``, in key order among the ready).

    Args:
        name: the thread's name (it shows in debuggers and profiles).
        num_threads: CPU threads its PyTorch kernels may use (``torch.set_num_threads`` in the
            worker thread); ``None`` leaves PyTorch's setting.
        device: the model's device, made the thread's current CUDA device: a new thread starts on
            GPU 0, and anything CUDA its work touches (a fused optimizer's scalars, freeing pinned
            memory, an event) would run there. ``None`` or a CPU device changes nothing.
        by_key: of the submissions not started, run next the one with the lowest ``key`` among
            those whose ``ready`` says their waits are over (the oldest when none is ready), not
            the oldest: for work whose items are independent and needed in key order. Costs the
            ordering between submissions: each one's event says only that it has run.
    """

    def __init__(self, name: str, num_threads: int | None = None, device: torch.device | None = None,
                 by_key: bool = False) -> None:
        self.name = name
        self.num_threads = num_threads
        self.device = device
        self.by_key = by_key
        self.submitted = 0
        self.finished = 0
        self._run_through = 0  # every submission up to this one has run
        self._run_beyond: set[int] = set()  # later ones that ran out of submission order
        self._error: BaseException | None = None
        self._skip_through = 0  # submissions up to this one are skipped: they followed a failure
        self._condition = threading.Condition()
        self._pending: list[_Submission] = []  # submitted, not started; oldest first
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, work: Callable[[], None], key: float | None = None,
               ready: Callable[[], bool] | None = None) -> WorkerEvent:
        """Queue ``work`` after everything submitted before (``by_key``: by ``key``, once ``ready()``
        says what it waits for is done; ``work`` still waits for it itself). Returns its event."""
        with self._condition:
            self.submitted += 1
            self._pending.append(_Submission(self.submitted, work, math.inf if key is None else key, ready))
            self._condition.notify_all()
            return WorkerEvent(self, self.submitted, alone=True)

    def record(self) -> WorkerEvent:
        """An event that completes once everything submitted so far has run."""
        return WorkerEvent(self, self.submitted)

    def has_run(self, position: int, alone: bool = False) -> bool:
        """Whether the first ``position`` submissions have run (``alone``: the ``position``-th)."""
        # The set first: the worker adds a position to it before it moves the count past it.
        return (alone and position in self._run_beyond) or self._run_through >= position

    def wait_for(self, position: int, alone: bool = False) -> None:
        """Block until the first ``position`` submissions (``alone``: the ``position``-th) have run;
        raise what failed (in a thread that is not a worker's: an error is raised once, in the
        thread that submitted)."""
        with self._condition:
            self._condition.wait_for(lambda: self.has_run(position, alone))
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
        with self._condition:
            self._closing = True
            self._condition.notify_all()
        if timeout is not None:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the thread, closed, has ended (at most ``timeout`` seconds)."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _next(self) -> _Submission | None:
        """The submission to run next, taken off the queue; ``None`` once closed and empty."""
        with self._condition:
            self._condition.wait_for(lambda: self._pending or self._closing)
            if not self._pending:
                return None
            chosen = self._pending[0]
            if self.by_key:
                # The oldest when none is ready: what it waits for is what completes first (copies
                # land in issue order), and it cannot wait for anything submitted after it.
                ready = [s for s in self._pending if s.ready is None or s.ready()]
                if ready:
                    chosen = min(ready, key=lambda s: (s.key, s.position))
            self._pending.remove(chosen)
            return chosen

    def _run(self) -> None:
        _on_worker.worker = self
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.num_threads is not None:
            # PyTorch initialises a thread's count at its first use (this call), to the last count
            # any thread stored; only then does the worker's own stick, whatever other threads set.
            torch.get_num_threads()
            torch.set_num_threads(self.num_threads)
        while True:
            item = self._next()
            if item is None:
                return
            position, work, item.work, item.ready = item.position, item.work, None, None
            with self._condition:
                skip = self._error is not None or position <= self._skip_through
            error = None
            if not skip:
                try:
                    work()  # type: ignore[misc]
                except BaseException as raised:  # noqa: BLE001 - handed to the caller's thread
                    error = raised
            # Hold nothing of finished work while waiting for the next: it may keep its owner alive.
            item = work = None  # type: ignore[assignment]
            with self._condition:
                if error is not None:
                    self._error = error
                self.finished += 1
                self._run_beyond.add(position)
                while self._run_through + 1 in self._run_beyond:
                    self._run_through += 1
                    self._run_beyond.discard(self._run_through)
                self._condition.notify_all()
            # Let go of the work (an update holds its slice's gradients) before waiting for more.
            del item, work
