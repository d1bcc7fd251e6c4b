"""A stream backend that simulates CUDA stream semantics on the CPU, copies deferred.

Compute runs when the host issues it (it is ordinary CPU work), but a copy queued on a side stream
does not: its destination is *poisoned* at once (NaN for floating point; ``0xFF`` bytes for
``uint8``, the raw bytes of slots and pooled buffers, which read as NaN through any floating-point
view; ``True`` for ``bool``; the most negative value for other integers) and the copy runs only
when something forces it — compute waiting on its event or its stream, the host synchronising,
a copy queued after it on another stream that waits for it — or earlier, as the schedule decides:

- ``"late"``: only when forced, as late as is legal;
- ``"issue"``: as soon as it is queued (after whatever it waits for);
- ``"random"``: at random points in between, from a seeded generator.

A copy reads its source when it runs, so a source overwritten too early travels with the new
values, and a destination read too early reads poison: an ordering mistake shows up as a wrong
value. Every copy is also checked, when it is queued, by the happens-before tracker
(``memory.py``), which reports it at the offending operation whatever the schedule.

Each ordering primitive the copy engine calls (a wait, a host synchronisation, a mark of memory as
used) is a :class:`Dependency`, named by where it was asked for and where the event it waits for
was recorded. The backend can leave out chosen dependencies, as a mutation test does to prove the
checker notices each one missing.
"""

from __future__ import annotations

import os
import random
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..streams.backend import StreamBackend
from .clocks import COMPUTE, HOST, Epoch, VectorClock
from .memory import PINNED, MemoryTracker, Race

SCHEDULES = ("late", "issue", "random")

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = (os.path.join(_PACKAGE, "streamcheck"), os.path.join(_PACKAGE, "streams", "backend.py"),
             os.path.join(_PACKAGE, "streams", "copies.py"), os.path.join(_PACKAGE, "streams", "updates.py"),
             os.path.join(_PACKAGE, "streams", "collectives.py"))


def library_site() -> str:
    """``file.py:function`` of the innermost caller in the package outside the copy engine and
    this checker: where a copy or an ordering was asked for."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_PACKAGE) and not filename.startswith(_INTERNAL):
            return f"{os.path.basename(filename)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside the package"


def engine_call() -> str:
    """The copy engine method the package called (``load``, ``offload``, ``wait_loads_done``...):
    the outermost one on the stack."""
    frame = sys._getframe(1)
    name = "-"
    while frame is not None:
        if frame.f_code.co_filename == _INTERNAL[2]:
            name = frame.f_code.co_name
        frame = frame.f_back
    return name


def caller_site() -> str:
    """``file:line`` of the innermost frame outside torch and this checker, for reports."""
    frame = sys._getframe(1)
    torch_dir = os.path.dirname(torch.__file__)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((torch_dir, _INTERNAL[0])) and "contextlib" not in filename:
            return f"{os.path.relpath(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


@dataclass(frozen=True)
class Dependency:
    """One ordering the copy engine asked for.

    Attributes:
        kind: ``wait_event``, ``wait_stream``, ``synchronize_event``, ``synchronize_stream`` or
            ``mark_used``.
        via: the copy engine method the package called (``load``, ``wait_ready``, ``offload``...).
        site: where in the package it was called from (``device_slots.py:acquire``).
        on: the stream that the awaited event belongs to, the stream awaited, or the stream the
            memory is marked as used by (``compute``, ``load``, ``offload``).
    """

    kind: str
    via: str
    site: str
    on: str

    def __str__(self) -> str:
        return f"{self.kind} via {self.via} at {self.site} on {self.on}"


@dataclass
class SimStream:
    """A stream: its clock counts its copies; positions count its operations (copies and waits)."""

    agent: int
    role: str
    clock: VectorClock = field(default_factory=VectorClock)
    queue: list[Any] = field(default_factory=list)  # pending operations, oldest first
    issued: int = 0  # position of the last operation queued
    done: int = 0  # position of the last operation run

    @property
    def name(self) -> str:
        return f"{self.role} stream"


@dataclass
class SimWorker(SimStream):
    """A host worker (``offload/streams/workers.py``) whose work runs when forced, like a copy:
    its operations on memory count as its own agent's, not the host's.

    A worker ``by_key`` promises no order between its submissions, so each one runs on a *lane* of
    its own: a worker of one task, with an agent and a clock of its own, which knows nothing of the
    worker's other tasks. Waiting for one task's event orders nothing else, and the schedules run
    the tasks in any order their waits allow."""

    backend: Any = None
    error: BaseException | None = None
    skip_through: int = 0
    by_key: bool = False
    owner: SimWorker | None = None  # the worker ``by_key`` whose one task this lane runs
    sequence: int = 0  # a lane's: its task's number among its owner's submissions

    def submit(self, work: Callable[[], None], key: float | None = None, ready: Any = None) -> SimEvent:
        return self.backend.submit(self, work, [])

    def record(self) -> SimEvent:
        assert not self.by_key, "internal error: a worker by_key has no event for everything submitted"
        return self.backend.record(self)

    def raise_pending(self) -> None:
        if self.owner is not None:
            self.owner.raise_pending()
            return
        error, self.error = self.error, None
        if error is not None:
            self.skip_through = self.issued
            raise error

    def close(self) -> None:
        pass


@dataclass
class _Task:
    work: Callable[[], None]
    position: int
    epoch: Epoch  # every access the work makes counts as this one operation of the worker
    clock: VectorClock  # what the worker knew when the work was submitted
    after: list[Any]  # events the work waits for before it runs


@dataclass(frozen=True)
class SimEvent:
    stream: SimStream
    position: int  # the stream's operations up to here
    clock: VectorClock

    def query(self) -> bool:
        """Whether the stream has run up to here; like CUDA's, it orders nothing (no clock is joined)."""
        return self.stream.done >= self.position


