"""The float32 masters of a model's slices in files on a local disk (``OffloadModel(...,
masters=DiskTier(path))``): where each slice's host buffer is allocated, and the reads and writes
around each slice's host update.

What this file holds: :class:`MasterFiles`. What it does not: the mapping and its page calls
(``offload/streams/mapped.py``, Note: [Mapped masters]), the optimizer state's files
(``offload/tiers/disk_tier.py``), or when updates run (``offload/optimizer.py``).

Note: [Masters on disk]
    Under a compute dtype, loads read a slice's *shadow* (its copy in that dtype, which stays in
    RAM, unless ``shadows="disk"``: Note: [Shadows on disk] in ``offload/streams/shadow_staging.py``); the float32 masters are read only by the optimizer's update, by the cast that writes
    the shadow, and by whoever reads the parameters. So each slice's host buffer (masters and
    buffers) is a file mapping instead of RAM. Around the update of slice ``k``,
    :class:`MasterFiles` runs, on two host workers of the copy engine:

    1. *read* (before): read slice ``k``'s file in, after the write of the slice that took the
       same turn :data:`~offload.tiers.disk_tier.WINDOW` slices back;
    2. the update itself (the optimizer's worker), which also writes the shadow;
    3. *write* (after the update, or a sharded update's exchange, and after the read): write the
       pages back and drop them.

    The slice's gradients live in a file of their own beside the masters (Note: [Gradients on
    disk] in ``offload/streams/gradient_files.py``): the read takes them too, and the writer
    writes them back after each landing in backward. The update only reads them, so it drops
    them itself when it is done, instead of leaving them to the write: the write of slice
    ``k - 1`` may still be running while slice ``k + 1`` is read in, and RAM then holds two
    slices' gradients where it held three (the write drops them again, after writing back any
    page an optimizer wrote).

    So RAM holds about three slices' masters while the optimizer steps, and none in between;
    the next forward waits for each slice's update only, never for a write. A forward that finds
    a slice's shadow out of date (nothing updated the slice since the last forward: gradient
    accumulation, evaluation, parameters changed by hand) reads its masters in, casts, and
    drops them again, on the calling thread: 4 bytes per parameter read from the disk.

    None of these orderings is needed for the values to be right: a shared mapping is coherent,
    so a page dropped too early is read in again from the file (a dirty page dropped from the
    mapping stays dirty in the page cache), and one read in too late faults in where the update
    touches it. What they bound is RAM, and what they buy is speed (the update does not stop at
    every page); ``tests/test_masters_on_disk.py`` checks the bound, and that it fails without
    the window.

    Errors: a read that fails leaves its slice untouched (a :class:`~offload.HostUpdateError`
    naming the file, as for any failed update, at the next call that waits for updates); a write
    that fails leaves the slice updated in RAM for now, and the next ``synchronize()`` or
    ``step()`` raises :class:`~offload.DiskTierError` naming the file, whatever the slice's later
    writes (its gradients' in the next backward) do. After a failed write the kernel may count the
    pages as written and drop them later, so the slice's masters (or the gradients its update
    reads) may then be read back from what the file held before. So the failure is latched, as an
    update that failed part way is (rule 7 of Note: [An update that failed part way] in
    ``offload/optimizing/partial_failure.py``): the optimizer's ``state_dict()`` and
    ``save_checkpoint`` refuse until a load, so that no checkpoint holds values that may revert and
    ``keep_last`` never deletes the one to reload, which the error names when the optimizer was
    saved into it since its last load. The model keeps the failures too, by slice (numbered with
    the storages', :meth:`MasterFiles.failures`): any ``save_checkpoint`` of it refuses while one
    is latched, naming its last checkpoint saved before the failure (none is saved after it), and
    an optimizer built after the failure takes those latched as its own. A slice's failure ends
    with a load after it that wrote every parameter of that slice that trains (``requires_grad``:
    only an update changes one, so only those may hold what the file does not), whatever else
    the load wrote or left out. So ``load_checkpoint``, or a ``load_state_dict()`` of every
    parameter that trains, ends them all; a ``load_state_dict()`` of a part (``strict=False``
    with an adapter's weights, or with the failed slices' parameters) ends those of the slices
    it wrote whole, and the others stay. The model's load hooks (:func:`watch_loads`) count a
    parameter whose version counter or address moved: not one the load left out, nor one whose
    shape did not fit (the load raises, and that slice stays refused). A slice none of whose
    parameters trains is ended by a load of every parameter of the model that trains. Only such
    a load of every one forgets the checkpoints saved before it (they may hold another line of
    steps than the one loaded). ``load_checkpoint`` drops the failed writes not raised yet
    instead of raising them (:meth:`MasterFiles.replacing`: it replaces what they may revert),
    once its checks passed: a load refused (no checkpoint at the path, one of another model)
    leaves them as they were, for the next wait to raise, and the saves refusing. A write-back
    the slice's storage does itself, on the calling thread (a forward that casts a stale shadow,
    a checkpoint once it is done with the slice), is raised at once and latched the same way, at
    the optimizer's next ``step()``, ``state_dict()`` or save (Note: [A write-back outside the
    masters' writer] in ``offload/streams/masters_io.py``). The files are preallocated, so a full
    disk shows when the model is built. A slice that a rank of a sharded update only receives is
    not read in ahead: the exchange reads its pages in where it writes them (a read error there is
    a ``SIGBUS``, as for your own reads of a parameter).

    A child of ``os.fork()`` shares the mappings with its parent: what it writes into them is the
    parent's masters and gradients. Its first backward, ``step()`` or zeroing of the gradients in
    their files raises, before anything is written (:meth:`MasterFiles.refuse_in_fork_child`;
    rule 4 of Note: [A worker under interrupts and forks] in ``offload/streams/workers.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .disk_tier import WINDOW, DiskTier, DiskTierError
from .masters_latch import MastersLatch
from .slice_update import HostUpdateError, other_slices
from ..streams.backend import Event
from ..streams.copies import CopyStreams
from ..streams.disk import DiskCounters, make_directory
from ..streams.gradient_files import GradientHome
from ..streams.mapped import MappedFile, mapping_supported
from ..streams.masters_io import after_a_failed_write, not_written_back, numbered, why_of
from ..streams.slice_entries import Entry
from ..streams.workers import HostWorker, forks


class MasterFiles(MastersLatch):
    """One model's masters on disk: allocates each slice's host buffer as a :class:`MappedFile` in
    the setting's directory, and reads it in and writes it back around each host update (Note:
    [Masters on disk]); the model's latch of the writes that failed is its base,
    :class:`~offload.tiers.masters_latch.MastersLatch`.

    Args:
        setting: the user's :class:`~offload.DiskTier` (``keep`` is refused: the files are unlinked
            as soon as they are mapped).
        copies: the model's copy engine (host workers and their events).
    """

    def __init__(self, setting: DiskTier, copies: CopyStreams) -> None:
        if setting.keep:
            raise ValueError("DiskTier(keep=True) keeps optimizer state files; the masters' files are removed as "
                             "soon as they are mapped. Save a checkpoint (offload.save_checkpoint) to keep the "
                             "parameters, and pass masters=DiskTier(path) without keep")
        if not mapping_supported():
            raise ValueError("masters on disk need Linux (shared file mappings, posix_fadvise, posix_fallocate, "
                             "preadv); keep them in RAM on this system (masters=None)")
        super().__init__()
        self.directory = Path(setting.path)
        make_directory(self.directory, "masters directory")
        self.copies = copies
        self.counters = DiskCounters()
        self._reader: HostWorker | None = None
        self._writer: HostWorker | None = None
        self._window: list[Event | None] = [None] * WINDOW
        self._turn = 0
        self._turn_of: dict[int, int] = {}
        self._read_of: dict[int, Event] = {}
        self._read_errors: dict[int, tuple[str, Exception]] = {}
        # The gradients' files read in for each slice's update, which drops them when it is done.
        self._gradients_of: dict[int, MappedFile] = {}
        self._write_errors: dict[int, tuple[str, BaseException]] = {}
        self._last_write: Event | None = None
        # The writes of the gradients landed last, by turn: a landing waits for its turn's last write.
        self._landed: list[Event | None] = [None] * WINDOW
        self._landing_turn = 0
        self.made_at_forks = forks()  # see refuse_in_fork_child

    def allocate(self, nbytes: int, what: str = "masters") -> MappedFile:
        """A new file mapping of ``nbytes`` for a slice's host buffer (or, ``what="gradients"``,
        its gradients).

        Raises:
            DiskTierError: the disk has no room for it (or another error making it).
        """
        try:
            return MappedFile(self.directory, nbytes, self.counters, what)
        except OSError as error:
            raise DiskTierError(
                f"could not make a file of {nbytes / 2**20:.1f} MiB for a slice's {what} in {self.directory} "
                f"({error.filename}): {error.strerror} (errno {error.errno}). Free space there, or point "
                "masters=DiskTier(...) at a disk with room for 8 bytes per trainable parameter (masters and "
                "gradients)") from error

    def gradient_home(self, index: int, entries: list[Entry]) -> GradientHome | None:
        """The file for slice ``index``'s gradients (Note: [Gradients on disk]), or ``None`` when
        none of ``entries`` (its parameters) needs one."""
        return GradientHome.for_entries(index, entries, functools.partial(self.allocate, what="gradients"), self)

    # -- around a landing in backward (GradientPaging) --------------------------------------------

    def before_landing(self, home: GradientHome) -> None:
        """Block until the gradients landed :data:`WINDOW` landings ago are written back and
        dropped: RAM holds at most that many slices' landed gradients."""
        self.refuse_in_fork_child("a backward, whose gradients land in them,")
        self.copies.wait_host(self._landed[self._landing_turn % WINDOW])

    def landed(self, home: GradientHome) -> None:
        """Write ``home``'s pages back and drop them, on the writer."""
        self._start_workers()
        assert self._writer is not None
        event = self.copies.submit(self._writer, functools.partial(self._write, home.index, home.file))
        self._landed[self._landing_turn % WINDOW] = event
        self._landing_turn += 1
        self._last_write = event

    # -- around a host update ---------------------------------------------------------------------

    def read(self, index: int, file: MappedFile, gradients: MappedFile | None = None) -> Event:
        """Read slice ``index``'s masters (and its ``gradients``' file, when ``.grad`` is there) in,
        on the reader, once the window has room; the update waits for the returned event and runs
        under :meth:`guard`."""
        self.refuse_in_fork_child("a step's update")
        self._start_workers()
        turn = self._turn % WINDOW
        self._turn += 1
        self._turn_of[index] = turn
        if gradients is not None:
            self._gradients_of[index] = gradients
        # Its turn's last write has dropped that slice's pages: RAM holds at most WINDOW slices.
        event = self.copies.submit(self._reader, functools.partial(self._read, index, file, gradients),
                                   after=[self._window[turn]])
        self._read_of[index] = event
        return event

    def _read(self, index: int, file: MappedFile, gradients: MappedFile | None = None) -> None:
        self._read_errors.pop(index, None)
        try:
            file.read_in()
            if gradients is not None:
                gradients.read_in(write=False)  # the update only reads them: they stay clean, nothing to write back
        except Exception as error:  # noqa: BLE001 - raised by the update (_guarded), in its slice's place
            # Any error, not only an OSError: nothing waits for the reader's events on the
            # caller's thread, so one left to the worker would never be raised, and the worker
            # would skip every read after it.
            self._read_errors[index] = (file.path, error)

    def guard(self, index: int, work: Callable[[], None]) -> Callable[[], None]:
        """``work`` (slice ``index``'s update), refused when its read failed: the slice is left
        as it was."""
        return functools.partial(self._guarded, index, work)

    def _guarded(self, index: int, work: Callable[[], None]) -> None:
        try:
            failed = self._read_errors.pop(index, None)
            if failed is not None:
                path, error = failed
                why = (error.strerror if isinstance(error, OSError) and error.strerror
                       else f"{type(error).__name__}: {error}")
                raise HostUpdateError(
                    f"could not read the masters or gradients of slice {index} from {path} ({why}): slice {index} was "
                    f"left as it was. {other_slices(index)}") from error
            work()
        finally:
            gradients = self._gradients_of.pop(index, None)
            if gradients is not None:
                # Clean pages leave RAM now; the write drops them again, and raises what fails then.
                with contextlib.suppress(OSError):
                    gradients.drop()

    def write(self, index: int, file: MappedFile, after: Event | None, gradients: MappedFile | None = None) -> None:
        """Write slice ``index``'s masters back and drop them, on the writer, after ``after`` (the
        last work that writes them: its update, or the exchange of a sharded update) and after
        their read: an update skipped because an earlier one failed does not wait for its read,
        which would read the pages in again after they were dropped."""
        self._start_workers()
        assert self._writer is not None
        event = self.copies.submit(self._writer, functools.partial(self._write, index, file, gradients),
                                   after=[after, self._read_of.pop(index, None)])
        turn = self._turn_of.pop(index, None)
        if turn is not None:  # not read in by an update of this rank (a sharded update's exchange wrote it)
            self._window[turn] = event
        self._last_write = event

    def refuse_in_fork_child(self, doing: str) -> None:
        """Raise in a child of ``os.fork()``: the files are mapped shared with the parent, and
        ``doing`` would write the parent's masters or gradients (Note: [Masters on disk])."""
        if forks() != self.made_at_forks:
            raise RuntimeError(
                f"this process is a child of os.fork(), and this OffloadModel keeps its float32 masters and their "
                f"gradients in files mapped shared with the parent process ({self.directory}): {doing} here would "
                "change the parent's. Train in the parent only, or start processes with the 'spawn' or 'forkserver' "
                "method (multiprocessing.get_context('spawn')) and build the model and optimizer there.")

    def _start_workers(self) -> None:
        if self._reader is None:
            self._reader = self.copies.new_worker("masters read")
            self._writer = self.copies.new_worker("masters write")
            weakref.finalize(self, self._reader.close)
            weakref.finalize(self, self._writer.close)

    def _write(self, index: int, file: MappedFile, gradients: MappedFile | None = None) -> None:
        try:
            file.write_back()
            if gradients is not None:
                gradients.write_back()
        except Exception as error:  # noqa: BLE001 - raised by flush(), naming the slice and the file
            # Any error: one left to the worker would skip every write after it. Kept until flush()
            # raises it, whatever the slice's later writes do: the kernel may have read its pages
            # back from the file already, and a write of what it read back succeeds.
            path = error.filename if isinstance(error, OSError) and error.filename else file.path
            self._write_errors.setdefault(index, (path, error))
            numbered(path, why_of(error), functools.partial(self._failures.__setitem__, index), "masters or gradients")

    def wait(self) -> None:
        """Wait for every write submitted so far; a failure stays for :meth:`flush` to raise (a
        write keeps its error instead of raising it on the writer)."""
        self.copies.wait_host(self._last_write)

    def flush(self, latch: Callable[[str], str]) -> None:
        """Wait for every write; raise a write that failed (once), having latched it with ``latch``
        (the stepping optimizer's record of failures, ``PartialFailure.unwritten``: Note: [Masters
        on disk], "Errors"), which returns what to reload.

        Raises:
            DiskTierError: masters could not be written back (updated in RAM for now, maybe not for long).
        """
        self.copies.wait_host(self._last_write)
        self._last_write = None
        if not self._write_errors:
            return
        failed, self._write_errors = self._write_errors, {}
        said = {index: (path, why_of(error)) for index, (path, error) in failed.items()}
        files = ", ".join(f"slice {index}: {path}" for index, (path, _) in failed.items())
        reload = latch(not_written_back("masters or gradients", said))
        raise DiskTierError(
            f"could not write the masters or gradients of {len(failed)} slice(s) back to disk ({files}): "
            f"{next(iter(said.values()))[1]}. "
            + after_a_failed_write("save_checkpoint() of this model and this optimizer's state_dict()", reload))

    @contextlib.contextmanager
    def replacing(self) -> Iterator[None]:
        """Around the checks of a load that will replace every slice's values: the failed writes
        not raised yet are held back (the checks wait for the updates, which would raise them),
        then dropped once the checks pass (the load replaces what they may revert; they stay in
        :meth:`failures`), or put back when the load is refused, for the next wait to raise."""
        self.wait()
        held, self._write_errors = self._write_errors, {}
        try:
            yield
        except BaseException:
            self._write_errors = {**self._write_errors, **held}  # a slice's first failure, as _write keeps
            raise


