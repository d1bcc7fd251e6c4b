"""The disk tier: an OffloadOptimizer's per-element state (AdamW's moments, SGD's momentum) kept in
files on a local disk, read and written beside the update instead of held in RAM.

What this file holds: :class:`DiskTier` (the setting the user passes), :class:`DiskTierError`, and
:class:`StateTier` (the files, the window of buffers in RAM, and the reads, updates and writes
of each slice's state, in order). What it does not: the I/O calls themselves
(``offload/streams/disk.py``), or how host workers run and wait (``offload/streams/workers.py``,
``copies.py``).

Note: [Disk tier pipeline]
    Each slice's state is one file, laid out as the slice's state tensors one after the other
    (each at a 64-byte boundary, the file a whole number of pages). ``step()`` submits, per slice
    ``k`` in slice order, three pieces of work to three host workers:

    1. *read* (the disk reader): read slice ``k``'s file into a window buffer, after the write
       that last used that buffer;
    2. *update* (the update worker): after the read, put views of the buffer into
       ``optimizer.state`` (attach), run the optimizer on the slice, then take the state tensors
       out of ``optimizer.state`` again (detach), copying any tensor the optimizer replaced
       instead of updating in place (its first step creates the state) into the buffer;
    3. *write* (the disk writer): after the update, write the buffer back to the file.

    The window has :data:`WINDOW` = 3 buffers, used in turn: while slice ``k`` is updated, slice
    ``k + 1`` is read into the next buffer and slice ``k - 1`` written from the previous one;
    a read waits for the write three slices back. Host RAM holds three slices' state (the largest
    slice's, rounded up to pages) instead of every slice's. The next forward waits for each
    slice's update only, never for a write.

    The results are the RAM-resident optimizer's bit for bit: the optimizer updates the same
    bytes, which go to disk and back unchanged (raw copies of the tensors' memory, strides kept).

Note: [Disk tier failures]
    A read that fails leaves its slice untouched: its update raises before attaching anything
    (a :class:`~offload.HostUpdateError`, at the next call that waits for updates), and, as for
    any failed update, later slices are left as they were.

    A write that fails (an I/O error; ``ENOSPC`` when its file is first allocated, since files
    are preallocated with ``posix_fallocate`` and a write into allocated blocks does not need
    space) leaves its slice *updated*, parameters and state, with the state *held* in RAM in the
    buffer it was written from; the window takes a fresh buffer, and the other slices go on.
    The next ``synchronize()``, ``state_dict()`` or ``step()`` raises :class:`DiskTierError`
    naming the files, the bytes they need and the slices held (``step()`` then updates nothing).
    Once space is freed, the next ``step()`` writes the held state first, then steps as usual.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .slice_update import HostUpdateError, held_state
from ..streams.backend import Event
from ..streams.copies import CopyStreams
from ..streams.disk import PAGE, AlignedBuffer, DiskCounters, DiskTierError, StateFile, direct_io_supported, make_directory, page_aligned
from ..streams.host_storage import dense_stride
from ..streams.trim import give_back_freed_memory
from ..streams.workers import HostWorker

#: Buffers in the window: one read, one updated, one written (see Note: [Disk tier pipeline]).
WINDOW = 3
#: Each state tensor starts at a multiple of this many bytes in a slice's file (vector loads).
TENSOR_ALIGNMENT = 64


@dataclass(frozen=True)
class DiskTier:
    """Keep an :class:`~offload.OffloadOptimizer`'s per-element state in files on a local disk.

    Every state tensor with at least one dimension (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's
    ``momentum_buffer``) lives in one file per slice; scalars (``step``) stay in
    ``optimizer.state``. Host RAM holds a window of three slices' state; the update reads the
    next slice's state and writes the previous one's while it computes (Note: [Disk tier pipeline]
    in ``offload/tiers/disk_tier.py``). Results are bit-identical to keeping the state in RAM.

    The cost: each step reads and writes the state once (8 bytes per parameter each way for
    AdamW in float32). To stay hidden behind the device's forward, the disk must move that in
    the time of one forward: bytes per parameter per step ÷ disk bandwidth (see
    ``docs/disk-tier.md``).

    Args:
        path: a directory on a local disk (an NVMe drive at best). Each optimizer makes a fresh
            directory inside it (``offload-state-*``), so several optimizers and processes can share
            ``path``.
        keep: leave the files when the optimizer is closed or garbage-collected; ``close()`` also
            writes a ``manifest.json`` describing their layout (for inspection; resume from
            ``optimizer.state_dict()``). Default: removed.
        direct: use direct I/O (``O_DIRECT``) where the filesystem takes it. With ``False`` the
            page cache keeps a second copy of the state in RAM (it can be reclaimed, but it is
            counted as used memory until then) and reads may seem faster than the disk.

    Example::

        >>> optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True,
        ...                              disk_tier=DiskTier("/nvme/offload"))
        >>> with optimizer:               # the files are removed on leaving
        ...     train(model, optimizer)
    """

    path: str | os.PathLike[str]
    keep: bool = False
    direct: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise TypeError(f"DiskTier path must be a directory path (a str or os.PathLike), got {self.path!r}")
        for name in ("keep", "direct"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                # keep="no" would be truthy and keep the files.
                raise TypeError(f"DiskTier {name} must be True or False, got {value!r}")


class Place(enum.Enum):
    """Where a slice's state is between updates."""

    RAM = "in optimizer.state"  # no state on disk yet (before its first update, or after loading)
    DISK = "on disk"  # in the slice's file; optimizer.state keeps only the scalars
    HELD = "held in RAM"  # its write failed: the buffer it was written from holds it