@dataclass
class _Copy:
    """A deferred copy, holding tensors of its own on its source's and destination's memory."""

    dst: torch.Tensor
    src: torch.Tensor
    position: int
    count: int  # the stream's clock for this copy

    @classmethod
    def holding(cls, dst: torch.Tensor, src: torch.Tensor, position: int, count: int, tracker: MemoryTracker,
                released: Callable[[int], None]) -> _Copy:
        """The copy of ``src`` into ``dst``, queued at ``position``. It holds tensors of its own on
        the same memory, so that the program's tensors can die: when they do, ``released`` lets the
        tracker check whether the memory was freed while the stream may still use it (the caching
        allocator would hand it out again)."""
        with _untracked():
            held = (dst.detach(), src.detach())
        for tensor in (dst, src):
            record = tracker.tracked(tensor)
            if record is not None:
                record.held += 1
                weakref.finalize(tensor, released, record.storage._cdata)
        return cls(*held, position, count)

    def run(self, tracker: MemoryTracker) -> None:
        """Copy now, unrecorded (its accesses were checked when it was queued), and let go of the memory."""
        with torch.no_grad(), _untracked():
            self.dst.copy_(self.src)
        for tensor in (self.dst, self.src):
            record = tracker.tracked(tensor)
            if record is not None:
                record.held -= 1


@dataclass
class _Wait:
    position: int
    stream: SimStream  # waits for this stream's operations up to `until`
    until: int


