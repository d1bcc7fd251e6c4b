"""The commit of a save: how a checkpoint becomes visible under its name, whole, or not at all, and
what is tidied after it (Note: [Atomic save]).

What this file holds: the names beside a checkpoint (``latest``, the hidden partial directory and
the pending ``latest``) and in it (:func:`foreign_entries`: what no save writes), the lock a save
holds on its directory, :func:`prepare` (clears what killed saves left, makes the partial
directory), :func:`commit` (writes what is left to write, then renames, undone on failure),
:func:`tidy` (after the commit: the replaced checkpoint, ``keep_last``), :func:`latest_checkpoint`
(the checkpoint ``latest`` names, as :func:`read_latest` reads it) and :func:`committed` (where a
load reads a checkpoint). What it does not: what a checkpoint holds
(``offload/checkpoint/contents.py``), or writing its data (``offload/checkpoint/saver.py``).

Note: [Atomic save]
    A save is one event: when :func:`~offload.save_checkpoint` returns, the checkpoint is whole
    under its name and ``latest`` names it; when it raises, nothing new is visible and the previous
    checkpoint is where it was, as it was. The steps:

    1. Every rank writes into ``.<name>.partial`` beside the target; DCP syncs each file to disk
       and writes its ``.metadata`` last (itself through a temporary file).
    2. Rank 0 writes what is left to write before anything is renamed: ``offload.json`` into the
       partial directory, then the new ``latest`` as ``.latest.<name>.pending`` beside it, each
       synced. A disk that fills up fails here, where undoing is deleting files nobody reads. (Written
       after the commit, ``latest`` needed the last page of a nearly full disk: the save failed
       there, and said so, with a whole checkpoint under its name.)
    3. The commit, renames only, which take no room: a checkpoint of the same name moves to
       ``.<name>.replaced``, the partial directory takes the name, the directory is synced, and
       ``.latest.<name>.pending`` replaces ``latest``. Should a rename fail, those made are undone,
       in reverse, and the partial files deleted: the save raises with nothing new visible.
    4. The save has succeeded; what follows cannot undo it: the directory is synced again, the
       replaced checkpoint is deleted, and with ``keep_last`` the oldest checkpoints beside it are
       removed (each renamed to ``.<name>.removed`` first, so that none is ever half visible).
       What fails here (a checkpoint that cannot be removed) is a warning that says the checkpoint
       is saved, one for each; the next save tries again.

    A process killed at any moment leaves the previous checkpoint loadable and the new one whole or
    absent. Killed before the commit, it leaves hidden files that nothing reads (``.partial``,
    ``.latest.<name>.pending``); between the renames of a replacement, the old checkpoint at
    ``.<name>.replaced``; the next save in that directory deletes the former and puts the latter
    back. Until then a load of ``<name>`` (by its name or through ``latest``) reads the old
    checkpoint where it waits (:func:`committed`): a resume loads before it saves. Killed between
    the directory's rename and ``latest``'s, the new checkpoint is whole under its name while
    ``latest`` still names the previous one (the process reported nothing).

Note: [What a save deletes]
    Only what a save wrote. A checkpoint is replaced (step 3 of Note: [Atomic save]), or removed
    for ``keep_last`` (step 4), as a whole directory; so one that holds anything beside a
    checkpoint's own files (:func:`foreign_entries`: a model exported into ``step-N/hf``, a notes
    file) is neither: a save onto it is refused before anything is written (``checks.py``), and
    ``keep_last`` leaves it where it is and warns, naming what it holds, at each save until that is
    moved out. Replacing only the checkpoint's own files, in place, would keep the user's files but
    leave a directory that is half the old checkpoint and half the new one at some moment of every
    save: the renames are what keep the old checkpoint whole until the new one is.

Note: [Saves that share a directory]
    Several processes (two runs, a run and an evaluation job) may save checkpoints of different
    names into one directory at the same time; ``latest`` then names the checkpoint whose commit
    finished last. What a save makes is named after its checkpoint (``.<name>.partial``,
    ``.latest.<name>.pending``), and each save holds an exclusive ``flock`` on its own directory
    (the partial one, then the checkpoint it became) from :func:`prepare` until :func:`tidy` is
    done, as does ``keep_last`` on a checkpoint while removing it. A lock dies with its process:
    :func:`clean_up` takes a leftover's lock before removing it, and leaves alone what another
    process holds, and a pending ``latest`` or a replaced checkpoint whose save is live. The lock
    is taken on the directory itself, so that a save that fails leaves no lock file behind.

    What it does not make safe: two saves of the same name (the second is refused while the
    first writes), ``keep_last`` (it counts every checkpoint in the directory, whichever run saved
    it: runs that share a directory remove each other's), and a filesystem that cannot lock a
    directory (NFS): there a save cannot tell another's partial directory from a killed one's and
    removes it, as if one run saved there at a time. Give each run a directory of its own there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from .checkpoint_files import CheckpointError, unreadable

INFO_FILE = "offload.json"
LATEST_FILE = "latest"
#: What a save of an earlier version left for its new ``latest`` (one name for every save): a
#: leftover to delete.
PENDING_LATEST = ".latest.pending"
#: The names of a checkpoint's own files, what a save writes into it: DCP's ``.metadata`` (written
#: as ``.metadata.tmp`` first; ``__<rank>.metadata`` without coordination), each rank's data files
#: ``__<rank>_<n>.distcp``, and ``offload.json``. Anything else there is not a save's to delete.
_OWN_FILE = re.compile(rf"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp|{re.escape(INFO_FILE)}")
#: The errors of a filesystem that cannot lock a directory (NFS emulates flock with byte-range
#: locks, which a directory opened for reading cannot take): there a save cannot tell another's.
_NO_LOCKS = (errno.EBADF, errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
#: This process's saves in progress: checkpoint path -> descriptor locking its directory (Note:
#: [Saves that share a directory]).
_held: dict[Path, int] = {}


class HalfCommitted(Exception):
    """A rename of the commit failed, and undoing those made before it failed too; the message
    says where each directory is."""


def foreign_entries(checkpoint: Path) -> list[str]:
    """What directory ``checkpoint`` holds that no save writes into a checkpoint (Note: [What a save
    deletes]): each entry's name, a directory's with a ``/`` after it, sorted; empty for a
    checkpoint as a save left it (or an empty directory).

    Raises:
        OSError: ``checkpoint`` could not be listed (not a directory; permissions).
    """
    return sorted(f"{entry.name}/" if entry.is_dir() else entry.name for entry in checkpoint.iterdir()
                  if entry.is_symlink() or not entry.is_file() or not _OWN_FILE.fullmatch(entry.name))


def partial_directory(path: Path) -> Path:
    """Where a save of checkpoint ``path`` writes until its commit (hidden, beside it)."""
    return path.parent / f".{path.name}.partial"


def pending_latest(path: Path) -> Path:
    """The new ``latest`` a save of checkpoint ``path`` writes before its commit: named after the
    checkpoint, so that saves of other checkpoints beside it write their own."""
    return path.parent / f".latest.{path.name}.pending"


def _aside(path: Path) -> Path:
    """Where checkpoint ``path`` waits while a new one takes its name."""
    return path.parent / f".{path.name}.replaced"


def committed(path: Path) -> Path:
    """The directory a load of checkpoint ``path`` reads: ``path``, or, when a save replacing it was
    killed between the commit's two renames, ``.<name>.replaced``, where the previous checkpoint
    waits, whole, for the next save to put it back (Note: [Atomic save]). ``path`` when neither
    is there: the load then says no checkpoint is there.

    It renames nothing: every rank of a load reads the same directory without agreeing first, and
    a read-only copy of the directory loads too; putting the checkpoint back is the save's part
    (:func:`clean_up`, on rank 0, before anything is written). A leading ``~`` is expanded.

    Raises:
        CheckpointError: ``path`` is the directory the checkpoints were saved into (it holds
            ``latest`` and no ``offload.json``); the message names the checkpoint ``latest`` names.
            Or this user may not look into ``path`` (permissions): the message names it.
    """
    path = path.expanduser()
    try:
        if not path.exists() and _aside(path).is_dir():
            return _aside(path)
        saved_into = (path / LATEST_FILE).is_file() and not (path / INFO_FILE).exists()
    except PermissionError as error:
        # A directory this user may not look into: what it holds cannot be told, which is no damage.
        raise unreadable(path, path) from error
    if saved_into:
        # Read as a checkpoint, it would be "incomplete: offload.json is missing", which it is not.
        raise CheckpointError(f"{path} is the directory checkpoints were saved into, not a checkpoint: its "
                              f"{LATEST_FILE} names {latest_checkpoint(path)}, the last one saved there. Load that "
                              f"one (latest_checkpoint({str(path)!r}) returns it).")
    return path


def prepare(path: Path) -> Path:
    """Create the parent of checkpoint ``path``, clear what killed saves left there, and create the
    partial directory a save writes into, locked until the save ends (Note: [Saves that share a
    directory]); returns it.

    Raises:
        CheckpointError: another process is saving a checkpoint of that name now.
        OSError: the parent or the partial directory could not be made.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # Saves of one process follow one another: a lock still held is a failed save's, whose
    # partial directory its saver deleted.
    for held in list(_held):
        _release(held)
    clean_up(path.parent)
    partial = partial_directory(path)
    while True:
        try:
            partial.mkdir()
        except FileExistsError:
            descriptor = _lock(partial)  # clean_up() left it: locked, unless it was left meanwhile
            if descriptor is None:
                raise CheckpointError(f"cannot save checkpoint {path}: another process is saving a checkpoint of "
                                      f"that name there now ({partial} is its partial directory). Save under "
                                      "another name, or once it is done.") from None
            _remove_locked(partial, descriptor)
            continue
        # Blocking: only a clean_up() elsewhere can hold it, for as long as it takes to see it is ours
        # (or, between our mkdir and this lock, to delete it: then it is made again).
        descriptor = _lock(partial, wait=True)
        if descriptor is not None:
            _held[path] = descriptor
            return partial


