"""The staging window that loads read when the shadows are not kept in RAM
(``OffloadModel(..., masters=DiskTier(...), shadows="disk")``).

What this file holds: :class:`ShadowStaging`, a ring of pinned buffers, per buffer the ready event
of the last load that read it, and the host worker that casts a slice into a buffer ahead of its
load. What it does not: the cast itself (``SliceStorage.refresh_shadow`` in ``host_storage.py``),
the loads (``device_slots.py``), or which slice is cast ahead when (the walk, ``offload/walk/slice_walk.py``).

Note: [Shadows on disk]
    Under a compute dtype a load copies the slice's *shadow*, its bytes in the device layout and
    dtypes. With the masters on disk (Note: [Masters on disk] in
    ``offload/tiers/master_files.py``) that shadow, 2 bytes a parameter of the whole model, is
    the largest thing left in RAM. ``shadows="disk"`` keeps no shadow per slice: before each
    load the slice's float32 masters are read in from their file (4 bytes a parameter from the
    disk), cast into the next buffer of this ring and dropped again; the load copies the buffer
    to the device. The update then writes only the masters.

    - *Exact*: the cast is the one that writes a shadow kept in RAM (``_cast_into``), from the
      same masters, and the one-pass update writes the shadow bit for bit as that cast would
      (Note: [One-pass update] in ``offload/kernels/one_pass.py``): the device copies, and so
      every result, are the same as with the shadows in RAM.
    - *Bounded*: RAM holds :data:`STAGING_BUFFERS` buffers of the largest slice's shadow, and
      one slice's masters while it is cast. A buffer is written again only after the last load
      that read it: without that wait the cast would overwrite bytes an asynchronous load is
      still copying (the stream-ordering checker reports it, ``tests/test_streamcheck.py``).
    - *Ahead*: once a walk has issued a slice's load, it has the next slice cast on a host
      worker (``DeviceSlots.stage_ahead``, :meth:`ShadowStaging.stage_ahead`):
      one slice ahead, as the ring allows, since its buffer is the one the load before last
      read. The worker waits for that load and for the slice's pending host update (which
      writes the masters it reads); the slice's load waits on the host for the cast, and raises
      what the cast raised (a :class:`~offload.DiskTierError` on a failed read) at that load, on
      the thread that issues it; only then does that thread point the slice's next load at the
      buffer (``SliceStorage.staged_source``). A load with no cast ahead of it casts on that
      thread (:meth:`ShadowStaging.stage`): the first of a walk, a slice loaded out of the
      walk's order, or a cast ahead that no longer holds (an update submitted after it); a cast
      ahead that another cast would overtake is waited for and dropped. A walk ends, or fails,
      with no cast ahead left: what the caller does next may write the masters.
    - *Cost*: every load reads its masters from the disk, in forward and again in a
      checkpointed backward; nothing is written for it. Cast ahead, the read overlaps the
      compute of the slice loaded before, on the worker; the thread that issues the loads waits
      only for what is left of it. In RAM-only training nothing changes: the option needs
      masters on disk.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .backend import Event
from .copies import CopyStreams
from .workers import HostWorker

#: Buffers in the ring. Two, as there are device slots: the buffer a load fills was last read by
#: the load two before it, which the compute between them has waited for on the device, so the
#: wait for it rarely blocks.
STAGING_BUFFERS = 2


@dataclass
class _CastAhead:
    """A slice's cast into a buffer of the ring, submitted to the staging worker before its load."""

    storage: Any
    turn: int
    update: Event | None  # the slice's pending host update when the cast was submitted (it waits for it)
    done: Event | None = None  # the worker's event: the cast has run
    failure: Exception | None = None  # what the cast raised, for the load to raise

    def run(self, buffer: torch.Tensor) -> None:
        try:
            self.storage.refresh_shadow(staging=buffer)
        except Exception as error:  # noqa: BLE001 - raised by the load of this slice, on its thread
            # Kept here, not on the worker: a cast that is dropped (its slice cast again) must not
            # raise at some later wait on the worker, and must not stop the casts after it.
            self.failure = error


