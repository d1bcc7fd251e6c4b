"""The disk tier's files: its own directory (made once the filesystem has room for the state and
takes a test page), one file per slice, and their removal when the optimizer goes. What it does not
hold: the I/O calls (``offload/streams/disk.py``), what a file holds (``state_slice.py``) or when it
is read and written (``disk_tier.py``)."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import warnings
import weakref
from pathlib import Path
from collections.abc import Collection, Iterable
from typing import Any

import torch

from ..streams.disk import PAGE, DiskCounters, DiskTierError, StateFile, direct_io_supported, make_directory
from ..streams.workers import HostWorker, forks
from .leftovers import left_behind, mark_owner


class StateFiles:
    """One optimizer's directory of state files, removed (unless ``keep``) when the tier that owns
    this object goes, closed or not, by the process that made them: a child of ``os.fork()`` only
    closes its copies of the descriptors (:meth:`in_fork_child`).

    Args:
        path: the user's directory (``DiskTier.path``), made if it does not exist.
        keep: leave the files when closed or garbage-collected.
        direct: use direct I/O where the filesystem takes it.
        optimizer: the optimizer whose state the files hold (sized before anything is made).
        rank: this process's rank when the update is sharded, else ``None``; ``ranks`` of them.
        elsewhere: the ``id`` of each parameter whose state is kept elsewhere (a resident slice's).

    Raises:
        DiskTierError: no room for the state, or no directory or test page could be made; nothing
            is left behind.
    """

    def __init__(self, path: Any, keep: bool, direct: bool, optimizer: torch.optim.Optimizer,
                 rank: int | None, ranks: int, elsewhere: Collection[int] = ()) -> None:
        root = Path(path)
        made = make_directory(root, "DiskTier path")
        try:
            self.directory, self.direct = _make_tier_directory(root, direct, optimizer, rank, ranks, elsewhere)
        except BaseException:
            if made:
                with contextlib.suppress(OSError):  # another process may have put files there since
                    root.rmdir()  # nothing of the tier is left behind, not even the directory it made
            raise
        self.keep = keep
        self.counters = DiskCounters()
        self._files: list[StateFile] = []
        #: Workers that use the files (the tier's reader and writer): closed before the files are.
        self.workers: list[HostWorker] = []
        self.made_at_forks = forks()  # see in_fork_child
        # Files go when the optimizer does, closed or not (never named after object ids: each
        # optimizer has its own directory).
        self._finalizer = weakref.finalize(self, _remove, self.directory, self._files, self.keep, self.workers,
                                           self.made_at_forks)

    def in_fork_child(self) -> bool:
        """Whether this process is a child of ``os.fork()`` (at any depth) of the one that made the
        files: they are the parent's, which the child must neither write nor remove, at its exit
        or when it drops or closes the optimizer (Note: [A worker under interrupts and forks], rule
        4, in ``offload/streams/workers.py``)."""
        return forks() != self.made_at_forks

    @property
    def disk_nbytes(self) -> int:
        """Bytes allocated in the files."""
        return sum(f.allocated for f in self._files)

    def path_of(self, index: int) -> Path:
        """The file of slice ``index``."""
        return self.directory / f"slice-{index:05d}.state"

    def open(self, index: int) -> StateFile:
        """Open (create) the file of slice ``index``."""
        file = StateFile(self.path_of(index), self.direct, self.counters)
        self._files.append(file)
        return file

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Write ``manifest`` (what each file holds) beside the files, for a tier that keeps them."""
        (self.directory / "manifest.json").write_text(json.dumps(manifest, indent=1))

    def remove(self) -> None:
        """Close the workers and the files, and remove them unless ``keep`` or in a fork child
        (:meth:`in_fork_child`); idempotent."""
        self._finalizer()


def _make_tier_directory(root: Path, direct: bool, optimizer: torch.optim.Optimizer, rank: int | None,
                         ranks: int, elsewhere: Collection[int]) -> tuple[Path, bool]:
    """The tier's own directory in ``root`` and whether it takes direct I/O, once the filesystem has
    room for the state and a test page written there came back; raises :class:`DiskTierError`
    (leaving nothing behind) otherwise."""
    # Before any long work: a tier that cannot hold the state would fail at the first step.
    needed = expected_state_bytes(optimizer, elsewhere) // ranks + PAGE
    free = shutil.disk_usage(root).free
    if free < needed:
        stepped = _stepped((p for g in optimizer.param_groups for p in g["params"]), elsewhere)
        raise DiskTierError(
            f"the disk tier needs about {size_text(needed)} in {root} for the optimizer's state "
            f"({getattr(optimizer, 'optimizer_class', type(optimizer)).__name__} over "
            f"{sum(p.numel() for p in stepped):,} parameters that train"
            f"{f', one rank of {ranks}' if ranks > 1 else ''}), and its filesystem has "
            f"{size_text(free)} free. Free space there, or point DiskTier at a disk with room."
            + _leftovers(root))
    prefix = "offload-state-" + (f"rank{rank}-" if rank is not None else "")
    try:
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=root))  # unique, made atomically
    except OSError as error:
        raise DiskTierError(f"could not make the disk tier's directory in {root}: {error.strerror} "
                            f"(errno {error.errno}); {size_text(free)} free there." + _leftovers(root)) from error
    try:
        mark_owner(directory)
        direct = direct and direct_io_supported(directory)
    except OSError as error:
        shutil.rmtree(directory, ignore_errors=True)
        raise DiskTierError(
            f"the disk tier could not write a test page in {directory} ({error.filename}): {error.strerror} "
            f"(errno {error.errno}); the filesystem of {root} has {size_text(shutil.disk_usage(root).free)} "
            f"free and the state needs about {size_text(needed)}. Free space there, or point DiskTier at "
            "another disk." + _leftovers(root)) from error
    left = _leftovers(root, directory)
    if left:
        warnings.warn(f"DiskTier:{left}", stacklevel=_callers_level())
    return directory, direct