def commit(path: Path, info: Callable[[], bytes]) -> None:
    """Write ``info()`` as ``offload.json`` into the partial directory and the pending ``latest``,
    then rename the checkpoint into place and ``latest`` to name it (Note: [Atomic save], steps 2
    and 3).

    Raises:
        OSError: a write (a full disk) or a rename failed; what was written is deleted and the
            renames undone: nothing new is visible.
        HalfCommitted: a rename failed and undoing the ones before it failed too.
        KeyboardInterrupt: raised as it landed; before the last rename, as any error, after it
            with the checkpoint committed (``latest`` names it).
    """
    partial = partial_directory(path)
    pending = pending_latest(path)
    try:
        write_synced(partial / INFO_FILE, info())
        fsync_directory(partial)
        write_synced(pending, path.name.encode())
    except BaseException:
        _discard(partial, pending)
        _release(path)
        raise
    renamed: list[tuple[Path, Path]] = []  # (from, to), in the order made

    def rename(source: Path, target: Path) -> None:
        os.replace(source, target)
        renamed.append((source, target))

    try:
        if path.exists():
            # The old one moves out of sight first: no directory named ``path`` is ever half deleted.
            rename(path, _aside(path))
        rename(partial, path)
        fsync_directory(path.parent)  # the checkpoint's name is on disk before ``latest`` names it
        os.replace(pending, path.parent / LATEST_FILE)
    except BaseException as error:
        # An interrupt (Ctrl-C, SIGTERM) is raised when the call it landed in returns: one that
        # landed in the last rename is raised after it, with the checkpoint committed (its pending
        # ``latest`` is gone exactly then). Undone, ``latest`` would name a deleted checkpoint.
        committed = not os.path.lexists(pending)
        try:
            if not committed:
                _undo(path, renamed, error)
                _discard(partial, pending)
        finally:
            _release(path)
        raise


