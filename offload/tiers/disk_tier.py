"""The disk tier: an OffloadOptimizer's per-element state (AdamW's moments, SGD's momentum) kept in
files on a local disk, read and written beside the update instead of held in RAM.

What this file holds: :class:`DiskTier` (the setting the user passes), and :class:`StateTier` (the
reads, updates and writes of each slice's state, in order, and the caller's side: flushes,
failures, the state handed out and loaded). What it does not: one slice's state and its moves
(``state_slice.py``), the window of buffers in RAM (``state_window.py``), the directory and files
(``state_files.py``), the I/O calls themselves (``offload/streams/disk.py``), or how host workers
run and wait (``offload/streams/workers.py``, ``copies.py``). ``DiskTierError`` lives in
``offload/streams/disk.py``, which raises it, and is re-exported here.

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

    The window holds :data:`WINDOW` = 3 slices' state, served in turn: while slice ``k`` is
    updated, slice ``k + 1`` is read into its place and slice ``k - 1`` written from its own; a
    read waits for the write three slices back. Host RAM holds the most three consecutive slices'
    state takes (in whole pages), one arena with a place per slice (Note: [The window's arena] in
    ``state_window.py``), instead of every slice's. The next forward waits for each slice's
    update only, never for a write. The update worker promises no order between slices
    (Note: [Updates in the next forward's order] in ``offload/optimizing/stepping.py``): what keeps
    slice ``k + 3``'s update off the buffer until slice ``k``'s is done with it is that chain, the
    write after the update and the read after the write.

    The results are the RAM-resident optimizer's bit for bit: the optimizer updates the same
    bytes, which go to disk and back unchanged (raw copies of the tensors' memory, strides kept).

Note: [Disk tier failures]
    A read that fails leaves its slice untouched: its update raises before attaching anything
    (a :class:`~offload.HostUpdateError`, at the next call that waits for updates), and, as for
    any failed update, the updates the worker had not started are skipped: from ``step()`` the
    later slices', from backward (``update_in_backward``) those of the slices whose gradients had
    not landed, or not been updated yet (:func:`~offload.tiers.slice_update.other_slices`).

    A write that fails (an I/O error; ``ENOSPC`` when its file is first allocated, since files
    are preallocated with ``posix_fallocate`` and a write into allocated blocks does not need
    space) leaves its slice *updated*, parameters and state, with the state *held* in RAM in the
    buffer it was written from; the window takes a fresh buffer, and the other slices go on.
    The next ``synchronize()``, ``state_dict()`` or ``step()`` raises :class:`DiskTierError`
    naming the files, the bytes they need and the slices held (``step()`` then updates nothing).
    Once space is freed, the next ``step()`` writes the held state first, then steps as usual: so
    the error raised by a wait says the step is done and to carry on (a ``step()`` again with the
    same gradients would apply them twice), and the one raised by ``step()`` to call it again.
    Each place that raises says what is true there (:data:`FLUSHED_AT`).

    With ``update_in_backward``, the backward that ends an accumulation starts the step's
    updates, and their writes fail after it; the step's start moves to that backward:

    1. ``step()`` after it raises a failed write of those updates only once it has started what
       backward left (the slices deferred to ``step()``, resident slices, the parameters outside
       the model): the step is then done, whole, and the error says so and to carry on, as a
       wait's does. Raised first, as without the option, it would leave those slices never
       updated beside the others (a mix of two steps that nothing refuses), and its "call step()
       again" would update the others twice.
    2. The backward that starts the next step's updates writes the held state first, as
       ``step()`` does. If that still fails, it raises before any of its gradients reaches the
       model's parameters and before it is counted, and the accumulation's count starts again
       (``offload/optimizing/in_backward.py``): no update of the step ran, and the error says
       to free space, ``zero_grad()`` and run the batch (every batch of the accumulation) again.
    3. A wait between that backward and ``step()`` says that backward updated those slices, and
       to call ``step()`` once, as usual.

    An interrupt (Ctrl-C's ``KeyboardInterrupt``, or any error) while :meth:`StateTier.submit`
    queues a slice's pieces withdraws nothing already queued: the write is queued after the last
    piece that was, as its worker says (an interrupt may land before its event is returned), tried
    again if it was not queued itself (as its worker says), so a queued update's state
    reaches the file and a queued read's buffer stays taken until it is done; the update's event
    stays known (``StateTier.queued_updates``) for the caller to register with its waits (Note:
    [An update that failed part way], rule 6, in ``offload/optimizing/partial_failure.py``).

    With ``keep=True``, ``close()`` writes held state again before the manifest, and raises
    :class:`DiskTierError` naming the slices it still could not write (their files keep an older
    step's state), or saying that the directory was removed under the optimizer.
"""

