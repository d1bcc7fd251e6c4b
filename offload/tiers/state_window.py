"""The disk tier's window: host RAM for the state of the slices whose state is read, updated and
written at once (Note: [Disk tier pipeline] in ``offload/tiers/disk_tier.py``). What it does not
hold: what a slice keeps in a buffer (``state_slice.py``) or the files (``state_files.py``).

Note: [The window's arena]
    The window is one buffer, the *arena*, sized for the most that :data:`WINDOW` consecutive
    slices' state takes, and each slice has its own *place* in it (an offset), fixed while the
    slices' sizes stay the same. A step serves slices in slice order (or its reverse, updating in
    backward); the rules that make the places safe:

    1. A slice's place is disjoint from the places of the two slices next to it on either side
       (:func:`place`), so from the two slices served before it, in either order.
    2. Its read waits for the write of the slice served three before it (the slot's ``free``
       event), and the writer runs writes in order: every slice whose place it may share has
       been written before the read writes into it.
    3. Each turn checks rule 1 against the two turns before it (``Window.next``): a slice served
       out of that order (one skipped, having no gradient) gets a buffer of its own instead. The
       read is handed the place with its turn: by the time it runs, the slot's ``region`` may
       be that of the slice three on.
    4. ``flush()`` waits for every write, so each step starts the turns afresh (``restart``):
       the last slices of a step and the first of the next are not neighbours.
    5. State that must outlive its turn (a write failed: it is *held*) moves to a buffer of its own.

    Before the sizes are known (the first step creates the state) or for a slice without a
    place, the slot's own buffer serves, grown to the largest slice it served. A slice whose
    state is still in RAM (the optimizer makes it in its first step) lets the slot's own buffer
    go at its read and gets a fresh one when its state is copied in: the state the update makes
    takes that buffer's place, and while the writes keep up with the updates RAM holds three
    slices' state then too, not four. The first step
    after the sizes are known lets those go and makes the arena, which then stays (its pages are
    touched once, not each step). With a large last slice (a language model's head), the arena
    is the head's state and two other slices', where a buffer per slot grew to three heads'.

    Places are contiguous (a tensor's view needs that), so a ring of places can waste the gap at
    the arena's end: :func:`place` searches for places that fit in the most three consecutive
    slices take, and else grows the arena, up to that plus the largest slice, where the ring
    always fits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..streams.backend import Event
from ..streams.disk import AlignedBuffer, page_aligned

#: Slices in the window: one read, one updated, one written (see Note: [Disk tier pipeline]).
WINDOW = 3

#: Placements :func:`place` tries before it grows the arena (a search is a few per slice).
_SEARCH_BUDGET = 20_000


class Region:
    """``nbytes`` of the arena from byte ``start``: a slice's buffer, used as an
    :class:`~offload.streams.disk.AlignedBuffer` is (``start`` and ``nbytes`` are whole pages)."""

    def __init__(self, arena: AlignedBuffer, start: int, nbytes: int) -> None:
        self.arena, self.start, self.nbytes = arena, start, nbytes
        self.tensor = arena.tensor[start:start + nbytes]

    def view(self, start: int, stop: int) -> memoryview:
        return self.arena.view(self.start + start, self.start + stop)

    def data_ptr(self) -> int:
        return self.arena.data_ptr() + self.start

    def overlaps(self, other: Region | None) -> bool:
        return (other is not None and other.arena is self.arena
                and self.start < other.start + other.nbytes and other.start < self.start + self.nbytes)

    def copy(self) -> AlignedBuffer:
        """A buffer of its own with the region's bytes (Note: [The window's arena], rule 5)."""
        own = AlignedBuffer(self.nbytes)
        own.tensor.copy_(self.tensor)
        return own


#: What a slice's state is read into: a place in the arena, or a buffer of its own.
Buffer = AlignedBuffer | Region


@dataclass
class WindowSlot:
    """One turn in three of the window: the buffer of the slice served in it, the place in the
    arena of the slice handed the turn last (for :meth:`Window.next`'s check), and the write that
    last read it."""

    buffer: Buffer | None = None
    region: Region | None = None
    free: Event | None = None

    def take(self, region: Region | None) -> None:
        """At the read (the write that last used the slot is done): this turn's buffer, its slice's
        ``region`` as :meth:`Window.next` handed it out (``self.region`` may be a later turn's by then)."""
        if region is not None:
            self.buffer = region
        elif isinstance(self.buffer, Region):
            self.buffer = None  # an earlier turn's place, which this turn's slice may not use


class Window:
    """The arena and its places, and the slots handed out in turn to a step's slices."""

    def __init__(self) -> None:
        self.slots = [WindowSlot() for _ in range(WINDOW)]
        self._turn = 0
        self.arena: AlignedBuffer | None = None
        self._places: dict[int, Region] = {}
        self._sizes: tuple[tuple[int, int], ...] = ()
        self._lent: Region | None = None  # the arena, lent to a slice a checkpoint loads

    def restart(self, sizes: Sequence[tuple[int, int]]) -> None:
        """Nothing is pending: the next slice served takes the first turn. ``sizes``: (index, bytes
        of state) of the slices laid out, in slice order; when they changed, the arena goes, and
        the first turn makes one for them."""
        self._turn = 0
        for slot in self.slots:
            slot.free, slot.region = None, None
        if tuple(sizes) != self._sizes:
            self._sizes = tuple(sizes)
            self.arena, self._places, self._lent = None, {}, None

    def next(self, index: int, nbytes: int) -> WindowSlot:
        """The slot of the next slice a step submits, ``index``, whose state takes ``nbytes`` (0 when
        not laid out yet): with its place when it has one large enough that does not overlap the
        two turns before (Note: [The window's arena], rule 3)."""
        if self._turn == 0 and self.arena is None and self._sizes:
            self._open()
        slot = self.slots[self._turn % WINDOW]
        before = [self.slots[(self._turn - back) % WINDOW].region for back in range(1, min(self._turn, WINDOW - 1) + 1)]
        self._turn += 1
        region = self._places.get(index)
        fits = region is not None and nbytes <= region.nbytes and not any(region.overlaps(r) for r in before)
        slot.region = region if fits else None
        return slot

    def _open(self) -> None:
        """The arena and the places for the slices laid out (nothing is pending: a step starts)."""
        offsets, nbytes = place([n for _, n in self._sizes])
        for slot in self.slots:
            slot.buffer = None  # the arena serves the slices laid out; let the slots' own go first
        self.arena = AlignedBuffer(nbytes)
        self._places = {index: Region(self.arena, at, n) for (index, n), at in zip(self._sizes, offsets)}

    def scratch(self, nbytes: int) -> Buffer:
        """A buffer of at least ``nbytes`` to read a file into outside a step (the arena, else the
        first slot's own, grown if needed); nothing may be pending."""
        if self.arena is not None and self._lent is None and self.arena.nbytes >= nbytes:
            return self.arena
        slot = self.slots[0]
        if not isinstance(slot.buffer, AlignedBuffer) or slot.buffer.nbytes < nbytes:
            slot.buffer = AlignedBuffer(nbytes)
        return slot.buffer

    def for_load(self, nbytes: int) -> Buffer:
        """A buffer of ``nbytes`` for a slice a checkpoint loads, until :meth:`returned`: the arena's
        start when it is large enough and not lent already; else a slot's own buffer, the smallest
        large enough (too small, the largest is let go and a new one takes its place). A slice
        loaded while others hold those gets a buffer of its own."""
        if self._lent is None and self.arena is not None and self.arena.nbytes >= nbytes:
            self._lent = Region(self.arena, 0, page_aligned(nbytes))
            return self._lent
        own = [s for s in self.slots if isinstance(s.buffer, AlignedBuffer)]
        fits = [s for s in own if s.buffer.nbytes >= nbytes]  # type: ignore[union-attr]
        slot = (min(fits, key=lambda s: s.buffer.nbytes) if fits  # type: ignore[union-attr]
                else max(own, key=lambda s: s.buffer.nbytes, default=None))  # type: ignore[union-attr]
        buffer = None
        if slot is not None:
            buffer, slot.buffer = slot.buffer, None  # the slice's until it is written
        if not isinstance(buffer, AlignedBuffer) or buffer.nbytes < nbytes:
            buffer = AlignedBuffer(nbytes)
        return buffer

    def returned(self, buffer: Buffer) -> None:
        """A buffer of :meth:`for_load` is no longer the loaded slice's: back to the window, for the
        next slice and the next step."""
        if buffer is self._lent:
            self._lent = None
        elif isinstance(buffer, AlignedBuffer):
            for slot in self.slots:
                if not isinstance(slot.buffer, AlignedBuffer) or slot.buffer.nbytes < buffer.nbytes:
                    slot.buffer = buffer
                    return

    def buffers(self, held: Iterable[Buffer]) -> list[AlignedBuffer]:
        """The arena, the slots' own buffers and the ``held`` ones (of slices whose write failed),
        each once."""
        found = {id(b): b for b in [self.arena, *(s.buffer for s in self.slots), *held]
                 if isinstance(b, AlignedBuffer)}
        return list(found.values())

    def clear(self) -> None:
        """Let every buffer go."""
        self.slots = [WindowSlot() for _ in range(WINDOW)]
        self.arena, self._places, self._sizes, self._lent = None, {}, (), None


def most_at_once(sizes: Sequence[int], window: int = WINDOW) -> int:
    """The most bytes ``window`` consecutive slices take (0 for no slices or no window)."""
    if window <= 0:
        return 0
    return max((sum(sizes[i:i + window]) for i in range(max(len(sizes) - window + 1, 1))), default=0)


def place(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Places for slices of ``sizes`` bytes (whole pages), served in this order or its reverse, each
    disjoint from its two neighbours on either side: their offsets, and the arena's bytes. The
    arena is the most three consecutive slices take when a search finds places in that (Note:
    [The window's arena]), else larger, up to that plus the largest slice."""
    if not sizes:
        return [], 0
    need, largest = most_at_once(sizes), max(sizes)
    for more in range(5):
        arena = need + page_aligned(largest * more // 4) if more else need
        offsets = _search(sizes, arena)
        if offsets is not None:
            return offsets, arena
    raise AssertionError("internal error: the ring of places does not fit its arena")


def _search(sizes: Sequence[int], arena: int) -> list[int] | None:
    """Offsets in ``arena`` bytes for slices of ``sizes``, each disjoint from the two before it, found
    depth first: a slice goes right after the one before it (a ring), else at the arena's start,
    else beside another live slice or at the end; ``None`` if the budget runs out first.

    At ``arena`` = most three consecutive + largest, the first path (the ring, wrapping to the
    start when the rest is too small) always fits: a wrap wastes less than the largest slice."""
    n = len(sizes)
    offsets = [0] * n
    failed: set[tuple[int, int, int]] = set()  # (k, offset of k - 1, offset of k): no way on from there

    def spots(k: int) -> list[int]:
        size = sizes[k]
        live = [(offsets[j], offsets[j] + sizes[j]) for j in (k - 1, k - 2) if j >= 0]
        wanted = [live[0][1]] if live else []
        wanted += [0, arena - size]
        for start, stop in live:
            wanted += [stop, start - size]
        return [at for at in dict.fromkeys(wanted)
                if 0 <= at <= arena - size and all(at + size <= start or at >= stop for start, stop in live)]

    left = [spots(0)]
    tried = 0
    while left:
        k = len(left) - 1
        if not left[k]:
            left.pop()
            if k >= 1:
                failed.add((k - 1, offsets[k - 2] if k >= 2 else -1, offsets[k - 1]))
            continue
        offsets[k] = left[k].pop(0)
        tried += 1
        if tried > _SEARCH_BUDGET:
            return None
        if k == n - 1:
            return offsets
        if (k, offsets[k - 1] if k >= 1 else -1, offsets[k]) in failed:
            continue
        left.append(spots(k + 1))
    return None