def _undo(path: Path, renamed: list[tuple[Path, Path]], error: BaseException) -> None:
    """Rename back, in reverse, what a failed commit of checkpoint ``path`` renamed.

    Raises:
        HalfCommitted: a rename back failed; the message says what is where.
    """
    for k in range(len(renamed) - 1, -1, -1):
        source, target = renamed[k]
        try:
            os.replace(target, source)
        except OSError as undo_error:
            where = "; ".join(f"{s} is at {t}" for s, t in renamed[:k + 1])
            raise HalfCommitted(
                f"could not save checkpoint {path}: its commit failed ({type(error).__name__}: {error}) "
                f"and undoing its renames failed too ({undo_error}): {where}. latest still names the previous "
                "checkpoint; rename these back by hand before saving there again.") from error


def _discard(partial: Path, pending: Path) -> None:
    """Delete what a save that did not commit wrote (every rank is past its writes). Quietly: the
    error that stopped the save is the one to report; the next save deletes what is left."""
    shutil.rmtree(partial, ignore_errors=True)
    with contextlib.suppress(OSError):
        pending.unlink(missing_ok=True)


def tidy(path: Path, keep_last: int | None) -> list[str]:
    """After the commit of checkpoint ``path`` (Note: [Atomic save], step 4): sync its directory,
    delete the checkpoint it replaced, keep only the newest ``keep_last`` beside it, and end the
    save (its lock). The save has succeeded: what fails here is returned, one sentence each, for a
    warning, not raised."""
    saved = f"checkpoint {path} is saved and {path.parent / LATEST_FILE} names it"
    problems = []
    try:
        try:
            fsync_directory(path.parent)
        except OSError as error:
            problems.append(f"{saved}, but syncing {path.parent} failed ({error}): a crash now could lose the new "
                            "names")
        if _aside(path).exists():
            try:
                shutil.rmtree(_aside(path))
            except OSError as error:
                problems.append(f"{saved}, but deleting the checkpoint it replaced, moved to {_aside(path)}, failed "
                                f"({error}); the next save there deletes it")
        try:
            older = _beyond(path, keep_last)
        except OSError as error:
            older = []
            problems.append(f"{saved}, but keep_last={keep_last} could not list {path.parent} ({error})")
        for old in older:
            problem = _remove_for_keep_last(old, keep_last)
            if problem is not None:
                problems.append(f"{saved}, but {problem}")
    finally:
        _release(path)
    return problems


