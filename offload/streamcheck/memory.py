"""Who touched which bytes, and when: the happens-before race check over memory.

Memory is tracked per allocation, byte range by byte range. For every range the tracker keeps the
last write and, per agent, the last read since. A new access is checked against them: a write must
come after earlier reads and writes by other agents, a read after the earlier write, where "after"
means *happens after* (see ``clocks.py``).

An allocation is usually one storage (the memory behind a tensor and all its views), but storages
may alias: a slice's host copies each have a storage of their own over the memory of the slice's
flat buffer (Note: [A storage per host copy] in ``offload/streams/host_storage.py``), and an
optimizer writing a parameter must be ordered against a load reading the flat buffer. So storages
are matched by address: a storage whose bytes lie in an allocation already seen joins it (at its
offset there), and one that covers allocations seen before takes them in. The tracker holds every
storage it has seen, so an address it knows is never handed out again meanwhile.

Storages also carry where they live, as the simulation sees it (all of them are CPU memory):

- ``PINNED``: host memory from the copy engine's allocator, the only host memory an asynchronous
  copy may use;
- ``HOST``: other host memory (what host-side code such as an optimizer creates from host tensors);
- ``DEVICE``: memory of the simulated device (what compute produced, or a copy wrote to the
  device side);
- ``UNKNOWN``: not yet seen in a role (a tensor the user made); it becomes ``DEVICE`` the first
  time compute uses it.

A storage is held (its memory cannot be reused) while the tracker has history for it, so that
addresses never alias across allocations. The tracker notices that the program freed a storage
when its own references are the last ones (:meth:`MemoryTracker.collect`), and then, once every
storage over an allocation is freed, models the caching allocator: device memory freed while a
side stream may still use it, and not marked as used by that stream, could be handed to compute
too early.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .clocks import COMPUTE, Epoch, VectorClock

PINNED = "pinned host"
HOST = "host"
DEVICE = "device"
UNKNOWN = "unknown"


def _use_count(storage: torch.UntypedStorage) -> int:
    return int(torch._C._storage_Use_Count(storage._cdata))


@dataclass
class _Range:
    """What happened to bytes [start, end) of an allocation."""

    start: int
    end: int
    write: Epoch | None = None
    reads: dict[int, Epoch] = field(default_factory=dict)


@dataclass(eq=False)
class Allocation:
    """Memory one or more storages cover (addresses ``start`` to ``end``), and what happened to it.

    Attributes:
        where: ``PINNED``, ``HOST``, ``DEVICE`` or ``UNKNOWN``.
        born_after_compute: operations of the compute stream queued when it was allocated: a
            freshly allocated device block may still be in use by them (the caching allocator
            reuses blocks in stream order), so another stream must wait for them before writing.
        side_written: whether a side stream has written it yet (the check above applies once).
        marked: agents that marked it as used (``record_stream``).
        ranges: the access history, in bytes from ``start``.
        storages: the records of the storages over it.
    """

    start: int
    end: int
    where: str
    born_after_compute: int
    side_written: bool = False
    marked: set[int] = field(default_factory=set)
    ranges: list[_Range] = field(default_factory=list)
    storages: list[Tracked] = field(default_factory=list)


@dataclass(eq=False)
class Tracked:
    """A storage the tracker holds.

    Attributes:
        storage: the tracker's own reference (keeps the memory from being reused).
        memory: the allocation it covers part or all of.
        offset: where the storage starts in ``memory``, in bytes.
        held: references the simulation itself holds through tensors of pending copies.
        freed: the program has let go of it (pending copies may still hold it).
    """

    storage: torch.UntypedStorage
    memory: Allocation
    offset: int = 0
    held: int = 0
    freed: bool = False

    # What concerns the memory is the allocation's, whichever storage it is seen through.

    @property
    def where(self) -> str:
        return self.memory.where

    @where.setter
    def where(self, where: str) -> None:
        self.memory.where = where

    @property
    def marked(self) -> set[int]:
        return self.memory.marked


@dataclass(frozen=True)
class Race:
    """Two accesses to the same bytes from different agents, neither ordered before the other,
    or another ordering mistake the checker found."""

    kind: str
    first: str
    second: str
    detail: str = ""

    def __str__(self) -> str:
        text = f"{self.kind}: {self.first}  --then-->  {self.second}"
        return text + (f" ({self.detail})" if self.detail else "")


def byte_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of its storage a tensor covers (its first to last element), or None if empty."""
    if tensor.numel() == 0:
        return None
    itemsize = tensor.element_size()
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
    start = tensor.storage_offset() * itemsize
    return start, start + (last + 1) * itemsize