def expected_state_bytes(optimizer: torch.optim.Optimizer, elsewhere: Collection[int] = ()) -> int:
    """Bytes of per-element state ``optimizer`` will keep on disk, for the optimizers whose state is
    known (Adam and AdamW: two tensors like each parameter, three with ``amsgrad``; SGD: one with
    momentum); 0 for others, whose state is not guessed.

    Only the parameters that train now count (a frozen one gets no gradient, and so no state), less
    those whose ``id`` is in ``elsewhere`` (a resident slice's: its state stays on the device)."""
    kind = getattr(optimizer, "optimizer_class", type(optimizer))  # an OffloadOptimizer's torch.optim class
    total = 0
    for group in optimizer.param_groups:
        if issubclass(kind, (torch.optim.Adam, torch.optim.AdamW)):
            per_element = 3 if group.get("amsgrad") else 2
        elif issubclass(kind, torch.optim.SGD):
            per_element = 1 if group.get("momentum") else 0
        else:
            return 0
        total += per_element * sum(p.numel() * p.element_size() for p in _stepped(group["params"], elsewhere))
    return total


def _stepped(params: Iterable[torch.Tensor], elsewhere: Collection[int]) -> list[torch.Tensor]:
    """The parameters among ``params`` whose state a disk tier will keep, as far as is known now."""
    return [p for p in params if p.requires_grad and id(p) not in elsewhere]


def _leftovers(root: Path, ours: Path | None = None) -> str:
    """What to say of the tier directories in ``root`` that killed processes left (``leftovers.py``),
    with a leading space; empty when there are none."""
    found = [(d, n) for d, n in left_behind(root) if d != ours]
    if not found:
        return ""
    names = ", ".join(str(d) for d, _ in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return (f" {len(found)} disk tier director{'y' if len(found) == 1 else 'ies'} in {root} "
            f"({size_text(sum(n for _, n in found))}) {'was' if len(found) == 1 else 'were'} left by processes "
            f"that no longer run (killed before they could remove them): {names}. Delete "
            f"{'it' if len(found) == 1 else 'them'} if no training uses {'it' if len(found) == 1 else 'them'}.")


def _callers_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the user's
    ``OffloadOptimizer(...)``, however deep the tier is made under it)."""
    package = str(Path(__file__).resolve().parents[1])
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _remove(directory: Path, files: list[StateFile], keep: bool, workers: list[HostWorker],
            made_at_forks: int) -> None:
    for worker in workers:
        worker.close()
    for file in files:
        file.close()  # this process's descriptors: a fork child's are its own copies
    # Not from a fork child (its exit runs this too): the directory is the parent's.
    if not keep and forks() == made_at_forks:
        shutil.rmtree(directory, ignore_errors=True)
