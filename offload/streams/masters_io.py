"""The reads and write-backs of a slice's masters on disk that its storage does itself, on the
calling thread (``SliceStorage.refresh_shadow`` and ``release_masters`` in ``host_storage.py``),
the :class:`~offload.DiskTierError` each raises, and the record a failed write-back leaves on the
storage (:class:`Unwritten`) for the optimizer's refusals; and the words that every error of a
failed write-back of masters says, here and in ``offload/tiers/master_files.py``.

What it does not hold: the mapping and its page calls (``mapped.py``), the reads and writes around
a host update, on the masters' workers, which keep their own failures (``MasterFiles`` in
``offload/tiers/master_files.py``), or the refusals (``offload/optimizing/partial_failure.py``).

Note: [A write-back outside the masters' writer]
    Besides the masters' writer, which writes a slice back after its update (Note: [Masters on
    disk] in ``offload/tiers/master_files.py``), the slice's storage writes its masters back
    itself wherever something else read them in or wrote them: a forward that casts a stale
    shadow, ``save_checkpoint`` and ``load_checkpoint`` once they are done with a slice (and at
    their end), ``load_sequential``, a build. A write-back that fails there leaves the values in
    RAM for now, but the kernel may drop the pages and read back what the file held before, as
    after a failed write on the writer; and a caller that catches the error goes on. So it is
    raised at once to the caller, and recorded on the storage (``SliceStorage.unwritten``, the
    last failure of each slice) for the model, whose saves refuse until a load of its parameters
    (``MasterFiles.refuse_unwritten``), and for its ``OffloadOptimizer``, which latches it as rule
    7 of Note: [An update that failed part way] says, at its next ``step()``, ``state_dict()`` or
    save (which then refuses). The storage knows neither its slice's index nor the optimizer:
    the model and the optimizer find the records on its slices, and name the slice. The masters'
    writer numbers its own failures the same way (:func:`numbered`), kept on ``MasterFiles``.

    The records are numbered in the order of the process's failures (:func:`failed_write_backs`),
    so that the optimizer looks at its slices only when that count moved (nothing is looked at
    while no write-back failed), and tells a failure that came before its last load, which the
    load replaced, from one after it (the end of ``load_checkpoint`` writes back the masters it
    loaded), which a load before does not undo; the model keeps the count at the last load of its
    parameters, and an optimizer built later takes the failures after it (and only those) as its own.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .disk import DiskTierError
from .mapped import MappedFile


@dataclass(frozen=True)
class Unwritten:
    """A write-back of a slice's masters that failed on its storage (Note: [A write-back outside
    the masters' writer])."""

    number: int  # its place among the failed write-backs of this process, from 1
    path: str  # the file
    why: str  # the error, as the messages say it (:func:`why_of`)
    what: str = "masters"  # what failed to be written: the masters' writer says "masters or gradients"


# The count of failed write-backs, the number of the last record; written under the lock.
_failed = 0
_numbering = threading.Lock()


def failed_write_backs() -> int:
    """How many write-backs of masters on a slice's storage failed in this process so far."""
    return _failed


def numbered(path: str, why: str, keep: Callable[[Unwritten], Any], what: str = "masters") -> Unwritten:
    """A new :class:`Unwritten`, numbered next, handed to ``keep`` (which stores it) before the count
    moves: whoever sees the count finds it."""
    global _failed
    with _numbering:
        record = Unwritten(_failed + 1, path, why, what)
        keep(record)
        _failed = record.number
    return record


def latched_text(records: Mapping[int, Unwritten]) -> str:
    """What a refusal says of the failed write-backs ``records`` (by slice): :func:`not_written_back`."""
    what = "masters" if all(r.what == "masters" for r in records.values()) else "masters or gradients"
    return not_written_back(what, {index: (r.path, r.why) for index, r in sorted(records.items())})


def read_masters_in(file: MappedFile) -> None:
    """Read a slice's masters in from ``file`` for a cast, which only reads them.

    Raises:
        DiskTierError: they could not be read (nothing changed).
    """
    try:
        file.read_in(write=False)
    except OSError as error:
        raise DiskTierError(
            f"{error.strerror} (errno {error.errno}) in {error.filename}, the file that holds a slice's float32 "
            "masters (OffloadModel(..., masters=DiskTier(...))). A failed read changed nothing; after a failed "
            "write the kernel may drop the pages and read back what the file held before: fix the disk, then "
            "reload the last checkpoint") from error


def write_masters_back(storage: Any) -> None:
    """Write ``storage``'s masters (its ``masters_file``) back and drop them; a failure is recorded
    as its ``unwritten`` before it is raised (Note: [A write-back outside the masters' writer]).

    Raises:
        DiskTierError: they could not be written.
    """
    file: MappedFile = storage.masters_file
    try:
        file.write_back()
    except OSError as error:
        record = numbered(error.filename or file.path, why_of(error), functools.partial(setattr, storage, "unwritten"))
        raise DiskTierError(
            f"could not write the masters of a slice back to disk ({record.path}): {record.why}. "
            + after_a_failed_write("save_checkpoint() of this model and its OffloadOptimizer's state_dict()",
                                   "reload the last checkpoint saved before this error")) from error


def why_of(error: BaseException) -> str:
    """``error`` as the messages of a failed write say it: an ``OSError``'s text and number, else
    its type and text."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror} (errno {error.errno})"
    return f"{type(error).__name__}: {error}"


def not_written_back(what: str, failed: Mapping[int, tuple[str, str]]) -> str:
    """What a refusal says failed: the ``what`` (``"masters"``, ``"masters or gradients"``) of the
    slices ``failed`` (index to its file and :func:`why_of`, the first one's said)."""
    files = ", ".join(f"slice {index}: {path}" for index, (path, _) in failed.items())
    first = next(iter(failed.values()))[1]
    return (f"the {what} of slice(s) {', '.join(map(str, failed))} could not be written back to disk ({files}: "
            f"{first}), and what RAM holds of them may revert to what the files held before")


def after_a_failed_write(refusing: str, reload: str) -> str:
    """What the error of a failed write-back says after what failed: what it leaves, that
    ``refusing`` (the calls) refuse until a load, and ``reload`` (what to reload)."""
    return ("Their values are in RAM for now, but after a failed write the kernel may drop their pages and read "
            f"back what the file held before, so {refusing} refuse until a load: fix the disk, then {reload} "
            "before training on")