class MemoryTracker:
    """Access history of every storage the simulation has seen.

    Args:
        report: called with each race found.
    """

    def __init__(self, report: Callable[[Race], None]) -> None:
        self.report = report
        self.storages: dict[int, Tracked] = {}
        # The allocations of non-empty storages by start address (they do not overlap).
        self._starts: list[int] = []
        self._allocations: list[Allocation] = []
        # A tensor's finalizer may run at any allocation (the garbage collector), also while the
        # tracker is placing a storage or collecting: its collection then waits until that is done,
        # so the sorted lists are never changed under an update that holds indices into them.
        self._busy = 0
        self._deferred: list[tuple[Any, ...]] = []

    # -- storages ------------------------------------------------------------------------------

    def tracked(self, tensor: torch.Tensor, where: str = UNKNOWN, compute_count: int = 0) -> Tracked | None:
        """The record of ``tensor``'s storage, made on first sight."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, meta, or a subclass without storage
            return None
        if storage.device.type != "cpu":
            return None
        key = storage._cdata
        record = self.storages.get(key)
        if record is None:
            with self._exclusive():
                record = self.storages[key] = self._place(storage, where, compute_count)
        return record

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Change the allocation lists; a collection asked for meanwhile runs after."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
        while not self._busy and self._deferred:
            # The tensor whose finalizer asked is gone by now: its reference no longer counts.
            compute_clock, side_agents, describe, only = self._deferred.pop(0)
            with self._exclusive():
                self._collect(compute_clock, side_agents, describe, only, dying=0)

    def _place(self, storage: torch.UntypedStorage, where: str, compute_count: int) -> Tracked:
        """A record for a storage not seen before, in the allocation its bytes lie in: one seen
        before, a new one, or a new one that takes in those it covers."""
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:  # no bytes to share: an allocation of its own, found by no address
            memory = Allocation(start, start, where, compute_count)
            record = Tracked(storage, memory)
            memory.storages.append(record)
            return record
        end = start + nbytes
        first = bisect.bisect_right(self._starts, start) - 1
        if first >= 0 and self._allocations[first].end > start:
            container = self._allocations[first]
            if container.end >= end:  # usual case for an alias: inside an allocation seen before
                record = Tracked(storage, container, start - container.start)
                container.storages.append(record)
                return record
        else:
            first += 1
        last = bisect.bisect_left(self._starts, end)
        overlapped = self._allocations[first:last]
        memory = Allocation(min([start] + [m.start for m in overlapped]), max([end] + [m.end for m in overlapped]),
                            next((m.where for m in overlapped if m.where != UNKNOWN), where),
                            max([compute_count] + [m.born_after_compute for m in overlapped]))
        for old in overlapped:
            shift = old.start - memory.start
            memory.ranges += [_Range(r.start + shift, r.end + shift, r.write, r.reads) for r in old.ranges]
            memory.side_written |= old.side_written
            memory.marked |= old.marked
            for other in old.storages:
                other.memory, other.offset = memory, other.offset + shift
                memory.storages.append(other)
        record = Tracked(storage, memory, start - memory.start)
        memory.storages.append(record)
        self._starts[first:last] = [memory.start]
        self._allocations[first:last] = [memory]
        return record

    def _forget(self, key: int, record: Tracked) -> None:
        del self.storages[key]
        memory = record.memory
        memory.storages.remove(record)
        if not memory.storages and memory.end > memory.start:
            index = bisect.bisect_left(self._starts, memory.start)
            assert self._allocations[index] is memory
            del self._starts[index], self._allocations[index]

    def where(self, tensor: torch.Tensor) -> str:
        record = self.tracked(tensor)
        return record.where if record is not None else UNKNOWN

    def copied_on_device(self, tensor: torch.Tensor) -> None:
        """``tensor`` is the device side of a copy: its memory is device memory, unless it is pinned."""
        record = self.tracked(tensor)
        if record is not None and record.where != PINNED:
            record.where = DEVICE

    def collect(self, compute_clock: VectorClock, side_agents: Callable[[int], bool],
                describe: Callable[[int], str], only: int | None = None) -> None:
        """Forget storages the program has freed (all, or the one with key ``only``, called while
        one of its tensors is being destroyed and still holds a reference); report device memory
        freed while a side stream may still use it without having marked it as used."""
        if self._busy:
            self._deferred.append((compute_clock, side_agents, describe, only))
            return
        with self._exclusive():
            self._collect(compute_clock, side_agents, describe, only, dying=0 if only is None else 1)

    def _collect(self, compute_clock: VectorClock, side_agents: Callable[[int], bool],
                 describe: Callable[[int], str], only: int | None, dying: int) -> None:
        candidates = list(self.storages.items()) if only is None else [
            (only, self.storages[only])] if only in self.storages else []
        for key, record in candidates:
            if record.freed:
                if record.held == 0:
                    self._forget(key, record)
                continue
            if _use_count(record.storage) > 1 + record.held + dying:
                continue
            record.freed = True
            memory = record.memory
            if memory.where == DEVICE and all(other.freed for other in memory.storages):
                for epoch in self._accesses(memory):
                    if (side_agents(epoch.agent) and epoch.agent not in memory.marked
                            and not epoch.happens_before(compute_clock)):
                        self.report(Race(
                            "device memory freed while a side stream may still use it, without marking it used",
                            epoch.what, "free", f"{describe(epoch.agent)} never marked it (record_stream)"))
                        break
            if record.held == 0:
                self._forget(key, record)

    @staticmethod
    def _accesses(memory: Allocation) -> Iterator[Epoch]:
        for r in memory.ranges:
            if r.write is not None:
                yield r.write
            yield from r.reads.values()

    # -- accesses ------------------------------------------------------------------------------

    def access(self, tensor: torch.Tensor, write: bool, epoch: Epoch, clock: VectorClock) -> None:
        """Check an access by ``epoch.agent`` (whose clock is ``clock``) and remember it."""
        record = self.tracked(tensor)
        span = byte_span(tensor)
        if record is None or span is None:
            return
        for r in self._cover(record.memory, record.offset + span[0], record.offset + span[1]):
            if r.write is not None and r.write.agent != epoch.agent and not r.write.happens_before(clock):
                self.report(Race("write then " + ("write" if write else "read") + " not ordered",
                                 r.write.what, epoch.what))
            if write:
                for read in r.reads.values():
                    if read.agent != epoch.agent and not read.happens_before(clock):
                        self.report(Race("read then write not ordered", read.what, epoch.what))
                r.write = epoch
                r.reads = {}
            else:
                r.reads[epoch.agent] = epoch

    def pending_conflict(self, tensor: torch.Tensor, agent: int) -> bool:
        """Whether ``agent`` has accessed bytes of ``tensor`` (used to find pending copies)."""
        record = self.tracked(tensor)
        span = byte_span(tensor)
        if record is None or span is None:
            return False
        start, end = record.offset + span[0], record.offset + span[1]
        for r in record.memory.ranges:
            if r.end > start and r.start < end and (
                    (r.write is not None and r.write.agent == agent) or agent in r.reads):
                return True
        return False

    def check_fresh_write(self, tensor: torch.Tensor, epoch: Epoch, clock: VectorClock) -> None:
        """A side stream writes ``tensor``: if its block is freshly allocated device memory, the
        stream must have waited for the compute queued when it was allocated."""
        record = self.tracked(tensor)
        if record is None or record.memory.side_written:
            return
        memory = record.memory
        memory.side_written = True
        if memory.where in (PINNED, HOST):
            return
        if clock.get(COMPUTE, 0) < memory.born_after_compute:
            self.report(Race(
                "write to freshly allocated device memory before the compute queued at its allocation",
                f"allocation after compute operation {memory.born_after_compute}", epoch.what,
                "the caching allocator may hand out a block that queued compute still uses: wait for compute first"))

    def _cover(self, memory: Allocation, start: int, end: int) -> list[_Range]:
        """The ranges exactly covering [start, end), split and created as needed."""
        ranges = memory.ranges
        starts = [r.start for r in ranges]
        k = bisect.bisect_right(starts, start) - 1
        if k >= 0 and ranges[k].end > start:
            if ranges[k].start < start:
                left = ranges[k]
                right = _Range(start, left.end, left.write, dict(left.reads))
                left.end = start
                ranges.insert(k + 1, right)
            k += 1 if ranges[k].start < start else 0
        else:
            k += 1
        covered: list[_Range] = []
        position = start
        while position < end:
            if k < len(ranges) and ranges[k].start <= position:
                r = ranges[k]
                if r.end > end:
                    tail = _Range(end, r.end, r.write, dict(r.reads))
                    r.end = end
                    ranges.insert(k + 1, tail)
                covered.append(r)
                position = r.end
                k += 1
            else:
                gap_end = ranges[k].start if k < len(ranges) and ranges[k].start < end else end
                gap = _Range(position, gap_end)
                ranges.insert(k, gap)
                covered.append(gap)
                position = gap_end
                k += 1
        return covered