from __future__ import annotations

import functools
import os
import pathlib
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .slice_update import HostUpdateError, held_state, other_slices
from .state_files import StateFiles, expected_state_bytes, size_text
from .state_slice import LoadingSlice, Place, SliceRecord, SliceState, goes_to_disk
from .state_window import WINDOW, Window
from ..streams.backend import Event
from ..streams.copies import CopyStreams
from ..streams.disk import AlignedBuffer, DiskTierError
from ..streams.trim import give_back_freed_memory
from ..streams.workers import HostWorker, mark_of, queued_since

__all__ = ["WINDOW", "DiskTier", "DiskTierError", "Place", "StateTier", "expected_state_bytes", "size_text"]


@dataclass(frozen=True)
class DiskTier:
    """Keep an :class:`~offload.OffloadOptimizer`'s per-element state in files on a local disk.

    Every state tensor with at least one dimension (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's
    ``momentum_buffer``) lives in one file per slice; scalars (``step``) stay in
    ``optimizer.state``. Host RAM holds a window of three consecutive slices' state; the update
    reads the next slice's state and writes the previous one's while it computes (Note: [Disk tier
    pipeline] in ``offload/tiers/disk_tier.py``). Results are bit-identical to keeping the state in
    RAM.

    The cost: each step reads and writes the state once (8 bytes per parameter each way for
    AdamW in float32). To stay hidden behind the device's forward, the disk must move that in
    the time of one forward: bytes per parameter per step ÷ disk bandwidth (see
    ``docs/disk-tier.md``).

    Args:
        path: a directory on a local disk (an NVMe drive at best). Each optimizer makes a fresh
            directory inside it (``offload-state-*``), so several optimizers and processes can share
            ``path``. ``~`` is expanded and a relative path made absolute when the ``DiskTier`` is
            made: a later ``os.chdir`` does not move the files.
        keep: leave the files when the optimizer is closed or garbage-collected; ``close()`` also
            writes a ``manifest.json`` describing their layout (for inspection; resume from
            ``optimizer.state_dict()``), after writing again any state held in RAM by a failed
            write (it raises :class:`DiskTierError` naming what it could not keep). Default: removed.
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
        # ``~`` as the shell would expand it: left alone, the files would go to a directory named ``~`` here.
        # Absolute once, now: a relative path read after an ``os.chdir`` would name another directory,
        # where the files made later (a slice's first write, a masters file laid out anew) are not.
        expanded = os.path.abspath(os.path.expanduser(self.path))
        object.__setattr__(self, "path", expanded if isinstance(self.path, str) else pathlib.Path(expanded))
        for name in ("keep", "direct"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                # keep="no" would be truthy and keep the files.
                raise TypeError(f"DiskTier {name} must be True or False, got {value!r}")


class StateTier:
    """The pipeline of one optimizer's disk tier, and the caller's side of it.

    Args:
        setting: the user's :class:`DiskTier`.
        optimizer: the optimizer whose ``state`` it manages (held weakly).
        copies: the copy engine of the optimizer's model (workers and waits).
        rank: this process's rank when the update is sharded (its own state only), else ``None``.
        ranks: how many ranks share the update.
        elsewhere: the ``id`` of each parameter whose state the tier never keeps (a resident
            slice's), left out of the room the files need.
    """

    def __init__(self, setting: DiskTier, optimizer: torch.optim.Optimizer, copies: CopyStreams,
                 rank: int | None = None, ranks: int = 1, elsewhere: Collection[int] = ()) -> None:
        # - The files: they go when the tier does, closed or not.
        self.files = StateFiles(setting.path, setting.keep, setting.direct, optimizer, rank, ranks, elsewhere)
        self.directory, self.direct, self.keep, self.counters = (
            self.files.directory, self.files.direct, self.files.keep, self.files.counters)
        self.copies = copies
        self._optimizer = weakref.ref(optimizer)
        self.records: dict[int, SliceRecord] = {}
        self._window = Window()
        self._last_write: Event | None = None
        self.queued_updates: dict[int, Event] = {}  # each slice's update queued since the last flush, for the caller
        self._freed_state = False  # state copied in from elsewhere and freed since the last flush
        #: Set when a load failed after writing slices (Note: [Slice-by-slice load]): what the mix is.
        self.partly_loaded: str | None = None
        # - Host workers: the reader and writer run beside the update worker (Note: [Disk tier pipeline]).
        self._reader: HostWorker | None = None
        self._writer: HostWorker | None = None
        self.closed = False

    # -- what it holds -----------------------------------------------------------------------------

    @property
    def disk_nbytes(self) -> int:
        """Bytes allocated in the tier's files."""
        return self.files.disk_nbytes

    def _buffers(self) -> list[AlignedBuffer]:
        return self._window.buffers(r.buffer for r in self.records.values()
                                    if r.place is Place.HELD and r.buffer is not None)

    @property
    def window_nbytes(self) -> int:
        """Host RAM of the window (its arena and the slots' own buffers) and of held state."""
        return sum(b.nbytes for b in self._buffers())

    def window_ranges(self) -> list[tuple[int, int]]:
        """The address ranges of the buffers :attr:`window_nbytes` counts (state tensors viewing them
        are not counted again as optimizer state)."""
        return [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in self._buffers()]

    def plan(self, slices: Sequence[tuple[int, list[torch.Tensor]]]) -> None:
        """Serve these slices (index, parameters stepped by this optimizer, in order). A slice whose
        parameters changed gets its state back into ``optimizer.state`` first, to be laid out anew
        at its next update. Nothing may be pending."""
        self.flush()
        wanted = dict(slices)
        files = {}
        for index, record in list(self.records.items()):
            if index in wanted and _same(wanted[index], record.params):
                continue
            record.restore(self._state(), self._window)
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
        _refuse_in_fork_child(self, "a step's update")
        _start_workers(self)
        record = self.records[index]
        slot = self._window.next(index, record.nbytes)
        assert self._writer is not None
        reads, updates, writes = mark_of(self._reader), mark_of(update_worker), mark_of(self._writer)
        write, queued, read = functools.partial(record.write, self.files), None, None  # made now: no call in between
        try:
            # The buffer is free once the write of the slice that used it last has read it.
            queued = read = self.copies.submit(self._reader, functools.partial(record.read, slot, slot.region),
                                               after=[slot.free])
            # The update reads what the read wrote into the buffer.
            queued = self.copies.submit(update_worker, functools.partial(self._update, record, work),
                                        after=[read, *after], key=index)
        finally:  # even when interrupted: what was queued runs (Note: [Disk tier failures])
            last, marks = None, [(self._reader, reads), (update_worker, updates)]
            try:
                last = _queued_last(self, index, queued, read, marks)
                if last is not None:  # the write reads the state the update left
                    slot.free = self._last_write = self.copies.submit(self._writer, write, after=[last])
            except BaseException:  # interrupted here: asked again, and the write queued once
                _write_once(self, slot, write, _queued_last(self, index, queued, read, marks), writes)
                raise
        return last

    def _update(self, record: SliceRecord, work: Callable[[], None]) -> None:
        if record.read_error is not None:
            raise _read_failure(record.index, record.read_error) from record.read_error
        record.attach(self._state())
        try:
            work()
        finally:
            self._detach(record)

    def _detach(self, record: SliceRecord) -> None:
        if record.detach(self._state()):
            self._freed_state = True  # given back to the system at the next flush

    # -- the caller's side ---------------------------------------------------------------------------

    def flush(self, when: str = "wait") -> None:
        """Wait for every write; raise a write failure not raised yet; where a step's updates start
        (``step()``, or the backward that starts them), write held state again first, and raise if
        it still fails (see Note: [Disk tier failures]).

        Args:
            when: what the error says, as the caller stands (:data:`FLUSHED_AT`).

        Raises:
            DiskTierError: state could not be written.
        """
        # The caller reads the records and the files next: the writes must be done.
        self.copies.wait_host(self._last_write)
        self._last_write, self.queued_updates = None, {}
        # Nothing is pending: the next step's turns start afresh (Note: [The window's arena], rule 4).
        self._window.restart([(i, r.nbytes) for i, r in sorted(self.records.items()) if r.layout is not None])
        if self._freed_state:
            # State the tier moved to its files (AdamW's first step creates it in RAM) is freed,
            # but the C heap would keep it resident: bytes per parameter that nothing reuses.
            self._freed_state = False
            give_back_freed_memory()
        held = _to_report([r for r in self.records.values() if r.place is Place.HELD], self.files, when)
        if held:
            raise DiskTierError(_failure_message(self.files, held, when))

    def forget(self, keep: Collection[int] = ()) -> None:
        """``optimizer.state`` was replaced (loaded): what the files hold is no longer the state,
        except in the slices ``keep``, whose files were written with the loaded state
        (:meth:`end_load`). A mix left by a failed load is gone."""
        for index, record in self.records.items():
            if index not in keep:
                record.reset()
        self.partly_loaded = None

    def load_failed(self, written: Sequence[int], source: str) -> str:
        """A load (``source``, as the user called it) raised after :meth:`end_load` wrote slices
        ``written``: their files hold what it loaded, the other slices their own state, and the
        scalars in ``optimizer.state`` may be either. Until a load succeeds (:meth:`forget`),
        :meth:`check_loaded` refuses; returns what it says of the state."""
        self.partly_loaded = _mix_message(written, source)
        return self.partly_loaded

    def check_loaded(self, doing: str) -> None:
        """Raise if a load failed part way (:meth:`load_failed`), or in a fork child: ``doing`` would use the mix."""
        _refuse_in_fork_child(self, doing)
        if self.partly_loaded is not None:
            raise RuntimeError(_partly_loaded(self.partly_loaded, doing))

    def slice_state(self, index: int) -> SliceState:
        """Copies of slice ``index``'s state tensors kept on disk (none for a slice the tier does not
        hold); the caller must have flushed."""
        self._check_open()
        return record.copies(self._window, self._state()) if (record := self.records.get(index)) is not None else {}

    def slice_layout(self, index: int) -> SliceState:
        """Stand-ins for slice ``index``'s state tensors kept on disk, without reading its file: each
        has the tensor's shape and dtype over a single element (zero strides). A checkpoint plans
        from them and reads the slice with :meth:`slice_state` when it writes it."""
        self._check_open()
        return record.stand_ins(self._state()) if (record := self.records.get(index)) is not None else {}

    def add_to_state_dict(self, packed: dict[str, Any], index_of: dict[int, int]) -> None:
        """Put the state on disk into a packed ``state_dict()``, one slice at a time."""
        self._check_open()
        state, packing = self._state(), packed["state"]
        for record in self.records.values():
            for param, tensors in record.copies(self._window, state).items():
                i = index_of[id(param)]
                packing[i] = {**packing.get(i, {}), **tensors}

    def adopt(self) -> None:
        """``optimizer.state`` was just loaded: move each slice's state to disk, one slice at a time
        (the previous files are overwritten), except the slices loaded into their files already
        (:meth:`end_load`); raise what could not be written."""
        slot, state = self._window.slots[0], self._state()
        for record in self.records.values():
            if record.place is not Place.RAM:
                record.own(state)  # loaded by end_load (written, or held after a failed write)
                continue
            record.slot = slot
            record.buffer = slot.buffer
            self._detach(record)
            if record.dirty:
                record.write(self.files)
            record.slot = None
        self.flush("load")

    def keeps(self, index: int, param: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether ``value``, as state of ``param`` in slice ``index``, would be kept on disk."""
        record = self.records.get(index)
        return record is not None and any(p is param for p in record.params) and goes_to_disk(value)

    def begin_load(self, index: int, like: SliceState) -> LoadingSlice:
        """Where a checkpoint loads slice ``index``'s state: a buffer laid out as the slice's file
        (as :meth:`SliceRecord.detach` lays it out), taken from the window (:meth:`Window.for_load`),
        and a view of it for each tensor of ``like`` (tensors of the dtype, shape and strides to
        keep, ``{parameter: {state key: tensor}}``; meta tensors do). Fill the views, then
        :meth:`end_load` writes the buffer (Note: [Slice-by-slice load] in
        ``offload/checkpoint/slice_load_planner.py``). Nothing may be pending.
        """
        self._check_open()
        return LoadingSlice.of(self.records[index], like, self._window)

    def end_load(self, loading: LoadingSlice) -> None:
        """The views of :meth:`begin_load` hold the slice's loaded state: write it to the slice's
        file (the previous file is overwritten); the slice's state is now that. A write that
        fails leaves it held in RAM, in the buffer, as a step's would (Note: [Disk tier
        failures]); :meth:`adopt` raises it once the rest of the state is loaded."""
        loading.store(self.files)

    def _state(self) -> Any:
        optimizer = self._optimizer()
        assert optimizer is not None, "internal error: the disk tier outlived its optimizer"
        return held_state(optimizer)  # on the worker too, inside the update that OffloadOptimizer.state waits for

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this OffloadOptimizer was closed (its disk tier's files are removed); "
                               "make a new one and load_state_dict() a state saved before closing")

    def close(self, index_of: dict[int, int]) -> None:
        """Wait for every queued write, then remove the files (or, with ``keep``, write the manifest
        beside them); idempotent. A fork child only closes its descriptors (``StateFiles.in_fork_child``)."""
        if self.closed:
            return
        self.closed, lost = True, None
        try:
            if not self.files.in_fork_child():
                # The writer may still be writing the last step's slices (the update does not wait for
                # them): a file closed or removed under it would leak, or keep the step before's state.
                self.copies.wait_host(self._last_write)
                lost = _keep(self.files, self.records.values(), index_of) if self.keep else None
        finally:
            self.files.remove()
            # Nothing left to hold: the window goes, and memory_footprint() counts no disk bytes.
            self._window.clear()
            for record in self.records.values():
                record.buffer, record.place = None, Place.RAM
        if lost is not None:
            raise DiskTierError(lost)


def _start_workers(tier: StateTier) -> None:
    """The reader and the writer, started by the first update (Note: [Disk tier pipeline])."""
    if tier._reader is None:
        tier._reader, tier._writer = tier.copies.new_worker("disk read"), tier.copies.new_worker("disk write")
        tier.files.workers += [tier._reader, tier._writer]


def _write_once(tier: StateTier, slot: Any, write: Callable[[], None], after: Event | None, mark: object) -> None:
    """Queue ``write`` on ``tier``'s writer after ``after``, the last piece queued, unless the writer
    queued it since ``mark`` before an interrupt: the state reaches the file once. ``slot`` waits for it."""
    if after is not None:
        written = queued_since(tier._writer, mark)
        slot.free = tier._last_write = (written if written is not None else
                                        tier.copies.submit(tier._writer, write, after=[after]))


def _refuse_in_fork_child(tier: StateTier, doing: str) -> None:
    """Raise in a fork child: ``tier``'s files are its parent's (Note: [A worker under interrupts and forks])."""
    if tier.files.in_fork_child():
        raise RuntimeError(
            f"this process is a child of os.fork(), and this OffloadOptimizer's disk tier keeps its state in files "
            f"that the parent process reads and writes ({tier.directory}): {doing} here would change the parent's "
            "state. Train in the parent only, or start processes with the 'spawn' or 'forkserver' method "
            "(multiprocessing.get_context('spawn')) and build the model and optimizer there.")


def _queued_last(tier: StateTier, index: int, queued: Event | None, read: Event | None,
                 marks: list[tuple[Any, object]]) -> Event | None:
    """The last piece of slice ``index``'s pipeline queued: ``queued``, or, past an interrupt, what the reader and
    the update worker say since their ``marks``. The update's event is kept in ``tier.queued_updates``."""
    (reader, reads), (update_worker, updates) = marks
    update = queued if queued is not read else queued_since(update_worker, updates)
    if update is not None:
        tier.queued_updates[index] = update
        return update
    return read if read is not None else queued_since(reader, reads)