def _remove_for_keep_last(checkpoint: Path, keep_last: int) -> str | None:
    """Remove ``checkpoint``, older than the newest ``keep_last``, unless it holds what no save wrote
    (Note: [What a save deletes]); what was not done, for a warning, or ``None``."""
    try:
        others = foreign_entries(checkpoint)
        if not others:
            _remove(checkpoint)
            return None
    except OSError as error:
        return f"keep_last={keep_last} could not remove {checkpoint} ({error}); the next save there tries again"
    held = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    return (f"keep_last={keep_last} left {checkpoint} where it is: it also holds {held}, which save_checkpoint did "
            "not write and does not delete. Move those out of it (keep an export beside the checkpoint, not in it), "
            "and the next save removes it")


def _remove(checkpoint: Path) -> None:
    """Remove ``checkpoint`` for ``keep_last``, renamed to ``.<name>.removed`` first so that it is
    never half visible; under its lock, which a save replacing it holds (then it stays)."""
    descriptor = _lock(checkpoint)
    if descriptor is None:
        return  # another process is saving a checkpoint of that name, or removing it
    try:
        hidden = checkpoint.parent / f".{checkpoint.name}.removed"
        os.replace(checkpoint, hidden)
        shutil.rmtree(hidden)
    finally:
        os.close(descriptor)


def _beyond(path: Path, keep_last: int | None) -> list[Path]:
    """The checkpoints beside ``path`` older than the newest ``keep_last`` (by when they were
    saved; none when ``keep_last`` is ``None``). A directory whose ``offload.json`` is not ours is
    not a checkpoint to remove, nor is a symbolic link (a user's name for a checkpoint, kept
    wherever it points: not a save's to remove, nor to count)."""
    if keep_last is None:
        return []
    saved: list[tuple[int, Path]] = []
    for sibling in path.parent.iterdir():
        if sibling.name.startswith(".") or sibling.is_symlink() or not (sibling / INFO_FILE).is_file():
            continue
        try:
            saved.append((json.loads((sibling / INFO_FILE).read_text())["saved_ns"], sibling))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    saved.sort()
    # Nor the one ``latest`` names: with several runs saving here, a save that finished later may
    # name an older checkpoint, and a resume from ``latest`` must find it.
    try:
        named = path.parent / read_latest(path.parent)
    except (OSError, CheckpointError):
        named = path
    return [old for _, old in saved[:-keep_last] if old not in (path, named)]