class SimulatedBackend(StreamBackend):
    """CUDA stream semantics on the CPU with deferred copies; see the module docstring.

    Args:
        tracker: the memory tracker that checks and records every access.
        report: where ordering mistakes go.
        schedule: when deferred copies run (:data:`SCHEDULES`).
        seed: seed of the ``"random"`` schedule.
        leave_out: dependencies to skip (a mutation); ``None`` skips nothing.
        device: the simulated device (see :class:`~offload.streamcheck.StreamChecker`).
    """

    def __init__(self, tracker: MemoryTracker, report: Callable[[Race], None], schedule: str = "late",
                 seed: int = 0, leave_out: Callable[[Dependency], bool] | None = None,
                 device: torch.device | str = "cpu") -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise ValueError(f"the simulated device is a CPU device: pass 'cpu' (where CPU inputs live) or "
                             f"'cpu:0' (where they do not), not {str(self.device)!r}")
        self.tracker = tracker
        self.report = report
        self.schedule = schedule
        self.random = random.Random(seed)
        self.leave_out = leave_out
        self.host_clock = VectorClock()
        self.compute = SimStream(COMPUTE, "compute")
        self.streams: list[SimStream] = [self.compute]
        self.dependencies: set[Dependency] = set()
        self.left_out: set[Dependency] = set()
        self._operations = 0
        self.active_task: _Task | None = None

    # -- agents ----------------------------------------------------------------------------------

    def describe(self, agent: int) -> str:
        if agent == HOST:
            return "host"
        return next((s.name for s in self.streams if s.agent == agent), f"agent {agent}")

    def is_side(self, agent: int) -> bool:
        return agent not in (HOST, COMPUTE)

    def host_epoch(self, what: str) -> tuple[Epoch, VectorClock]:
        """An operation of the host thread, or of the host worker whose work is running."""
        task = self.active_task
        if task is not None:
            return Epoch(task.epoch.agent, task.epoch.count, f"{task.epoch.what}: {what}"), task.clock
        return Epoch(HOST, self.host_clock.tick(HOST), f"host: {what}"), self.host_clock

    def compute_epoch(self, what: str) -> Epoch:
        issuer = self.active_task.clock if self.active_task is not None else self.host_clock
        self.compute.clock.join(issuer)  # compute is queued by the host, after what it did
        self.compute.issued += 1
        self.compute.done += 1
        return Epoch(COMPUTE, self.compute.clock.tick(COMPUTE), f"compute: {what}")

    def host_learns_compute(self) -> None:
        """The host read a value compute produced (``.item()``): it waited for compute."""
        self.host_clock.join(self.compute.clock)

    # -- the backend interface ---------------------------------------------------------------------

    def current_stream(self) -> SimStream:
        return self.compute

    def new_stream(self, role: str) -> SimStream:
        agent = len(self.streams) + 1  # after the host (0) and compute (1)
        stream = SimStream(agent, role)
        self.streams.append(stream)
        return stream

    def record(self, stream: SimStream) -> SimEvent:
        stream.clock.join(self.host_clock)
        return SimEvent(stream, stream.issued, stream.clock.copy())

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        if self._skipped("wait_event", event.stream):
            return
        stream.clock.join(event.clock)
        self._after(stream, event.stream, event.position)

    def wait_stream(self, stream: SimStream, other: SimStream) -> None:
        if self._skipped("wait_stream", other):
            return
        stream.clock.join(other.clock)
        self._after(stream, other, other.issued)

    def synchronize_event(self, event: SimEvent) -> None:
        if self._skipped("synchronize_event", event.stream):
            return
        self.host_clock.join(event.clock)
        self.run_until(event.stream, event.position)
        if isinstance(event.stream, SimWorker):
            event.stream.raise_pending()

    def new_worker(self, role: str, num_threads: int | None = None, by_key: bool = False) -> SimWorker:
        worker = SimWorker(len(self.streams) + 1, role, backend=self, by_key=by_key)
        self.streams.append(worker)
        return worker

    def submit(self, worker: SimWorker, work: Callable[[], None], after: list[SimEvent],
               key: float | None = None) -> SimEvent:
        waits = [event for event in after if not self._skipped("synchronize_event", event.stream)]
        if worker.by_key:
            worker.issued += 1
            worker = SimWorker(len(self.streams) + 1, worker.role, backend=self, owner=worker, sequence=worker.issued)
            self.streams.append(worker)
        self.submit_work(worker, work, waits)
        return self.record(worker)

    def submit_work(self, worker: SimWorker, work: Callable[[], None], after: list[SimEvent] | None = None) -> None:
        worker.clock.join(self.host_clock)  # it runs after what the host did before submitting it
        for event in after or ():
            worker.clock.join(event.clock)  # and after the copies or work it waits for
        worker.issued += 1
        epoch = Epoch(worker.agent, worker.clock.tick(worker.agent), f"{worker.name} ({library_site()})")
        worker.queue.append(_Task(work, worker.issued, epoch, worker.clock.copy(), list(after or ())))
        if self.schedule == "issue":
            self.run_until(worker, worker.issued)
        elif self.schedule == "random":
            self.maybe_run()

    def synchronize_stream(self, stream: SimStream) -> None:
        if self._skipped("synchronize_stream", stream):
            return
        self.host_clock.join(stream.clock)
        self.run_until(stream, stream.issued)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream, to_device: bool) -> None:
        host, device = (src, dst) if to_device else (dst, src)
        if self.tracker.where(host) != PINNED:
            self.report(Race("asynchronous copy from or to pageable host memory", caller_site(),
                             f"{stream.name} ({library_site()})", "use memory from the copy engine's empty_host"))
        self.tracker.copied_on_device(device)
        stream.clock.join(self.host_clock)
        stream.issued += 1
        count = stream.clock.tick(stream.agent)
        epoch = Epoch(stream.agent, count,
                      f"{stream.name}: copy {'to device' if to_device else 'to host'} ({library_site()})")
        # Whatever legally comes before this copy and still has to read or write its destination
        # runs first; then the destination holds poison until the copy runs.
        for other in self.streams:
            if other is not stream and other.queue and self.tracker.pending_conflict(dst, other.agent):
                known = stream.clock.get(other.agent, 0)
                positions = [op.position for op in other.queue if isinstance(op, _Copy) and op.count <= known]
                if positions:
                    self.run_until(other, max(positions))
        self.tracker.access(src, False, epoch, stream.clock)
        self.tracker.check_fresh_write(dst, epoch, stream.clock)
        self.tracker.access(dst, True, epoch, stream.clock)
        _poison(dst)
        stream.queue.append(_Copy.holding(dst, src, stream.issued, count, self.tracker, self._released))
        if self.schedule == "issue":
            self.run_until(stream, stream.issued)
        elif self.schedule == "random":
            self.maybe_run()

    def mark_used(self, tensor: torch.Tensor, stream: SimStream) -> None:
        if self._skipped("mark_used", stream):
            return
        record = self.tracker.tracked(tensor)
        if record is not None:
            record.marked.add(stream.agent)

    def empty_host(self, nbytes: int) -> torch.Tensor:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        record = self.tracker.tracked(tensor)
        assert record is not None
        record.where = PINNED
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.tracker.where(tensor) == PINNED

    # -- running deferred copies -------------------------------------------------------------------

    def _after(self, stream: SimStream, other: SimStream, position: int) -> None:
        """``stream`` waits for ``other``'s operations up to ``position``."""
        if other is stream or other.done >= position:
            return
        if stream is self.compute:
            # Compute runs when issued, so what it waits for runs now.
            self.run_until(other, position)
        else:
            stream.issued += 1
            stream.queue.append(_Wait(stream.issued, other, position))

    def run_until(self, stream: SimStream, position: int) -> None:
        """Run ``stream``'s pending operations up to ``position`` (and what they wait for)."""
        while stream.done < position and stream.queue:
            operation = stream.queue.pop(0)
            if isinstance(operation, _Wait):
                self.run_until(operation.stream, operation.until)
                stream.done = operation.position
                continue
            if isinstance(operation, _Task):
                self._run_task(stream, operation)
                stream.done = operation.position
                continue
            operation.run(self.tracker)
            stream.done = operation.position
        if not stream.queue:
            stream.done = stream.issued

    def _run_task(self, worker: SimWorker, task: _Task) -> None:
        owner, number = (worker, task.position) if worker.owner is None else (worker.owner, worker.sequence)
        if owner.error is not None or number <= owner.skip_through:
            return
        for event in task.after:
            self.run_until(event.stream, event.position)
        previous, self.active_task = self.active_task, task
        try:
            task.work()
        except BaseException as error:  # noqa: BLE001 - raised in the host thread when it waits
            owner.error = error
        finally:
            self.active_task = previous

    def run_all(self) -> None:
        for stream in self.streams:
            self.run_until(stream, stream.issued)

    def maybe_run(self) -> None:
        """Under the random schedule, run a random prefix of a random stream's queue."""
        if self.schedule != "random":
            return
        # Inside a worker's task, another worker's task does not start: it may wait for the task
        # in progress, which a simulation on one thread cannot let finish first.
        in_task = self.active_task is not None
        pending = [s for s in self.streams if s.queue and not (in_task and isinstance(s, SimWorker))]
        if pending and self.random.random() < 0.3:
            stream = self.random.choice(pending)
            self.run_until(stream, self.random.randint(stream.done + 1, stream.issued))

    def after_operation(self) -> None:
        """Called after each host or compute operation: let the schedule run copies, and now and
        then notice the storages the program freed."""
        self.maybe_run()
        self._operations += 1
        if self._operations % 256 == 0:
            self.collect()

    def collect(self) -> None:
        self.tracker.collect(self.compute.clock, self.is_side, self.describe)

    def _released(self, key: int) -> None:
        """The program dropped a tensor a copy used: was that the last reference to its memory?"""
        self.tracker.collect(self.compute.clock, self.is_side, self.describe, only=key)

    # -- dependencies ------------------------------------------------------------------------------

    def _skipped(self, kind: str, on: SimStream) -> bool:
        dependency = Dependency(kind, engine_call(), library_site(), on.role)
        self.dependencies.add(dependency)
        if self.leave_out is not None and self.leave_out(dependency):
            self.left_out.add(dependency)
            return True
        return False


class _Untracked:
    """Suspends access recording while the simulation itself touches memory."""

    depth = 0

    def __enter__(self) -> None:
        _Untracked.depth += 1

    def __exit__(self, *exc: object) -> None:
        _Untracked.depth -= 1


def _untracked() -> _Untracked:
    return _Untracked()


def recording_suspended() -> bool:
    return _Untracked.depth > 0


def _poison(tensor: torch.Tensor) -> None:
    with torch.no_grad(), _untracked():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        elif tensor.dtype == torch.bool:
            tensor.fill_(True)
        elif tensor.dtype == torch.uint8:
            tensor.fill_(0xFF)  # NaN in any floating-point view of these bytes
        else:
            tensor.fill_(torch.iinfo(tensor.dtype).min)