def watch_loads(model: torch.nn.Module, files: MasterFiles | None) -> None:
    """Tell ``files``' :meth:`~MasterFiles.parameters_loaded` of ``model``'s loads (its
    ``load_state_dict()``, and ``load_checkpoint``, which runs its post-hooks); none without files."""
    if files is not None:
        watch = _ModelLoads(files)
        # The public register_load_state_dict_pre_hook (newer torch) registers exactly this.
        model._register_load_state_dict_pre_hook(watch.before, with_module=True)
        model.register_load_state_dict_post_hook(watch.after)


class _ModelLoads:
    """A model's load hooks, for its :class:`MasterFiles` (held weakly): which parameters a load
    wrote (its version counter or address moved, or it was replaced), and whether that was every
    one that trains."""

    def __init__(self, files: MasterFiles | None) -> None:
        self._files = weakref.ref(files) if files is not None else lambda: None
        self._before: dict[int, tuple[int, int]] | None = None

    def before(self, module: torch.nn.Module, *_: Any) -> None:
        self._before = {id(p): (p._version, p.data_ptr()) for p in module.parameters()}

    def after(self, module: torch.nn.Module, _incompatible: Any) -> None:
        files, before, self._before = self._files(), self._before, None
        if files is None:
            return
        present = list(module.parameters())
        # No pre-hook ran: load_checkpoint, which wrote every tensor.
        written = present if before is None else [p for p in present
                                                   if before.get(id(p)) != (p._version, p.data_ptr())]
        ids = {id(p) for p in written}
        if all(id(p) in ids for p in present if p.requires_grad):
            files.parameters_loaded()
        elif written:  # a part (an adapter's weights, strict=False): what it wrote, for the slices it wrote whole
            files.parameters_loaded(written, present)

    def __reduce__(self) -> tuple[Any, ...]:
        # A copied or pickled model takes its hooks along; they watch nothing there.
        return _ModelLoads, (None,)


def place_masters(setting: DiskTier | str | os.PathLike[str] | None, compute_dtype: torch.dtype | None,
                  copies: CopyStreams) -> MasterFiles | None:
    """The :class:`MasterFiles` for ``OffloadModel(..., masters=setting)``, after checking it."""
    if setting is None:
        return None
    if not isinstance(setting, (DiskTier, str, os.PathLike)):
        raise TypeError(f"masters must be None, a DiskTier or a directory path, got {type(setting).__name__}")
    if compute_dtype is None:
        raise ValueError("masters on disk need a compute_dtype (torch.bfloat16, say): loads then read the "
                         "half-precision shadow, which stays in RAM, and only the update reads the float32 masters. "
                         "Without one every load would read the disk; keep the masters in RAM (masters=None)")
    return MasterFiles(setting if isinstance(setting, DiskTier) else DiskTier(setting), copies)