def _read_failure(index: int, error: OSError) -> HostUpdateError:
    """What the update of slice ``index`` raises when its state could not be read (Note: [Disk tier
    failures]): nothing was attached, so the slice is as it was."""
    return HostUpdateError(
        f"could not read the optimizer state of slice {index} from {error.filename} ({error.strerror}): slice "
        f"{index} was left as it was. {other_slices(index)}")


def _keep(files: StateFiles, records: Collection[SliceRecord], index_of: dict[int, int]) -> str | None:
    """With ``keep``, at :meth:`StateTier.close`: write again the state held in RAM after a failed
    write (it goes with the optimizer), then the manifest; what was not kept, or ``None``."""
    held = [r for r in records if r.place is Place.HELD]
    for record in held:
        record.write(files)
    still = [r for r in held if r.place is Place.HELD]
    gone = not files.directory.is_dir()
    try:
        files.write_manifest(_manifest(records, index_of))
    except OSError as error:
        if gone:
            return (f"the kept disk tier's directory {files.directory} was removed while the optimizer used it: "
                    "the state files went with it and nothing was kept. To keep the state, save a checkpoint "
                    "(offload.save_checkpoint, or optimizer.state_dict()) before close(), and leave the directory "
                    "alone while training")
        return (f"could not write the manifest of the kept disk tier in {files.directory} ({error.strerror}, "
                f"errno {error.errno}); the state files are there, without their layout")
    return _not_kept(files, still) if still else None