class ShadowStaging:
    """A ring of :data:`STAGING_BUFFERS` host buffers of ``nbytes`` each (pinned where copies are
    asynchronous), that staged loads take in turn (Note: [Shadows on disk]); none for ``nbytes``
    0 (no slice stages).

    Args:
        allocate: host byte allocator (``CopyStreams.empty_host``).
        nbytes: bytes of each buffer: the largest staged slice's load.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], nbytes: int) -> None:
        self.buffers = [allocate(nbytes) for _ in range(STAGING_BUFFERS)] if nbytes else []
        #: ready event of the last load that read each buffer: the next cast into it waits for it
        self.last_read: list[Event | None] = [None] * STAGING_BUFFERS
        self._turn = 0
        # - Casting ahead of the load (rule "Ahead" of the note): one at a time
        self.ahead: _CastAhead | None = None
        self._worker: HostWorker | None = None

    @property
    def buffer_nbytes(self) -> int:
        return int(self.buffers[0].numel()) if self.buffers else 0

    @property
    def nbytes(self) -> int:
        """Every buffer's bytes: what the ring holds in RAM."""
        return sum(int(buffer.numel()) for buffer in self.buffers)

    def _take_turn(self) -> int:
        turn = self._turn % len(self.buffers)
        self._turn += 1
        return turn

    def stage(self, storage: Any, copies: CopyStreams, update: Event | None = None) -> int | None:
        """Have ``storage``'s masters cast into a buffer, if it stages its loads (``storage.staged``,
        a :class:`~offload.streams.host_storage.SliceStorage`): the next load of it copies that
        buffer. Takes the cast :meth:`stage_ahead` started for it, once done, if it still holds
        (``update``, the slice's pending host update, is the one it waited for); else casts now,
        on this thread. Returns the buffer's index, for :meth:`read_by` (``None``: it does not stage).

        Raises:
            DiskTierError: the masters could not be read or written back (here or in the cast ahead).
        """
        if not storage.staged:
            return None
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            # Rule "Ahead": the load copies what the worker casts; any other cast waits for the
            # worker to be done with its buffer first.
            copies.wait_host(ahead.done)
            if ahead.storage is storage and ahead.update is update:
                if ahead.failure is not None:
                    raise ahead.failure
                storage.staged_source = self.buffers[ahead.turn][:storage.load_nbytes]
                return ahead.turn
        turn = self._take_turn()
        # Rule 4 of [Copy ordering]: the load that read this buffer last may still be copying it.
        copies.wait_host(self.last_read[turn])
        storage.refresh_shadow(staging=self.buffers[turn])
        storage.staged_source = self.buffers[turn][:storage.load_nbytes]
        return turn

    def stage_ahead(self, storage: Any, copies: CopyStreams, update: Event | None) -> None:
        """Start casting ``storage``'s masters into the next buffer on the staging worker, for its
        next load (:meth:`stage`) to take, after the last load that read the buffer and after
        ``update`` (the slice's pending host update). Nothing if it does not stage its loads or a
        cast ahead is already under way."""
        if not storage.staged or self.ahead is not None:
            return
        if self._worker is None:
            self._worker = copies.new_worker("shadow staging")
            weakref.finalize(self, self._worker.close)
        turn = self._take_turn()
        ahead = _CastAhead(storage, turn, update)
        # The worker overwrites the buffer (rule 4 of [Copy ordering]: after the load that read it
        # last) and reads the masters (after the update that writes them).
        ahead.done = copies.submit(self._worker, functools.partial(ahead.run, self.buffers[turn]),
                                   after=(self.last_read[turn], update))
        self.ahead = ahead

    def ahead_done(self, storage: Any) -> bool:
        """Whether a cast ahead of ``storage``'s load has run, without waiting: a hint (the load
        still waits for it)."""
        ahead = self.ahead
        return ahead is not None and ahead.storage is storage and (ahead.done is None or ahead.done.query())

    def drop_ahead(self, copies: CopyStreams) -> None:
        """Let a cast ahead that no load will take run out, and forget it (the end of a walk)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            # Its buffer is not cast into again before the worker is done with it.
            copies.wait_host(ahead.done)

    def read_by(self, turn: int | None, ready: Event | None) -> None:
        """The load with ready event ``ready`` reads buffer ``turn`` (from :meth:`stage`)."""
        if turn is not None:
            self.last_read[turn] = ready