def clean_up(directory: Path) -> None:
    """Remove what killed saves left in ``directory``: partial checkpoints, pending ``latest``
    files, and checkpoints moved out of sight to be removed; a checkpoint moved aside for a
    replacement that never took its name is put back (it is whole: it is deleted only after the
    replacement took its name).

    What a live save uses stays (Note: [Saves that share a directory]), and so does a symbolic
    link: no save makes one. What cannot be removed stays too, for the next save to try again: a
    leftover never stops a save.
    """
    for entry in sorted(directory.iterdir()):
        try:
            _clean_entry(directory, entry)
        except OSError:
            continue


def _clean_entry(directory: Path, entry: Path) -> None:
    """What :func:`clean_up` does with ``entry``: nothing unless it is a save's hidden leftover."""
    name = entry.name
    if entry.is_symlink():
        # An earlier version's keep_last moved a user's link to a checkpoint here: it goes back.
        original = directory / name[1:-len(".removed")]
        if name.startswith(".") and name.endswith(".removed") and not os.path.lexists(original):
            os.replace(entry, original)
        return
    if name == PENDING_LATEST:  # an earlier version's, one name for every save
        entry.unlink()
        return
    if name.startswith(".latest.") and name.endswith(".pending") and entry.is_file():
        if not _busy(directory / name[len(".latest."):-len(".pending")]):
            entry.unlink()
        return
    suffix = next((s for s in (".partial", ".removed", ".replaced") if name.endswith(s)), None)
    if not name.startswith(".") or suffix is None or not entry.is_dir():
        return
    if suffix == ".replaced":
        _put_back(entry, directory / name[1:-len(suffix)])
        return
    descriptor = _lock(entry)
    if descriptor is not None:  # else a live save writes it, or removes it
        _remove_locked(entry, descriptor)


def _put_back(aside: Path, checkpoint: Path) -> None:
    """Put a checkpoint moved aside for a replacement back under its name, or delete it where the
    replacement took the name; neither while the replacing save is live (between its renames)."""
    if _busy(checkpoint):
        return
    descriptor = _lock(aside)
    if descriptor is None:
        return
    try:
        if os.path.lexists(checkpoint):
            shutil.rmtree(aside)
        else:
            os.replace(aside, checkpoint)
    finally:
        os.close(descriptor)


def _busy(checkpoint: Path) -> bool:
    """Whether a live save of ``checkpoint`` holds its lock: on its partial directory, or, once
    renamed, on the checkpoint until its tidying is done."""
    for directory in (partial_directory(checkpoint), checkpoint):
        if directory.is_symlink() or not directory.is_dir():
            continue
        descriptor = _lock(directory)
        if descriptor is None:
            return True
        os.close(descriptor)
    return False


def _lock(directory: Path, wait: bool = False) -> int | None:
    """A descriptor of ``directory`` holding its lock (Note: [Saves that share a directory]), or
    ``None`` when another process holds it (or ``wait``: it was deleted as we waited, or is not a
    directory). On a filesystem that cannot lock a directory, the descriptor holds no lock.

    Raises:
        OSError: ``directory`` could not be opened (permissions).
    """
    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:  # a symbolic link: no save's
            return None
        raise
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        # The one who held it may have deleted it, or put another in its place: not this one then.
        if not os.path.samestat(os.stat(directory, follow_symlinks=False), os.fstat(descriptor)):
            os.close(descriptor)
            return None
    except BlockingIOError:
        os.close(descriptor)
        return None
    except FileNotFoundError:
        os.close(descriptor)
        return None
    except OSError as error:
        if error.errno not in _NO_LOCKS:
            os.close(descriptor)
            raise
    return descriptor


def _remove_locked(directory: Path, descriptor: int) -> None:
    """Delete ``directory``, whose lock ``descriptor`` holds, then let the lock go."""
    try:
        shutil.rmtree(directory)
    finally:
        os.close(descriptor)