def _not_kept(files: StateFiles, held: list[SliceRecord]) -> str:
    """What :meth:`StateTier.close` raises when ``held`` slices' state, held in RAM after a failed
    write, could not be written at close either: it went with the optimizer."""
    first = held[0].write_error
    assert first is not None
    indices = ", ".join(str(r.index) for r in held)
    return (f"close() could not write the optimizer state of slice(s) {indices} to {files.directory} "
            f"({first.strerror}, errno {first.errno}): it was held in RAM after a failed write and is gone with the "
            "optimizer, so the kept files of those slices hold an older step's state, or nothing (manifest.json "
            "marks them 'held in RAM'). Free space (or fix the disk) and save a checkpoint before close() to keep it")


def _to_report(held: list[SliceRecord], files: StateFiles, when: str) -> list[SliceRecord]:
    """Of the slices whose state is ``held`` in RAM after a failed write, those ``flush(when)``
    raises for, now marked reported. Once all were reported, only the start of a step's updates
    (``"step"``, ``"backward"``) writes them again (and reports those still held); elsewhere held
    state stays readable (``state_dict()`` works)."""
    if held and all(r.reported for r in held):
        if when not in ("step", "backward"):
            return []  # raised once already
        for record in held:
            record.write(files)
        held = [r for r in held if r.place is Place.HELD]
    for record in held:
        record.reported = True
    return held