@dataclass(frozen=True)
class Field:
    """One state tensor of a slice's file."""

    position: int  # the parameter's position in the slice
    key: str  # its name in the parameter's state ("exp_avg")
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int  # bytes from the start of the file
    nbytes: int

    def view(self, buffer: AlignedBuffer) -> torch.Tensor:
        flat = buffer.tensor[self.offset:self.offset + self.nbytes].view(self.dtype)
        return flat.as_strided(self.shape, self.stride)


@dataclass
class WindowSlot:
    """One buffer of the window, and the write that last read it."""

    buffer: AlignedBuffer | None = None
    free: Event | None = None


@dataclass
class SliceRecord:
    """One slice's state in the tier."""

    index: int
    params: list[torch.Tensor]
    file: StateFile | None = None
    layout: list[Field] | None = None
    nbytes: int = 0  # the file's size: the layout's bytes, in whole pages
    place: Place = Place.RAM
    buffer: AlignedBuffer | None = None  # between its read and its write, or while held
    slot: WindowSlot | None = None
    dirty: bool = False  # the buffer holds state the file does not
    read_error: OSError | None = None
    write_error: OSError | None = None
    reported: bool = True  # its write error was raised to the caller


@dataclass
class LoadingSlice:
    """A slice's state being loaded from a checkpoint (:meth:`StateTier.begin_load`): its file's
    layout, and the buffer in that layout that the loader fills through ``tensors``."""

    record: SliceRecord
    layout: list[Field]
    nbytes: int
    buffer: AlignedBuffer
    slot: WindowSlot  # where the buffer goes once written
    tensors: dict[torch.Tensor, dict[str, torch.Tensor]] = field(default_factory=dict)  # views of buffer


def _make_tier_directory(root: Path, setting: DiskTier, optimizer: torch.optim.Optimizer, rank: int | None,
                         ranks: int) -> tuple[Path, bool]:
    """The tier's own directory in ``root`` and whether it takes direct I/O, once the filesystem has
    room for the state and a test page written there came back; raises :class:`DiskTierError`
    (leaving nothing behind) otherwise."""
    # Before any long work: a tier that cannot hold the state would fail at the first step.
    needed = expected_state_bytes(optimizer) // ranks + PAGE
    free = shutil.disk_usage(root).free
    if free < needed:
        raise DiskTierError(
            f"the disk tier needs about {size_text(needed)} in {root} for the optimizer's state "
            f"({getattr(optimizer, 'optimizer_class', type(optimizer)).__name__} over "
            f"{sum(p.numel() for g in optimizer.param_groups for p in g['params']):,} parameters"
            f"{f', one rank of {ranks}' if ranks > 1 else ''}), and its filesystem has "
            f"{size_text(free)} free. Free space there, or point DiskTier at a disk with room.")
    prefix = "offload-state-" + (f"rank{rank}-" if rank is not None else "")
    try:
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=root))  # unique, made atomically
    except OSError as error:
        raise DiskTierError(f"could not make the disk tier's directory in {root}: {error.strerror} "
                            f"(errno {error.errno}); {size_text(free)} free there") from error
    try:
        return directory, setting.direct and direct_io_supported(directory)
    except OSError as error:
        shutil.rmtree(directory, ignore_errors=True)
        raise DiskTierError(
            f"the disk tier could not write a test page in {directory} ({error.filename}): {error.strerror} "
            f"(errno {error.errno}); the filesystem of {root} has {size_text(shutil.disk_usage(root).free)} "
            f"free and the state needs about {size_text(needed)}. Free space there, or point DiskTier at "
            "another disk.") from error


