"""The buffers of the slices in the device slots: the only device data compute may change (running
statistics, counters), so they are written back to the host copies, and a forward's snapshot is
restored over them before a recompute; a probe compares them before and after a run, to see
changes no version counter shows. See Note: [Buffers] in ``offload/walk/slice_walk.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from .activations import OffloadTicket
from .backend import Event
from .copies import CopyStreams
from .flat_views import _itemsize
from .host_buffers import HostBufferPool
from .host_storage import SliceStorage
from .slice_entries import Entry
from .slot import Slot


class _Slots(Protocol):
    """What of :class:`~offload.streams.DeviceSlots` the buffers need."""

    storages: Sequence[SliceStorage]

    def slot_of(self, index: int) -> Slot | None: ...

    def mark_stale(self, index: int) -> None: ...


class SlotBuffers:
    """Write-backs and restores of the buffers of the slices the slots hold.

    Args:
        slots: the device slots.
        copies: the copy engine.
        pool: pinned buffers that write-backs into a file mapping (masters on disk) go through.
    """

    def __init__(self, slots: _Slots, copies: CopyStreams, pool: HostBufferPool | None) -> None:
        self.slots = slots
        self.copies = copies
        self.pool = pool
        #: write-backs staged in pinned memory, to land in their host copies: (host, staged)
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _acquired(self, index: int) -> Slot:
        slot = self.slots.slot_of(index)
        assert slot is not None and slot.in_use, "slice must be acquired"
        return slot

    def buffer_region(self, index: int) -> torch.Tensor:
        """The device bytes holding the acquired slice ``index``'s buffers."""
        start, end = self.slots.storages[index].buffer_region
        return self._acquired(index).data[start:end]

    def write_counter(self, index: int) -> int:
        """Sum of the version counters of slice ``index``'s device copies: moves on any in-place write."""
        slot = self.slots.slot_of(index)
        assert slot is not None
        return sum(view._version for view in slot.views)

    def snapshot(self, index: int) -> torch.Tensor:
        """A device copy of the acquired slice ``index``'s buffer bytes as they are now, for
        :meth:`changed_since` (rule 1 of Note: [Buffers]). Queued on the compute stream, as the
        run it precedes."""
        return self.buffer_region(index).clone()

    def changed_since(self, index: int, before: torch.Tensor, buffers: Sequence[Entry]) -> bool:
        """Whether any of ``buffers`` (of the acquired slice ``index``) holds other bytes than in
        ``before``, a :meth:`snapshot` of the slice's buffers. Bytes, so a NaN that stayed is
        unchanged and a sign of zero flipped is a change."""
        if not buffers:
            return False
        start, _ = self.slots.storages[index].buffer_region
        region = self.buffer_region(index)
        spans = [(e.device_offset - start, e.device_offset - start + e.shape.numel() * _itemsize(e.device_dtype))
                 for e in buffers]
        differs = torch.stack([region[a:b].ne(before[a:b]).any() for a, b in spans]).any()
        # The one blocking read of the probe: waits for the run just queued (once a slice and mode).
        return bool(differs.item())

    def write_back_buffers(self, index: int) -> Event | None:
        """Start copying the acquired slice's device buffers over its host buffers.

        The slot is not loaded again before this copy has read it (rule 2 of [Copy ordering]).
        """
        storage = self.slots.storages[index]
        slot = self._acquired(index)
        label = f"offload::write back buffers of slice {index}"
        if storage.resident:
            # Note: [Resident slices]: into device memory, on the compute stream.
            self.copies.on_device(functools.partial(storage.write_back_buffers, self.buffer_region(index)), label=label)
            slot.written_back = None
            return None
        host = storage.buffer_bytes()
        if storage.masters_file is None or self.pool is None or not self.copies.is_async:
            slot.written_back = self.copies.offload(host, self.buffer_region(index), label=label)
            return slot.written_back
        # Masters on disk: the host copies are a pageable file mapping, which an asynchronous copy
        # cannot write without blocking this thread until the compute before it is done. Stage
        # through a pooled pinned buffer; land_write_backs copies it over once the copy is done.
        buffer = self.pool.take(host.numel())
        staged = buffer.data[:host.numel()]
        slot.written_back = self.copies.offload(staged, self.buffer_region(index), after=(buffer.read_event,),
                                                label=label)
        buffer.write_event = slot.written_back
        self._staged.append((host, staged))
        return slot.written_back

    def land_write_backs(self) -> None:
        """Copy the write-backs staged in pinned memory into their host copies, on the CPU. Call
        once the host has waited for the write-backs (the end of a walk, or after a drain)."""
        staged, self._staged = self._staged, []
        with torch.no_grad():
            for host, pinned in staged:
                host.copy_(pinned)

    def restore_buffers(self, index: int, host_snapshot: torch.Tensor, ticket: OffloadTicket) -> None:
        """Load a buffer snapshot (a pooled host buffer, see ``ActivationOffloader``) into the
        acquired slice's device copy and make compute wait for it.

        The device copy then differs from the host copy, so the slot is marked stale.
        """
        ready = self.copies.load(self.buffer_region(index), host_snapshot, after=(ticket.ready,),
                                 after_queued_compute=True, label=f"offload::restore buffers of slice {index}")
        # Rule 4: the pooled buffer is not written again before this load has read it.
        ticket.buffer.read_event = ready
        self.copies.wait_ready(ready)
        self.slots.mark_stale(index)
