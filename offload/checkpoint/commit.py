"""The commit of a save: how a checkpoint becomes visible under its name, whole, or not at all, and
what is tidied after it (Note: [Atomic save]).

What this file holds: the names beside a checkpoint (``latest``, the hidden partial directory and
the pending ``latest``), :func:`prepare` (clears what killed saves left, makes the partial
directory), :func:`commit` (writes what is left to write, then renames, undone on failure),
:func:`tidy` (after the commit: the replaced checkpoint, ``keep_last``), :func:`latest_checkpoint`
(the checkpoint ``latest`` names) and :func:`committed` (where a load reads a checkpoint). What it
does not: what a checkpoint holds (``offload/checkpoint/contents.py``), or writing its data
(``offload/checkpoint/saver.py``).

Note: [Atomic save]
    A save is one event: when :func:`~offload.save_checkpoint` returns, the checkpoint is whole
    under its name and ``latest`` names it; when it raises, nothing new is visible and the previous
    checkpoint is where it was, as it was. The steps:

    1. Every rank writes into ``.<name>.partial`` beside the target; DCP syncs each file to disk
       and writes its ``.metadata`` last (itself through a temporary file).
    2. Rank 0 writes what is left to write before anything is renamed: ``offload.json`` into the
       partial directory, then the new ``latest`` as ``.latest.pending`` beside it, each synced.
       A disk that fills up fails here, where undoing is deleting files nobody reads. (Written
       after the commit, ``latest`` needed the last page of a nearly full disk: the save failed
       there, and said so, with a whole checkpoint under its name.)
    3. The commit, renames only, which take no room: a checkpoint of the same name moves to
       ``.<name>.replaced``, the partial directory takes the name, the directory is synced, and
       ``.latest.pending`` replaces ``latest``. Should a rename fail, those made are undone, in
       reverse, and the partial files deleted: the save raises with nothing new visible.
    4. The save has succeeded; what follows cannot undo it: the directory is synced again, the
       replaced checkpoint is deleted, and with ``keep_last`` the oldest checkpoints beside it are
       removed (each renamed to ``.<name>.removed`` first, so that none is ever half visible).
       What fails here (a checkpoint that cannot be removed) is a warning that says the checkpoint
       is saved, one for each; the next save tries again.

    A process killed at any moment leaves the previous checkpoint loadable and the new one whole or
    absent. Killed before the commit, it leaves hidden files that nothing reads (``.partial``,
    ``.latest.pending``); between the renames of a replacement, the old checkpoint at
    ``.<name>.replaced``; the next save in that directory deletes the former and puts the latter
    back. Until then a load of ``<name>`` (by its name or through ``latest``) reads the old
    checkpoint where it waits (:func:`committed`): a resume loads before it saves. Killed between
    the directory's rename and ``latest``'s, the new checkpoint is whole under its name while
    ``latest`` still names the previous one (the process reported nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .checkpoint_files import CheckpointError

INFO_FILE = "offload.json"
LATEST_FILE = "latest"
#: The new ``latest``, written before the commit and renamed over ``latest`` as its last step.
PENDING_LATEST = ".latest.pending"


class HalfCommitted(Exception):
    """A rename of the commit failed, and undoing those made before it failed too; the message
    says where each directory is."""


def partial_directory(path: Path) -> Path:
    """Where a save of checkpoint ``path`` writes until its commit (hidden, beside it)."""
    return path.parent / f".{path.name}.partial"


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
    (:func:`clean_up`, on rank 0, before anything is written).
    """
    if not path.exists() and _aside(path).is_dir():
        return _aside(path)
    return path


def prepare(path: Path) -> Path:
    """Create the parent of checkpoint ``path``, clear what killed saves left there, and create the
    partial directory a save writes into; returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_up(path.parent)
    partial = partial_directory(path)
    partial.mkdir()
    return partial


def commit(path: Path, info: Callable[[], bytes]) -> None:
    """Write ``info()`` as ``offload.json`` into the partial directory and the pending ``latest``,
    then rename the checkpoint into place and ``latest`` to name it (Note: [Atomic save], steps 2
    and 3).

    Raises:
        OSError: a write (a full disk) or a rename failed; what was written is deleted and the
            renames undone: nothing new is visible.
        HalfCommitted: a rename failed and undoing the ones before it failed too.
    """
    partial = partial_directory(path)
    pending = path.parent / PENDING_LATEST
    try:
        write_synced(partial / INFO_FILE, info())
        fsync_directory(partial)
        write_synced(pending, path.name.encode())
    except BaseException:
        _discard(partial, pending)
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
        _undo(path, renamed, error)
        _discard(partial, pending)
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
    delete the checkpoint it replaced, and keep only the newest ``keep_last`` beside it. The save
    has succeeded: what fails here is returned, one sentence each, for a warning, not raised."""
    saved = f"checkpoint {path} is saved and {path.parent / LATEST_FILE} names it"
    problems = []
    try:
        fsync_directory(path.parent)
    except OSError as error:
        problems.append(f"{saved}, but syncing {path.parent} failed ({error}): a crash now could lose the new names")
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
        hidden = old.parent / f".{old.name}.removed"
        try:
            os.replace(old, hidden)
            shutil.rmtree(hidden)
        except OSError as error:
            problems.append(f"{saved}, but keep_last={keep_last} could not remove {old} ({error}); the next save "
                            "there tries again")
    return problems


def _beyond(path: Path, keep_last: int | None) -> list[Path]:
    """The checkpoints beside ``path`` older than the newest ``keep_last`` (by when they were
    saved; none when ``keep_last`` is ``None``). A directory whose ``offload.json`` is not ours is
    not a checkpoint to remove."""
    if keep_last is None:
        return []
    saved: list[tuple[int, Path]] = []
    for sibling in path.parent.iterdir():
        if sibling.name.startswith(".") or not (sibling / INFO_FILE).is_file():
            continue
        try:
            saved.append((json.loads((sibling / INFO_FILE).read_text())["saved_ns"], sibling))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    saved.sort()
    return [old for _, old in saved[:-keep_last] if old != path]


def clean_up(directory: Path) -> None:
    """Remove what killed saves left in ``directory``: partial checkpoints, a pending ``latest``,
    and checkpoints moved out of sight to be removed; a checkpoint moved aside for a replacement
    that never took its name is put back (it is whole: it is deleted only after the replacement
    took its name)."""
    for entry in directory.iterdir():
        if entry.name == PENDING_LATEST and not entry.is_dir():
            entry.unlink()
        if not (entry.name.startswith(".") and entry.is_dir()):
            continue
        if entry.name.endswith((".partial", ".removed")):
            shutil.rmtree(entry)
        elif entry.name.endswith(".replaced"):
            original = directory / entry.name[1:-len(".replaced")]
            if original.exists():
                shutil.rmtree(entry)
            else:
                os.replace(entry, original)


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
            ``latest`` is a directory: neither is what :func:`~offload.save_checkpoint` writes; the
            message says what to pass or move.
    """
    directory = Path(directory)
    pointer = directory / LATEST_FILE
    try:
        name = pointer.read_text().strip()
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
    return directory / name