def expected_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-element state ``optimizer`` will keep on disk, for the optimizers whose state is
    known (Adam and AdamW: two tensors like each parameter, three with ``amsgrad``; SGD: one with
    momentum); 0 for others, whose state is not guessed."""
    kind = getattr(optimizer, "optimizer_class", type(optimizer))  # an OffloadOptimizer's torch.optim class
    total = 0
    for group in optimizer.param_groups:
        if issubclass(kind, (torch.optim.Adam, torch.optim.AdamW)):
            per_element = 3 if group.get("amsgrad") else 2
        elif issubclass(kind, torch.optim.SGD):
            per_element = 1 if group.get("momentum") else 0
        else:
            return 0
        total += per_element * sum(p.numel() * p.element_size() for p in group["params"])
    return total


def _goes_to_disk(value: Any) -> bool:
    # Plain tensors only: a subclass (torchao's 8- and 4-bit moments, codes and scales behind one
    # tensor) would be written as the float values it stands for and come back as another kind of
    # state. Such state stays in optimizer.state, in RAM (Note: [Low-bit state stays in RAM]).
    return (type(value) is torch.Tensor and value.dim() > 0 and value.layout == torch.strided
            and value.device.type == "cpu" and not value.requires_grad
            and (value.is_contiguous() or dense_stride(value) is not None))


def _note_state_kept_in_ram(state: Any, params: Sequence[torch.Tensor]) -> None:
    """Warn (once per kind) of per-element state the tier leaves in RAM.

    Note: [Low-bit state stays in RAM]
        torchao's low-bit optimizers keep each moment as a tensor subclass (8- or 4-bit codes
        and a scale per block) whose bytes are not its values: copying it into a file buffer would
        store the float values it stands for, and the update would read back another kind of
        state. The tier leaves such state in ``optimizer.state``; it is already a quarter (8-bit)
        or an eighth (4-bit) of float32 AdamW's. ``tests/test_lowbit_optimizers.py`` checks the
        results stay bit-identical with the tier configured.
    """
    for p in params:
        for value in state.get(p, {}).values():
            kind = type(value)
            if isinstance(value, torch.Tensor) and kind is not torch.Tensor and value.dim() > 0 \
                    and kind not in _KEPT_IN_RAM_NOTED:
                _KEPT_IN_RAM_NOTED.add(kind)
                warnings.warn(f"the disk tier keeps plain tensors only: optimizer state of type {kind.__name__} "
                              "stays in RAM (for torchao's low-bit optimizers, already a quarter or less of "
                              "float32 AdamW's state)", stacklevel=2)


_KEPT_IN_RAM_NOTED: set[type] = set()


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


class StateTier:
    """The files, the window and the pipeline of one optimizer's disk tier.

    Args:
        setting: the user's :class:`DiskTier`.
        optimizer: the optimizer whose ``state`` it manages (held weakly).
        copies: the copy engine of the optimizer's model (workers and waits).
        rank: this process's rank when the update is sharded (its own state only), else ``None``.
    """

    def __init__(self, setting: DiskTier, optimizer: torch.optim.Optimizer, copies: CopyStreams,
                 rank: int | None = None, ranks: int = 1) -> None:
        root = Path(setting.path)
        made = make_directory(root, "DiskTier path")
        try:
            self.directory, self.direct = _make_tier_directory(root, setting, optimizer, rank, ranks)
        except BaseException:
            if made:
                with contextlib.suppress(OSError):  # another process may have put files there since
                    root.rmdir()  # nothing of the tier is left behind, not even the directory it made
            raise
        self.keep = setting.keep
        self.counters = DiskCounters()
        self.copies = copies
        self._optimizer = weakref.ref(optimizer)
        self.records: dict[int, SliceRecord] = {}
        self._window = [WindowSlot() for _ in range(WINDOW)]
        self._turn = 0
        self._last_write: Event | None = None
        self._freed_state = False  # state copied in from elsewhere and freed since the last flush
        #: Set when a load failed after writing slices (Note: [Slice-by-slice load]): what the mix is.
        self.partly_loaded: str | None = None
        # - Host workers: the reader and writer run beside the update worker (Note: [Disk tier pipeline]).
        self._reader: HostWorker | None = None
        self._writer: HostWorker | None = None
        self._files: list[StateFile] = []
        self.closed = False
        self._workers_to_close: list[HostWorker] = []
        # Files go when the optimizer does, closed or not (never named after object ids: each
        # optimizer has its own directory).
        self._finalizer = weakref.finalize(self, _remove, self.directory, self._files, self.keep,
                                           self._workers_to_close)

    # -- what it holds -----------------------------------------------------------------------------

    @property
    def disk_nbytes(self) -> int:
        """Bytes allocated in the tier's files."""
        return sum(f.allocated for f in self._files)

    @property
    def window_nbytes(self) -> int:
        """Host RAM of the window's buffers and of held state."""
        buffers = {id(s.buffer): s.buffer.nbytes for s in self._window if s.buffer is not None}
        buffers.update({id(r.buffer): r.buffer.nbytes for r in self.records.values()
                        if r.place is Place.HELD and r.buffer is not None})
        return sum(buffers.values())

    def window_ranges(self) -> list[tuple[int, int]]:
        """The address ranges of the buffers :attr:`window_nbytes` counts (state tensors viewing them
        are not counted again as optimizer state)."""
        buffers = [s.buffer for s in self._window if s.buffer is not None]
        buffers += [r.buffer for r in self.records.values() if r.place is Place.HELD and r.buffer is not None]
        return [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in buffers]

    def plan(self, slices: Sequence[tuple[int, list[torch.Tensor]]]) -> None:
        """Serve these slices (index, parameters stepped by this optimizer, in order). A slice whose
        parameters changed gets its state back into ``optimizer.state`` first, to be laid out anew
        at its next update. Nothing may be pending."""
        self.flush()
        wanted = dict(slices)
        files: dict[int, StateFile] = {}
        for index, record in list(self.records.items()):
            if index in wanted and _same(wanted[index], record.params):
                continue
            self._restore(record)
            if record.file is not None:
                files[index] = record.file  # the slice's file, overwritten at its next write
            del self.records[index]
        for index, params in slices:
            if index not in self.records:
                self.records[index] = SliceRecord(index, list(params), file=files.get(index))

    # -- the pipeline --------------------------------------------------------------------------------

    def submit(self, index: int, update_worker: HostWorker, work: Callable[[], None],
               after: Sequence[Event | None] = ()) -> Event:
        """Read slice ``index``'s state, run ``work`` (its update) with the state attached, after
        ``after`` too, write it back; returns the update's event (the next load of the slice waits
        for it only)."""
        self._check_open()
        if self._reader is None:
            self._reader = self.copies.new_worker("disk read")
            self._writer = self.copies.new_worker("disk write")
            self._workers_to_close += [self._reader, self._writer]
        assert self._writer is not None
        record = self.records[index]
        slot = self._window[self._turn % WINDOW]
        self._turn += 1
        # The buffer is free once the write of the slice that used it last has read it.
        read = self.copies.submit(self._reader, functools.partial(self._read, record, slot), after=[slot.free])
        # The update reads what the read wrote into the buffer.
        update = self.copies.submit(update_worker, functools.partial(self._update, record, work), after=[read, *after])
        # The write reads the state the update left.
        write = self.copies.submit(self._writer, functools.partial(self._write, record), after=[update])
        slot.free = write
        self._last_write = write
        return update

    def _read(self, record: SliceRecord, slot: WindowSlot) -> None:
        record.read_error = None
        record.slot = slot
        if record.place is Place.HELD:
            return  # its buffer holds it
        if record.place is Place.RAM:
            record.buffer = slot.buffer  # detach copies the state in (growing it if needed)
            return
        if slot.buffer is None or slot.buffer.nbytes < record.nbytes:
            slot.buffer = AlignedBuffer(record.nbytes)
        assert record.file is not None
        try:
            record.file.read(slot.buffer, record.nbytes)
        except OSError as error:
            record.read_error = error
            return
        record.buffer = slot.buffer

    def _update(self, record: SliceRecord, work: Callable[[], None]) -> None:
        if record.read_error is not None:
            error = record.read_error
            raise HostUpdateError(
                f"could not read the optimizer state of slice {record.index} from {error.filename} "
                f"({error.strerror}): slice {record.index} and the slices after it were left as they were; "
                "slices before it are updated") from error
        self._attach(record)
        try:
            work()
        finally:
            self._detach(record)

    def _attach(self, record: SliceRecord) -> None:
        """Views of the buffer into ``optimizer.state``, in the layout's order."""
        if record.place is Place.RAM:
            return
        assert record.buffer is not None and record.layout is not None
        state = self._state()
        for f in record.layout:
            state[record.params[f.position]][f.key] = f.view(record.buffer)

    def _detach(self, record: SliceRecord) -> None:
        """Take the slice's state tensors out of ``optimizer.state`` into the buffer."""
        state = self._state()
        found = [(position, key, value) for position, p in enumerate(record.params) if p in state
                 for key, value in state[p].items() if _goes_to_disk(value)]
        _note_state_kept_in_ram(state, record.params)
        if not found:
            return
        layout, nbytes = _layout(found)
        buffer = record.buffer
        in_place = (record.layout is not None and buffer is not None and _shape_of(layout) == _shape_of(record.layout)
                    and all(value.data_ptr() == buffer.data_ptr() + f.offset
                            for f, (_, _, value) in zip(layout, found)))
        if not in_place:
            inside = buffer is not None and any(
                buffer.data_ptr() <= value.data_ptr() < buffer.data_ptr() + buffer.nbytes for _, _, value in found)
            if buffer is None or buffer.nbytes < nbytes or inside:
                fresh = AlignedBuffer(nbytes)
                slot = record.slot
                if slot is not None and (slot.buffer is None or slot.buffer is buffer):
                    slot.buffer = fresh  # the window's buffer grows (it is this slice's until its write)
                buffer = fresh
            for f, (_, _, value) in zip(layout, found):
                f.view(buffer).copy_(value)
            # The state was elsewhere (created by the optimizer, or loaded): it is freed below.
            self._freed_state = True
        for f in layout:
            del state[record.params[f.position]][f.key]
        record.layout, record.nbytes, record.buffer, record.dirty = layout, nbytes, buffer, True

    def _write(self, record: SliceRecord) -> None:
        if not record.dirty:
            return  # its update did not run (an earlier update failed): the file is current
        assert record.buffer is not None
        try:
            if record.file is None:
                record.file = StateFile(self.directory / f"slice-{record.index:05d}.state", self.direct, self.counters)
                self._files.append(record.file)
            record.file.reserve(record.nbytes)
            record.file.write(record.buffer, record.nbytes)
        except OSError as error:
            if record.place is not Place.HELD or record.write_error is None:
                record.reported = False
            record.write_error = error
            record.place = Place.HELD
            slot = record.slot
            if slot is not None and slot.buffer is record.buffer:
                slot.buffer = None  # the buffer stays with the slice; the window takes a new one
            return
        record.place, record.dirty, record.write_error, record.reported = Place.DISK, False, None, True
        record.buffer = None

    # -- the caller's side ---------------------------------------------------------------------------

    def flush(self, when: str = "wait") -> None:
        """Wait for every write; raise a write failure not raised yet; at the start of ``step()``,
        write held state again first, and raise if it still fails (see Note: [Disk tier failures]).

        Args:
            when: ``"step"`` at the start of ``step()`` (which then updates nothing), ``"load"``
                after ``load_state_dict()``, ``"wait"`` elsewhere: what the error says.

        Raises:
            DiskTierError: state could not be written.
        """
        # The caller reads the records and the files next: the writes must be done.
        self.copies.wait_host(self._last_write)
        self._last_write = None
        if self._freed_state:
            # State the tier moved to its files (AdamW's first step creates it in RAM) is freed,
            # but the C heap would keep it resident: bytes per parameter that nothing reuses.
            self._freed_state = False
            give_back_freed_memory()
        held = [r for r in self.records.values() if r.place is Place.HELD]
        if not held:
            return
        if all(r.reported for r in held):
            if when != "step":
                return  # raised once already: held state stays readable (state_dict() still works)
            for record in held:
                self._write(record)
            held = [r for r in held if r.place is Place.HELD]
            if not held:
                return
        for record in held:
            record.reported = True
        raise DiskTierError(self._failure_message(held, when))

    def forget(self, keep: Collection[int] = ()) -> None:
        """``optimizer.state`` was replaced (loaded): what the files hold is no longer the state,
        except in the slices ``keep``, whose files were written with the loaded state
        (:meth:`end_load`). A mix left by a failed load is gone."""
        for index, record in self.records.items():
            if index not in keep:
                _reset(record)
        self.partly_loaded = None

    def load_failed(self, written: Sequence[int], source: str) -> str:
        """A load (``source``, as the user called it) raised after :meth:`end_load` wrote slices
        ``written``: their files hold what it loaded, the other slices their own state, and the
        scalars in ``optimizer.state`` may be either. Until a load succeeds (:meth:`forget`),
        :meth:`check_loaded` refuses; returns what it says of the state."""
        indices = ", ".join(str(index) for index in sorted(written))
        wrote = (f"after writing slice(s) {indices} of its disk tier: those slices hold the checkpoint's state "
                 "tensors, the other slices their own" if written else
                 "before writing any slice of its disk tier: the state tensors are the optimizer's own")
        self.partly_loaded = f"{source} failed {wrote}, and each parameter's scalars (step) may be either"
        return self.partly_loaded

    def check_loaded(self, doing: str) -> None:
        """Raise if a load failed part way (:meth:`load_failed`): ``doing`` would use the mix."""
        if self.partly_loaded is not None:
            raise RuntimeError(
                f"this OffloadOptimizer's state is partly loaded: {self.partly_loaded}. {doing} would use that mix; "
                "load a checkpoint first (load_checkpoint(), or load_state_dict()).")

    def _failure_message(self, held: list[SliceRecord], when: str) -> str:
        first = held[0].write_error
        assert first is not None
        files = ", ".join(f"{self.directory / f'slice-{r.index:05d}.state'} ({size_text(r.nbytes)})" for r in held)
        total = sum(r.nbytes for r in held)
        indices = ", ".join(str(r.index) for r in held)
        if when == "load":
            where = ("The state is loaded: those slices' state is held in RAM until it is written, every other "
                     "slice's is on disk. ")
        else:
            where = ("Those slices are updated (parameters and state) and their state is held in RAM until it is "
                     "written; every other slice's state is on disk. ")
            if when == "step":
                where += "This call to step() updated nothing. "
        return (
            f"the disk tier could not write the optimizer state of slice(s) {indices} to {files}: "
            f"{first.strerror} (errno {first.errno}); {size_text(total)} needed on the filesystem of "
            f"{self.directory}. " + where
            + "Free space (or fix the disk) and call step() again: it writes the held state first.")

    def state_of(self, record: SliceRecord) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Copies of the slice's state tensors, read from its file (or its held buffer); the caller
        must have flushed."""
        if record.place is Place.RAM or record.layout is None:
            return {}
        buffer = record.buffer
        if record.place is Place.DISK:
            slot = self._window[0]
            if slot.buffer is None or slot.buffer.nbytes < record.nbytes:
                slot.buffer = AlignedBuffer(record.nbytes)
            buffer = slot.buffer
            assert record.file is not None
            try:
                record.file.read(buffer, record.nbytes)
            except OSError as error:
                raise DiskTierError(f"could not read the optimizer state of slice {record.index} from "
                                    f"{error.filename}: {error.strerror}") from error
        assert buffer is not None
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for f in record.layout:
            out.setdefault(record.params[f.position], {})[f.key] = f.view(buffer).clone(
                memory_format=torch.preserve_format)
        return out

    def slice_state(self, index: int) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Copies of slice ``index``'s state tensors kept on disk (none for a slice the tier does not
        hold); the caller must have flushed."""
        self._check_open()
        record = self.records.get(index)
        return self.state_of(record) if record is not None else {}

    def slice_layout(self, index: int) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Stand-ins for slice ``index``'s state tensors kept on disk, without reading its file: each
        has the tensor's shape and dtype over a single element (zero strides). A checkpoint plans
        from them and reads the slice with :meth:`slice_state` when it writes it."""
        self._check_open()
        record = self.records.get(index)
        if record is None or record.place is Place.RAM or record.layout is None:
            return {}
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for f in record.layout:
            out.setdefault(record.params[f.position], {})[f.key] = torch.zeros((), dtype=f.dtype).expand(f.shape)
        return out

    def add_to_state_dict(self, packed: dict[str, Any], index_of: dict[int, int]) -> None:
        """Put the state on disk into a packed ``state_dict()``, one slice at a time."""
        self._check_open()
        state = packed["state"]
        for record in self.records.values():
            for param, tensors in self.state_of(record).items():
                i = index_of[id(param)]
                state[i] = {**state.get(i, {}), **tensors}

    def adopt(self) -> None:
        """``optimizer.state`` was just loaded: move each slice's state to disk, one slice at a time
        (the previous files are overwritten), except the slices loaded into their files already
        (:meth:`end_load`); raise what could not be written."""
        slot = self._window[0]
        for record in self.records.values():
            if record.place is not Place.RAM:
                continue  # loaded by end_load (written, or held after a failed write)
            record.slot = slot
            record.buffer = slot.buffer
            self._detach(record)
            if record.dirty:
                self._write(record)
            record.slot = None
        self.flush("load")

    def keeps(self, index: int, param: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether ``value``, as state of ``param`` in slice ``index``, would be kept on disk."""
        record = self.records.get(index)
        return record is not None and any(p is param for p in record.params) and _goes_to_disk(value)

    def begin_load(self, index: int, like: dict[torch.Tensor, dict[str, torch.Tensor]]) -> LoadingSlice:
        """Where a checkpoint loads slice ``index``'s state: a buffer laid out as the slice's file
        (as :meth:`_detach` lays it out), and a view of it for each tensor of ``like`` (tensors of
        the dtype, shape and strides to keep, ``{parameter: {state key: tensor}}``; meta tensors
        do). Fill the views, then :meth:`end_load` writes the buffer (Note: [Slice-by-slice load]
        in ``offload/checkpoint/slice_load_planner.py``). Nothing may be pending.

        A buffer of the window serves: the smallest one large enough, else (too small) the largest
        is let go and the slice's new buffer takes its place once written. A slice loaded while
        others hold the window's buffers gets a buffer of its own.
        """
        self._check_open()
        record = self.records[index]
        found = [(position, key, value) for position, p in enumerate(record.params) if p in like
                 for key, value in like[p].items()]
        assert found and len(found) == sum(map(len, like.values())), \
            f"internal error: state to load into slice {index} is not of its parameters"
        layout, nbytes = _layout(found)
        fits = [s for s in self._window if s.buffer is not None and s.buffer.nbytes >= nbytes]
        slot = (min(fits, key=lambda s: s.buffer.nbytes) if fits  # type: ignore[union-attr]
                else max(self._window, key=lambda s: -1 if s.buffer is None else s.buffer.nbytes))
        buffer, slot.buffer = slot.buffer, None  # this slice's until it is written
        if buffer is None or buffer.nbytes < nbytes:
            buffer = AlignedBuffer(nbytes)
        loading = LoadingSlice(record, layout, nbytes, buffer, slot)
        for f in layout:
            loading.tensors.setdefault(record.params[f.position], {})[f.key] = f.view(buffer)
        return loading

    def end_load(self, loading: LoadingSlice) -> None:
        """The views of :meth:`begin_load` hold the slice's loaded state: write it to the slice's
        file (the previous file is overwritten); the slice's state is now that. A write that
        fails leaves it held in RAM, in the buffer, as a step's would (Note: [Disk tier
        failures]); :meth:`adopt` raises it once the rest of the state is loaded."""
        record = loading.record
        _reset(record)  # whatever the slice held is replaced
        record.layout, record.nbytes, record.buffer, record.dirty = loading.layout, loading.nbytes, loading.buffer, True
        record.slot = None  # a failed write keeps the buffer with the slice
        self._write(record)
        slot = loading.slot
        if record.place is Place.DISK and (slot.buffer is None or slot.buffer.nbytes < loading.buffer.nbytes):
            slot.buffer = loading.buffer  # back to the window, for the next slice and the next step
        loading.tensors = {}

    def _restore(self, record: SliceRecord) -> None:
        """Bring a slice's state back into ``optimizer.state`` (its parameters changed)."""
        state = self._state()
        for param, tensors in self.state_of(record).items():
            state[param].update(tensors)
        record.place, record.buffer = Place.RAM, None

    def _state(self) -> Any:
        optimizer = self._optimizer()
        assert optimizer is not None, "internal error: the disk tier outlived its optimizer"
        return held_state(optimizer)  # on the worker too, inside the update that OffloadOptimizer.state waits for

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this OffloadOptimizer was closed (its disk tier's files are removed); "
                               "make a new one and load_state_dict() a state saved before closing")

    def manifest(self, index_of: dict[int, int]) -> dict[str, Any]:
        """What each file holds: for each slice, per state tensor, its parameter (as numbered in
        ``state_dict()``), name, dtype, shape, strides and byte offset."""
        return {"slices": [
            {"file": f"slice-{r.index:05d}.state", "place": r.place.value, "fields": [
                {"param": index_of[id(r.params[f.position])], "key": f.key, "dtype": str(f.dtype),
                 "shape": list(f.shape), "stride": list(f.stride), "offset": f.offset, "nbytes": f.nbytes}
                for f in r.layout or ()]}
            for r in self.records.values()]}

    def close(self, index_of: dict[int, int]) -> None:
        """Wait for every queued write, then remove the files (or, with ``keep``, write the manifest
        beside them); idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            # The writer may still be writing the last step's slices (the update does not wait for
            # them): a file closed or removed under it would leak, or keep the step before's state.
            self.copies.wait_host(self._last_write)
            self._last_write = None
            if self.keep:
                (self.directory / "manifest.json").write_text(json.dumps(self.manifest(index_of), indent=1))
        finally:
            self._finalizer()
        # Nothing left to hold: the window goes, and memory_footprint() counts no disk bytes.
        self._window = [WindowSlot() for _ in range(WINDOW)]
        for record in self.records.values():
            record.buffer = None
            record.place = Place.RAM


def _remove(directory: Path, files: list[StateFile], keep: bool, workers: list[HostWorker]) -> None:
    for worker in workers:
        worker.close()
    for file in files:
        file.close()
    if not keep:
        shutil.rmtree(directory, ignore_errors=True)


def _reset(record: SliceRecord) -> None:
    """The slice holds no state in the tier (its file, if any, is overwritten at its next write)."""
    record.place, record.layout, record.buffer, record.dirty = Place.RAM, None, None, False
    record.write_error, record.reported = None, True


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _shape_of(layout: Sequence[Field]) -> list[tuple[Any, ...]]:
    return [(f.position, f.key, f.dtype, f.shape, f.stride) for f in layout]


def _layout(found: Sequence[tuple[int, str, torch.Tensor]]) -> tuple[list[Field], int]:
    """A slice's file for its state tensors ``found`` ((position, key, tensor), in that order):
    each tensor's place, and the file's size in whole pages. One function for a step's
    (:meth:`StateTier._detach`) and a load's (:meth:`StateTier.begin_load`): the file a step
    reads back is laid out as the one it wrote."""
    fields = []
    offset = 0
    for position, key, value in found:
        nbytes = value.numel() * value.element_size()
        fields.append(Field(position, key, value.dtype, value.shape, tuple(value.stride()), offset, nbytes))
        offset += -(-nbytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
    return fields, page_aligned(fields[-1].offset + fields[-1].nbytes)
