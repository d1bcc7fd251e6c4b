"""The staging window that loads read when the shadows are not kept in RAM
(``OffloadModel(..., masters=DiskTier(...), shadows="disk")``).

What this file holds: :class:`ShadowStaging`, a ring of pinned buffers and, per buffer, the
ready event of the last load that read it. What it does not: the cast into a buffer
(``SliceStorage.refresh_shadow`` in ``host_storage.py``) or the loads (``device_slots.py``).

Note: [Shadows on disk]
    Under a compute dtype a load copies the slice's *shadow*, its bytes in the device layout and
    dtypes. With the masters on disk (Note: [Masters on disk] in
    ``offload/tiers/master_files.py``) that shadow, 2 bytes a parameter of the whole model, is
    the largest thing left in RAM. ``shadows="disk"`` keeps no shadow per slice: each load reads
    the slice's float32 masters in from their file (4 bytes a parameter from the disk), casts
    them into the next buffer of this ring, drops them again, and copies the buffer to the
    device. The update then writes only the masters.

    - *Exact*: the cast is the one that writes a shadow kept in RAM (``_cast_into``), from the
      same masters, and the one-pass update writes the shadow bit for bit as that cast would
      (Note: [One-pass update] in ``offload/kernels/one_pass.py``): the device copies, and so
      every result, are the same as with the shadows in RAM.
    - *Bounded*: RAM holds :data:`STAGING_BUFFERS` buffers of the largest slice's shadow, and
      one slice's masters while it is cast. A buffer is written again only after the host has
      waited for the ready event of the last load that read it: without that wait the cast
      would overwrite bytes an asynchronous load is still copying (the stream-ordering checker
      reports it, ``tests/test_streamcheck.py``).
    - *Cost*: every load reads its masters from the disk, in forward and again in a
      checkpointed backward, on the thread that issues the load; nothing is written for it.
      In RAM-only training nothing changes: the option needs masters on disk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .backend import Event
from .copies import CopyStreams

#: Buffers in the ring. Two, as there are device slots: the buffer a load fills was last read by
#: the load two before it, which the compute between them has waited for on the device, so the
#: host's wait for it rarely blocks.
STAGING_BUFFERS = 2


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

    @property
    def buffer_nbytes(self) -> int:
        return int(self.buffers[0].numel()) if self.buffers else 0

    @property
    def nbytes(self) -> int:
        """Every buffer's bytes: what the ring holds in RAM."""
        return sum(int(buffer.numel()) for buffer in self.buffers)

    def stage(self, storage: Any, copies: CopyStreams) -> int | None:
        """Cast ``storage``'s masters into the next buffer, if it stages its loads (``storage.staged``,
        a :class:`~offload.streams.host_storage.SliceStorage`): the next load of it copies that
        buffer. Returns the buffer's index, for :meth:`read_by` (``None``: it does not stage).

        Raises:
            DiskTierError: the masters could not be read or written back.
        """
        if not storage.staged:
            return None
        turn = self._turn % len(self.buffers)
        self._turn += 1
        # Rule 4 of [Copy ordering]: the load that read this buffer last may still be copying it.
        copies.wait_host(self.last_read[turn])
        storage.refresh_shadow(staging=self.buffers[turn])
        return turn

    def read_by(self, turn: int | None, ready: Event | None) -> None:
        """The load with ready event ``ready`` reads buffer ``turn`` (from :meth:`stage`)."""
        if turn is not None:
            self.last_read[turn] = ready
