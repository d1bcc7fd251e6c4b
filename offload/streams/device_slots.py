"""Two device slots that take turns holding slices: while one computes, the other loads.

A slot is one persistent device byte buffer, sized for the largest slice; loading a slice is one
copy of its host buffer into a free slot. A slot remembers which slice it holds, so within one
forward and its backward a slice still in a slot is not loaded again: that is how the last slice
stays resident from the end of forward into the start of backward.

Note: [Device copies expire at the next forward]
    Every forward starts by forgetting what the slots hold and loads every slice afresh. Version
    counters cannot prove that host copies are unchanged across an optimizer step: fused
    optimizers (``torch.optim.AdamW(fused=True)``) and writes through ``p.data`` update the host
    copy without bumping ``p._version``, so a device copy kept across steps could silently be
    stale. Within one forward/backward pair, backward itself checks the parameters' versions
    against the common mistake of an optimizer step between forward and backward (see
    ``CallRecord.check_versions`` in ``offload/autograd/records.py``).

Graphs that autograd keeps across slot reuse hold slot memory by reference (``slot_references.py``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .backend import Event
from .copies import CopyStreams, outside_func_transforms
from .host_buffers import HostBufferPool
from .host_storage import SliceStorage, holder_of
from .shadow_staging import ShadowStaging
from .slot import Slot, SlotState
from .slot_buffers import SlotBuffers
from .slot_references import SlotReferences
from .updates import SliceUpdates


class DeviceSlots:
    """Double-buffered device copies of slices.

    Args:
        storages: host copies of every slice.
        copies: the copy engine.
        num_slots: how many slices can be on the device at once; two is enough to overlap the
            next slice's load with this slice's compute.
    """

    def __init__(self, storages: Sequence[SliceStorage], copies: CopyStreams, updates: SliceUpdates,
                 num_slots: int = 2, pool: HostBufferPool | None = None,
                 staging: ShadowStaging | None = None) -> None:
        self.storages = storages
        # The buffers staged loads read (Note: [Shadows on disk] in shadow_staging.py).
        self.staging = staging if staging is not None else ShadowStaging(copies.empty_host, 0)
        self.copies = copies
        self.updates = updates
        self._tick = 0
        nbytes = max(storage.device_nbytes for storage in storages)
        self._slots = [
            # Free from the start only after queued compute: the allocator may have handed out
            # memory that a kernel from an earlier forward still reads (rule 2).
            Slot(torch.empty(nbytes, dtype=torch.uint8, device=copies.device), free=copies.compute_done())
            for _ in range(min(num_slots, len(storages)))
        ]
        self.loads = 0  # loads issued; tests and benchmarks read it
        #: What autograd saves of slot memory, by reference (``slot_references.py``).
        self.references = SlotReferences(self._slots)
        #: The buffers of the slices in the slots: written back, snapshots restored (``slot_buffers.py``).
        # Through a weak proxy: the slots own their buffers' helper, and a reference back would make a
        # cycle that keeps a dropped model's slots and storages until the cycle collector runs.
        self.buffers = SlotBuffers(weakref.proxy(self), copies, pool)

    @property
    def slot_nbytes(self) -> int:
        return int(self._slots[0].data.numel())

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def slot_of(self, index: int) -> Slot | None:
        """The slot that holds slice ``index``, if one does."""
        return next((slot for slot in self._slots if slot.slice_index == index), None)

    def _holds_current(self, index: int) -> bool:
        slot = self.slot_of(index)
        return slot is not None and slot.state is SlotState.CURRENT

    def stage_ahead(self, index: int) -> None:
        """Start the host work of slice ``index``'s load, a cast on a host worker (Note: [Shadows on
        disk] in ``shadow_staging.py``), unless a slot holds it, current."""
        if not self._holds_current(index):
            self.staging.stage_ahead(self.storages[index], self.copies, self.updates.event(index))

    def prefetch(self, index: int) -> None:
        """Start loading slice ``index`` unless a slot holds it, current."""
        if self._holds_current(index):
            return
        slot = self.slot_of(index)
        if slot is None:
            candidates = [s for s in self._slots if not s.in_use]
            if not candidates:
                raise RuntimeError("internal error: every device slot is in use; release one before loading")
            slot = min(candidates, key=lambda s: s.last_used)
        elif slot.in_use:
            raise RuntimeError(f"internal error: slice {index} is stale while in use")
        storage = self.storages[index]
        slot.slice_index, slot.state = None, SlotState.EMPTY  # if the copy below raises
        # Note: [Copies under a torch.func transform] in copies.py: the slot is the walk's, not the caller's.
        with outside_func_transforms():
            # A pending host update (an optimizer step) finishes the host copy, and maybe the shadow.
            update = self.updates.wait(index)
            if storage.resident:
                # Note: [Resident slices]: a copy from device memory, on the compute stream.
                # Compute that read the slot before (slot.free) precedes it by stream order.
                self.copies.on_device(functools.partial(storage.load_into, slot.data), after=(slot.written_back,),
                                      label=f"offload::load resident slice {index}")
                slot.ready = None
            else:
                turn = self.staging.stage(storage, self.copies, update)
                if storage.shadow_stale() and not storage.staged:
                    # Rule 4 of [Copy ordering]: an earlier load may still read the shadow.
                    self.copies.wait_host(storage.shadow_read)
                    storage.refresh_shadow()
                slot.ready = self.copies.load(
                    slot.data[:storage.load_nbytes], storage.transfer_source(), after=(slot.free, slot.written_back),
                    label=f"offload::load slice {index}",
                )
                self.staging.read_by(turn, slot.ready)
            if storage.shadow is not None:
                storage.shadow_read = slot.ready
            for entry in storage.borrowed:
                # Issued after the slice's own load on the same stream, so its event is the slot's.
                slot.ready = self._load_borrowed(slot, index, entry)
        slot.slice_index, slot.state = index, SlotState.CURRENT
        if index not in slot.view_cache:
            slot.view_cache[index] = storage.device_views(slot.data)
        slot.views = slot.view_cache[index]
        self.loads += 1

    def can_load_now(self, index: int) -> bool:
        """Whether :meth:`prefetch` of slice ``index`` would only issue a copy: a slot is free for it, its
        update is done and its shadow current or cast ahead (no wait and no cast on the CPU), and it is
        neither resident nor borrowing (no copy on the compute stream, no other slice's update)."""
        if self._holds_current(index):
            return False  # nothing to load
        storage = self.storages[index]
        return (any(not s.in_use for s in self._slots) and not storage.resident and not storage.borrowed
                and self.updates.done(index) and (not storage.shadow_stale() or self.staging.ahead_done(storage)))

    def _load_borrowed(self, slot: Slot, index: int, entry: Any) -> Event | None:
        """Copy a parameter that an earlier slice holds into slice ``index``'s slot (Note: [Tied
        parameters across slices] in ``host_storage.py``), from that slice's host copy or shadow."""
        holder_index = holder_of(self.storages, index, entry.tensor)
        holder = self.storages[holder_index]
        if holder.resident:
            # Note: [Resident slices]: cast from the holder's device copy, on the compute stream,
            # which the slice's own load (on the load stream) did not order after the write-back.
            self.copies.on_device(functools.partial(holder.load_borrowed_into, slot.data, entry),
                                  after=(slot.written_back,), label=f"offload::load slice {index} (tied from resident {holder_index})")
            return slot.ready
        # Same as the holder's own load: its pending update first, then a current shadow.
        update = self.updates.wait(holder_index)
        turn = self.staging.stage(holder, self.copies, update)
        if holder.shadow_stale() and not holder.staged:
            self.copies.wait_host(holder.shadow_read)  # rule 4: an earlier load may still read it
            holder.refresh_shadow()
        source, dtype = holder.transfer_source_of(entry.tensor)
        ready = self.copies.load(
            slot.data[entry.device_offset:entry.device_offset + source.numel()], source,
            after=(slot.free, slot.written_back), label=f"offload::load slice {index} (tied from {holder_index})",
        )
        self.staging.read_by(turn, ready)
        if holder.shadow is not None:
            holder.shadow_read = ready
        return ready

    def acquire(self, index: int) -> list[torch.Tensor]:
        """Slice ``index`` on the device, ready for compute: typed views, one per entry.

        The slot stays reserved until :meth:`release`.
        """
        self.prefetch(index)
        slot = self.slot_of(index)
        assert slot is not None
        self.copies.wait_ready(slot.ready)
        slot.in_use = True
        self._tick += 1
        slot.last_used = self._tick
        return slot.views

    def release(self, index: int) -> None:
        """Compute issued so far is the last to read slice ``index`` before the slot may be reused."""
        slot = self.slot_of(index)
        if slot is None:
            return
        slot.free = self.copies.compute_done()
        slot.in_use = False

    def adopt(self, storages: Sequence[SliceStorage]) -> None:
        """Serve re-laid-out storages (that fit the slots) from now on; nothing loaded stays valid."""
        self.storages = storages
        for slot in self._slots:
            slot.slice_index, slot.state = None, SlotState.EMPTY
            slot.view_cache.clear()

    def forget_contents(self) -> None:
        """Treat every slot as holding nothing current: see Note: [Device copies expire at the next forward].

        A slice with a pending host update keeps its shadow as the update will leave it.
        """
        for slot in self._slots:
            if slot.state is SlotState.CURRENT:
                slot.state = SlotState.STALE
        for index, storage in enumerate(self.storages):
            if not self.updates.keeps_shadow(index):
                storage.expire_shadow()

    def mark_stale(self, index: int) -> None:
        """The device copy of slice ``index`` was modified (buffers restored or updated on the device)."""
        slot = self.slot_of(index)
        if slot is not None:
            slot.state = SlotState.STALE

    def invalidate(self) -> None:
        """Forget every slot's content and reservation, after an exception interrupted a walk."""
        self.copies.drain()
        self.buffers.land_write_backs()  # the drain completed them
        for slot in self._slots:
            slot.slice_index, slot.state = None, SlotState.EMPTY
            slot.in_use = False
            slot.free = self.copies.compute_done()
            slot.written_back = None

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in slot memory."""
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return False
        return any(slot.data.untyped_storage().data_ptr() == ptr for slot in self._slots)