def _release(path: Path) -> None:
    """End this process's save of checkpoint ``path``: let its directory's lock go."""
    descriptor = _held.pop(path, None)
    if descriptor is not None:
        with contextlib.suppress(OSError):
            os.close(descriptor)


def write_synced(file: Path, data: bytes) -> None:
    """Write ``data`` to ``file`` and sync it to disk; a write that fails leaves no file."""
    try:
        with open(file, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
    except BaseException:
        file.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
        raise


def fsync_directory(directory: Path) -> None:
    """Sync ``directory``'s entries (the names created and renamed in it) to disk."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint the ``latest`` file in ``directory`` names (the last one saved there), or
    ``None`` when nothing was saved there yet. :func:`~offload.load_checkpoint` loads it even when
    a save replacing it was killed half way (Note: [Atomic save]).

    Raises:
        CheckpointError: ``directory`` is not a directory (it, or one above it, is a file), or its
            ``latest`` is a directory, or names no checkpoint (empty, say), or cannot be read
            (permissions): none is what :func:`~offload.save_checkpoint` writes; the message says
            what to pass, move or write.
    """
    directory = Path(directory).expanduser()
    pointer = directory / LATEST_FILE
    try:
        name = read_latest(directory)
    except FileNotFoundError:
        return None
    except NotADirectoryError as error:
        raise CheckpointError(f"no checkpoints in {directory}: it is not a directory (it, or a directory above it, "
                              "is a file). Pass the directory save_checkpoint() saved into.") from error
    except IsADirectoryError as error:
        raise CheckpointError(f"{pointer} is a directory, not the file in which save_checkpoint() names the last "
                              f"checkpoint saved in {directory}. Rename it (a checkpoint cannot be named "
                              f"{LATEST_FILE}: the next save there would fail), or pass load_checkpoint() a "
                              "checkpoint's path.") from error
    except PermissionError as error:
        raise unreadable(pointer, directory) from error
    return directory / name


def read_latest(directory: Path) -> str:
    """The name of the checkpoint ``latest`` in ``directory`` holds, as the save wrote it (less a
    line ending, which an editor adds). Nothing else is stripped: a name a save of an earlier
    version wrote may end with a space, and the checkpoint is there under that name.

    Raises:
        CheckpointError: ``latest`` holds no checkpoint's name: empty (a disk that filled up as
            it was rewritten by hand, say), not text, or a path ('.', '..', one with a '/'), which would name
            the directory itself or one elsewhere. The message lists the checkpoints there.
        OSError: it could not be read (missing: ``FileNotFoundError``; permissions).
    """
    pointer = directory / LATEST_FILE
    try:
        name = pointer.read_text().removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError:
        name = None
    if name and name not in (".", "..") and "/" not in name and "\0" not in name:
        return name
    held = "it is not text" if name is None else "it is empty" if not name else f"it holds {name!r:.60}"
    there = _checkpoints_in(directory)
    advice = (f"Pass load_checkpoint() one of the checkpoints there by its path (newest first: "
              f"{', '.join(there[:5])}{', ...' if len(there) > 5 else ''}), or write the name of the one to resume "
              f"from into {pointer}" if there else
              f"{directory} holds no checkpoint: restore one from a copy, or start afresh (the next save there "
              f"rewrites {LATEST_FILE})")
    raise CheckpointError(f"{pointer} is damaged: {held}, not the name of the last checkpoint saved in {directory}, "
                          f"which is all save_checkpoint() writes into it. {advice}.")


def _checkpoints_in(directory: Path) -> list[str]:
    """The names of the checkpoints in ``directory`` (those with an ``offload.json``), newest first."""
    found: list[tuple[float, str]] = []
    try:
        for entry in directory.iterdir():
            if not entry.name.startswith(".") and (entry / INFO_FILE).is_file():
                found.append(((entry / INFO_FILE).stat().st_mtime, entry.name))
    except OSError:  # unreadable, or removed as we looked: the message goes without the list
        return []
    return [name for _, name in sorted(found, reverse=True)]
