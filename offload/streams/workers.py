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

Note: [A worker under interrupts and forks]
    Ctrl-C raises ``KeyboardInterrupt`` in the main thread at any point where CPython checks for
    signals (after a call into C returns, where a Python function starts), so a caller may be
    interrupted anywhere in handing work over; and ``os.fork()`` copies a process without its
    workers' threads.

    1. :meth:`HostWorker.submit` queues the work with one list append, under a lock whose ``with``
       is C code (``threading.RLock``): an interrupt before the append leaves nothing queued, one
       after it the work queued and the worker woken (it is woken first). No count is kept
       apart from the queue to disagree with it: the submissions are what the thread took plus
       what waits. ``threading.Condition``'s own ``with`` runs Python code, where an interrupt
       left the lock held: the worker, then the interpreter's exit, blocked forever.
    2. A caller interrupted in or after a hand-off asks :meth:`HostWorker.queued_since` whether its
       work was queued (it runs, and is to be waited for like any other) or not (it never runs),
       never the event a submission returned: the interrupt may land between the queue and the
       caller's store. So a hand-off queues and registers its work in one ``try`` whose handler
       asks (``_hand_update``, ``_hand_sharded`` and ``_hand_outside`` in
       ``offload/optimizing/stepping.py``, a sharded update's exchange queued after its update, the
       disk tier's pipeline, a clip's owed scaling), and work owed on a slice stays owed until
       the submission that does it is registered (``SliceUpdates.claim`` in ``updates.py``).
    3. A child of ``os.fork()`` holds the workers but not their threads. A worker that had nothing
       left to run at the fork starts a thread again at its next submission: the child trains on.
       One with work not finished (being run, which the child holds half done, or waiting, which
       would run twice, once in each process, on memory they may share: a mapped file) raises a
       ``RuntimeError`` at each submission and at each wait for that work, saying to synchronize
       before forking or to start processes with ``spawn``; what ran before the fork stays
       readable. Each worker's lock is held across the fork (``os.register_at_fork``), so the
       child's copy of the counts is whole; the child gets new locks. A DataLoader worker, forked,
       never touches the workers and is unaffected.
    4. What a process keeps in files (a disk tier's state: ``offload/tiers/disk_tier.py``) a fork
       child shares with its parent: a step there would write the parent's files. Such an owner
       notes :func:`forks` when it is made and refuses, in a child, at the first use that reads
       or writes them, saying what to do; the child's exit, or its close or drop of the owner,
       closes only its copies of the descriptors and leaves the files to the parent
       (``StateFiles`` in ``offload/tiers/state_files.py``).
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch


_live: weakref.WeakSet[HostWorker] = weakref.WeakSet()
_on_worker = threading.local()  # .worker: the HostWorker whose thread this is
_held_for_fork: list[HostWorker] = []  # the workers whose lock an os.fork() in progress holds
_forks = 0  # the os.fork() calls between the interpreter's start and this process (rule 4)


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


def _hold_for_fork() -> None:
    """Before ``os.fork()``: hold each worker's lock, so the child copies whole counts (Note: [A
    worker under interrupts and forks], rule 3). A worker's thread holds it only between two pieces
    of work, never while one runs."""
    for worker in list(_live):
        worker._lock.acquire()
        _held_for_fork.append(worker)


def _release_after_fork() -> None:
    """After ``os.fork()``, in the parent (or where it failed)."""
    while _held_for_fork:
        _held_for_fork.pop()._lock.release()


def forks() -> int:
    """How many ``os.fork()`` calls made this process (a child's child: 2); what an owner of files
    compares with the count when it was made (Note: [A worker under interrupts and forks], rule 4)."""
    return _forks


def _forked_child() -> None:
    """After ``os.fork()``, in the child: the workers' threads are gone (rule 3)."""
    global _forks
    _forks += 1
    _held_for_fork.clear()
    for worker in list(_live):
        worker._after_fork_in_child()


os.register_at_fork(before=_hold_for_fork, after_in_parent=_release_after_fork, after_in_child=_forked_child)


def mark_of(worker: object) -> object:
    """``worker``'s :meth:`HostWorker.mark`; ``None`` for the stream-ordering checker's workers."""
    return worker.mark() if isinstance(worker, HostWorker) else None


def queued_since(worker: object, mark: object) -> WorkerEvent | None:
    """``worker``'s :meth:`HostWorker.queued_since` (rule 2); ``None`` for the stream-ordering
    checker's workers, which are never interrupted: their caller knows what it queued."""
    return worker.queued_since(mark) if isinstance(worker, HostWorker) else None


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
    taken: bool = False  # the thread took it off the queue (queued_since reads it)


def _own_thread_count(count: int) -> None:
    """Give the calling thread ``count`` PyTorch threads, and later threads the count they had.

    PyTorch initialises a thread's count at its first use (the ``get_num_threads`` here) to the
    last count any thread stored; only then does the worker's own stick, whatever other threads
    set. But ``set_num_threads`` stores ``count`` for every thread started later too: a user's
    training or data thread would start on the worker's count (one core, or all but one), and a
    reduction's order, so its result, changes with it. A throwaway thread stores the count back.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    if before != count:
        restore = threading.Thread(target=torch.set_num_threads, args=(before,), name="offload-thread-count")
        restore.start()
        restore.join()


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
        self.finished = 0
        self._taken = 0  # submissions the thread took off the queue
        self._run_through = 0  # every submission up to this one has run
        self._run_beyond: set[int] = set()  # later ones that ran out of submission order
        self._error: BaseException | None = None
        self._skip_through = 0  # submissions up to this one are skipped: they followed a failure
        # - A lock whose ``with`` is C code, and the condition the thread and the waits sleep on
        #   (Note: [A worker under interrupts and forks], rule 1).
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._pending: list[_Submission] = []  # submitted, not started; oldest first
        self._closing = False
        self._latest = threading.local()  # .submission: the last one each thread made (rule 2)
        self._unfinished_at_fork = 0  # in a child of os.fork(): the work the parent's thread had left (rule 3)
        self._thread: threading.Thread | None = None
        self._start()
        _live.add(self)

    @property
    def submitted(self) -> int:
        """Submissions so far: those the thread took, and those waiting."""
        with self._lock:
            return self._taken + len(self._pending)

    def submit(self, work: Callable[[], None], key: float | None = None,
               ready: Callable[[], bool] | None = None) -> WorkerEvent:
        """Queue ``work`` after everything submitted before (``by_key``: by ``key``, once ``ready()``
        says what it waits for is done; ``work`` still waits for it itself). Returns its event.

        Raises:
            RuntimeError: this process is a child of ``os.fork()`` whose parent had work on this
                worker not finished (Note: [A worker under interrupts and forks], rule 3).
        """
        if self._thread is None:
            self._start()  # a fork child's worker (rule 3)
        with self._lock:
            position = self._taken + len(self._pending) + 1
            submission = _Submission(position, work, math.inf if key is None else key, ready)
            self._latest.submission = submission
            self._changed.notify_all()  # the thread looks once the lock is free
            self._pending.append(submission)  # the one step that queues it (rule 1)
        return WorkerEvent(self, position, alone=True)

    def mark(self) -> object:
        """Where the calling thread's submissions stand, for :meth:`queued_since`."""
        return getattr(self._latest, "submission", None)

    def queued_since(self, mark: object) -> WorkerEvent | None:
        """The event of the last work the calling thread submitted since ``mark`` (what :meth:`mark`
        returned), if it was queued; ``None`` when none was: what a caller interrupted in a
        hand-off asks (Note: [A worker under interrupts and forks], rule 2)."""
        latest = getattr(self._latest, "submission", None)
        if latest is None or latest is mark:
            return None
        with self._lock:
            queued = latest.taken or any(s is latest for s in self._pending)
        if not queued:
            latest.work = latest.ready = None  # it never runs: let go of what it holds
            return None
        return WorkerEvent(self, latest.position, alone=True)

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
        thread that submitted).

        Raises:
            RuntimeError: this process is a child of ``os.fork()`` and the parent's thread had not
                run that work (rule 3).
        """
        with self._lock:
            if self._unfinished_at_fork and not self.has_run(position, alone):
                raise RuntimeError(self._forked_message())
            self._changed.wait_for(lambda: self.has_run(position, alone))
        if getattr(_on_worker, "worker", None) is None:
            self.raise_pending()

    def raise_pending(self) -> None:
        """Raise, in the caller's thread, the exception a submission raised (once)."""
        with self._lock:
            error, self._error = self._error, None
            if error is not None:
                self._skip_through = self.submitted
        if error is not None:
            raise error

    def close(self, timeout: float | None = None) -> None:
        """Let the thread finish what was submitted and end; wait up to ``timeout`` seconds."""
        with self._lock:
            self._closing = True
            self._changed.notify_all()
        if timeout is not None:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the thread, closed, has ended (at most ``timeout`` seconds)."""
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start(self) -> None:
        """Start the thread (again, in a child of ``os.fork()`` whose parent had left it nothing to run).

        Raises:
            RuntimeError: the parent had left it work (Note: [A worker under interrupts and forks], rule 3).
        """
        if self._unfinished_at_fork:
            raise RuntimeError(self._forked_message())
        thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        thread.start()
        self._thread = thread

    def _after_fork_in_child(self) -> None:
        """This process is a child of ``os.fork()``: the thread is gone, with what it was running
        and what waited (rule 3). The counts are whole: the fork held the lock."""
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._thread = None
        self._unfinished_at_fork = self._taken + len(self._pending) - self.finished

    def _forked_message(self) -> str:
        return (f"this process is a child of os.fork(), forked while offload's host worker {self.name!r} had "
                f"{self._unfinished_at_fork} piece(s) of work not finished (an optimizer's update, a disk write): "
                "they run in the parent only, and this process holds what they write half done or not done, so "
                "it cannot use the model or its optimizer. Call optimizer.synchronize() before forking, or start "
                "processes with the 'spawn' or 'forkserver' method (multiprocessing.get_context('spawn'), "
                "torch.utils.data.DataLoader(..., multiprocessing_context='spawn')).")

    def _next(self) -> _Submission | None:
        """The submission to run next, taken off the queue; ``None`` once closed and empty."""
        with self._lock:
            self._changed.wait_for(lambda: self._pending or self._closing)
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
            self._taken += 1
            chosen.taken = True
            return chosen

    def _run(self) -> None:
        _on_worker.worker = self
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.num_threads is not None:
            _own_thread_count(self.num_threads)
        while True:
            item = self._next()
            if item is None:
                return
            position, work, item.work, item.ready = item.position, item.work, None, None
            with self._lock:
                skip = self._error is not None or position <= self._skip_through
            error = None
            if not skip:
                try:
                    work()  # type: ignore[misc]
                except BaseException as raised:  # noqa: BLE001 - handed to the caller's thread
                    error = raised
            # Hold nothing of finished work while waiting for the next: it may keep its owner alive.
            item = work = None  # type: ignore[assignment]
            with self._lock:
                if error is not None:
                    self._error = error
                self.finished += 1
                self._run_beyond.add(position)
                while self._run_through + 1 in self._run_beyond:
                    self._run_through += 1
                    self._run_beyond.discard(self._run_through)
                self._changed.notify_all()
            # Let go of the work (an update holds its slice's gradients) before waiting for more.
            del item, work
