"""The disk tier's window: :data:`WINDOW` buffers in host RAM, used in turn by the slices whose
state is read, updated and written (Note: [Disk tier pipeline] in ``offload/tiers/disk_tier.py``).
What it does not hold: what a slice keeps in a buffer (``state_slice.py``) or the files
(``state_files.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..streams.backend import Event
from ..streams.disk import AlignedBuffer

#: Buffers in the window: one read, one updated, one written (see Note: [Disk tier pipeline]).
WINDOW = 3


@dataclass
class WindowSlot:
    """One buffer of the window, and the write that last read it."""

    buffer: AlignedBuffer | None = None
    free: Event | None = None


class Window:
    """The window's buffers, handed out in turn to a step's slices."""

    def __init__(self) -> None:
        self.slots = [WindowSlot() for _ in range(WINDOW)]
        self._turn = 0

    def next(self) -> WindowSlot:
        """The slot of the next slice a step submits."""
        slot = self.slots[self._turn % WINDOW]
        self._turn += 1
        return slot

    def scratch(self, nbytes: int) -> AlignedBuffer:
        """A buffer of at least ``nbytes`` to read a file into outside a step (the first slot's,
        grown if needed); nothing may be pending."""
        slot = self.slots[0]
        if slot.buffer is None or slot.buffer.nbytes < nbytes:
            slot.buffer = AlignedBuffer(nbytes)
        return slot.buffer

    def for_load(self, nbytes: int) -> tuple[WindowSlot, AlignedBuffer]:
        """A buffer of ``nbytes`` for a slice a checkpoint loads, taken out of the window, and the
        slot it goes back to once written: the smallest buffer large enough, else (too small) the
        largest is let go and the new buffer takes its place. A slice loaded while others hold the
        window's buffers gets a buffer of its own."""
        fits = [s for s in self.slots if s.buffer is not None and s.buffer.nbytes >= nbytes]
        slot = (min(fits, key=lambda s: s.buffer.nbytes) if fits  # type: ignore[union-attr]
                else max(self.slots, key=lambda s: -1 if s.buffer is None else s.buffer.nbytes))
        buffer, slot.buffer = slot.buffer, None  # the slice's until it is written
        if buffer is None or buffer.nbytes < nbytes:
            buffer = AlignedBuffer(nbytes)
        return slot, buffer

    def buffers(self, held: Iterable[AlignedBuffer]) -> list[AlignedBuffer]:
        """The window's buffers and the ``held`` ones (of slices whose write failed), each once."""
        found = {id(s.buffer): s.buffer for s in self.slots if s.buffer is not None}
        found.update({id(b): b for b in held})
        return list(found.values())

    def clear(self) -> None:
        """Let every buffer go."""
        self.slots = [WindowSlot() for _ in range(WINDOW)]