def _failure_message(files: StateFiles, held: list[SliceRecord], when: str) -> str:
    """What :class:`DiskTierError` says of the ``held`` slices' failed writes, as ``flush(when)``."""
    first = held[0].write_error
    assert first is not None
    paths = ", ".join(f"{files.path_of(r.index)} ({size_text(r.nbytes)})" for r in held)
    total = sum(r.nbytes for r in held)
    indices = ", ".join(str(r.index) for r in held)
    return (
        f"the disk tier could not write the optimizer state of slice(s) {indices} to {paths}: "
        f"{first.strerror} (errno {first.errno}); {size_text(total)} needed on the filesystem of "
        f"{files.directory}. " + FLUSHED_AT[when])


_HELD = "held in RAM until it is written; every other slice's state is on disk."
_NEXT = ("the next step's updates write the held state first (step(), or with update_in_backward the backward that "
         "starts them).")

#: What :class:`DiskTierError` says, by where :meth:`StateTier.flush` raised it (Note: [Disk tier
#: failures]): what the updates left there, and the way on that applies each step exactly once.
FLUSHED_AT = {
    # At the start of step(): nothing of this step ran yet.
    "step": (f"Those slices' state is {_HELD} This call to step() updated nothing. Free space (or fix the disk) and "
             "call step() again: it writes the held state first, then steps."),
    # At the start of the backward that would start the updates (update_in_backward): it raised before
    # any of its gradients reached the model's parameters, and is not counted.
    "backward": (f"Those slices' state is {_HELD} This backward raised before any of its gradients "
                 "reached the model's parameters, and no update of this step ran. Free space (or fix the disk), "
                 "then zero_grad() and run the batch again (with accumulation_steps, every batch of the "
                 "accumulation), then step(): the backward that starts the updates writes the held state first."),
    # Raised by step() once it started what backward left (update_in_backward): the step is done,
    # and step() again, with .grad still set, would apply it a second time.
    "stepped": ("The step is done: backward updated those slices (parameters and state), their state held in RAM "
                "until it is written, and step() started the updates backward left to it, as usual. Free space (or "
                "fix the disk) and carry on (zero_grad(), the next batch) without calling step() again for this "
                "step: " + _NEXT),
    # Between a backward that started updates and step() (update_in_backward): the step is half done.
    "between": (f"Backward (update_in_backward) updated those slices (parameters and state), their state {_HELD} "
                "Free space (or fix the disk) and call step() once, as usual: it updates the slices backward did "
                "not; " + _NEXT),
    "load": (f"The state is loaded: those slices' state is {_HELD} Free space (or fix the disk) and carry on: "
             + _NEXT),
    # Elsewhere (synchronize(), state_dict()): the update is done, and step() again would apply it twice.
    "wait": (f"The step is done: those slices are updated (parameters and state), their state {_HELD} Free space "
             "(or fix the disk) and carry on (zero_grad(), the next batch) without calling step() again for this "
             "step: " + _NEXT),
}


def _partly_loaded(mix: str, doing: str) -> str:
    """What :meth:`StateTier.check_loaded` raises: ``doing`` would use the ``mix`` a failed load left."""
    return (f"this OffloadOptimizer's state is partly loaded: {mix}. {doing} would use that mix; load a checkpoint "
            "first (load_checkpoint(), or load_state_dict()).")


def _mix_message(written: Sequence[int], source: str) -> str:
    """What the state is after a load (``source``) that raised once slices ``written`` were written."""
    indices = ", ".join(str(index) for index in sorted(written))
    wrote = (f"after writing slice(s) {indices} of its disk tier: those slices hold the checkpoint's state "
             "tensors, the other slices their own" if written else
             "before writing any slice of its disk tier: the state tensors are the optimizer's own")
    return f"{source} failed {wrote}, and each parameter's scalars (step) may be either"


def _manifest(records: Iterable[SliceRecord], index_of: dict[int, int]) -> dict[str, Any]:
    """What each file holds: for each slice, per state tensor, its parameter (as numbered in
    ``state_dict()``), name, dtype, shape, strides and byte offset."""
    return {"slices": [
        {"file": f"slice-{r.index:05d}.state", "place": r.place.value, "fields": [
            {"param": index_of[id(r.params[f.position])], "key": f.key, "dtype": str(f.dtype),
             "shape": list(f.shape), "stride": list(f.stride), "offset": f.offset, "nbytes": f.nbytes}
            for f in r.layout or ()]}
        for r in records]}


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
