"""Files on a local disk, read and written with direct I/O into page-aligned host buffers.

What this file holds: :class:`AlignedBuffer` (anonymous, page-aligned host memory seen as a
tensor), :class:`StateFile` (one preallocated file, read and written whole from such a buffer),
:func:`direct_io_supported` (whether a directory's filesystem takes ``O_DIRECT``),
:func:`make_directory` (a tier's directory, refused where a mistyped path would put it) and
:class:`DiskCounters` (bytes moved and seconds spent, for benchmarks). What it does not: decide
what goes to disk or when (``offload/tiers/disk_tier.py``), or order reads and writes against other work
(the tier submits them to host workers through the copy engine, ``copies.py``).

Note: [Direct I/O engine]
    Reads and writes are plain ``os.preadv`` / ``os.pwritev`` calls on a file opened with
    ``O_DIRECT``, each run on a host worker thread (``workers.py``); the calls release the GIL,
    so a read, a write and the optimizer's update run at once. Why this engine:

    - Direct I/O moves bytes between the device and our buffer with no page-cache copy: the cache
      would otherwise hold a second copy of the state (RAM the tier exists to save) and make
      re-reads look faster than the disk is. Buffers and file offsets are multiples of the page
      size (4096), which every filesystem that takes ``O_DIRECT`` accepts.
    - The access pattern is a few large sequential transfers per slice (megabytes to gigabytes),
      one read and one write in flight at a time. Two threads saturate a disk with such requests;
      what io_uring adds (many small requests in flight, fewer system calls) does not pay here,
      and it needs a binding that is not in the standard library. Packages made for this
      (DeepSpeed's AIO op, kvikio / GPUDirect Storage) are large, build native code, and are not
      dependencies of this library; the standard library is.
    - Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems: ``EINVAL``),
      files are opened for buffered I/O instead and a warning says so once per filesystem.

    Transfers are split into chunks of :data:`CHUNK` bytes (the kernel moves at most about 2 GiB
    per call); a short transfer is continued, and any ``OSError`` is raised naming the file.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

#: Alignment of buffers, file offsets and transfer sizes under direct I/O.
PAGE = 4096
#: Bytes per read or write call.
CHUNK = 64 << 20

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_warned: set[int] = set()  # filesystems (st_dev) warned about
_warned_lock = threading.Lock()


class DiskTierError(RuntimeError):
    """The disk tier could not write (or read) state; the message says which slices are updated
    and where their state is (Note: [Disk tier failures] in ``offload/tiers/disk_tier.py``).

    Defined here, in the lowest layer that raises it (host storage raises it for masters in files);
    ``offload.DiskTierError`` re-exports it."""


def page_aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of pages."""
    return -(-nbytes // PAGE) * PAGE


class AlignedBuffer:
    """``nbytes`` (a whole number of pages) of anonymous host memory at a page boundary, as a
    ``uint8`` tensor and as a buffer the ``os`` calls read into and write from.

    Anonymous ``mmap`` memory starts at a page boundary and takes RAM only where touched; it is
    returned to the system when the last tensor over it is freed.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = page_aligned(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the map alive

    def view(self, start: int, stop: int) -> memoryview:
        return memoryview(self._map)[start:stop]

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


@dataclass
class DiskCounters:
    """Bytes moved and seconds spent in read and write calls (a state tier's side is counted by
    one thread at a time: the reader's, the writer's, or the caller's while neither runs; masters'
    files, whose caller may cast a slice while the workers move others, add under a lock in
    ``mapped.py``)."""

    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0
    write_seconds: float = 0.0


def file_above(path: Path) -> Path | None:
    """The nearest existing folder above ``path`` if it is a file, not a directory: "create the parent
    first" could not be followed there."""
    parent = path.absolute().parent
    above = next((folder for folder in (parent, *parent.parents) if folder.exists()), None)
    return above if above is not None and not above.is_dir() else None


def make_directory(path: Path, what: str) -> bool:
    """Make directory ``path`` for ``what`` (``"DiskTier path"``) if it does not exist; its parent
    must. A mistyped path (``/nvme0/run`` for ``/nvme/run``) would otherwise create a tree on
    whatever disk holds the root, and fill it. Returns whether it made it.

    Raises:
        ValueError: ``path`` is a file, its parent does not exist or one of its parents is a file,
            it cannot be written to, or it starts with ``~`` (which the caller did not expand).
    """
    if str(path).startswith("~") and Path(path).expanduser() != Path(path):
        # Made as given, it would be a directory named "~" here, not in the home directory.
        raise ValueError(f"{what} {path} starts with '~', which is not expanded here: pass "
                         f"{Path(path).expanduser()} (os.path.expanduser)")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a directory; point it at a directory on a local disk")
    if not path.exists():
        parent = path.absolute().parent
        above = file_above(path)
        if above is not None:
            raise ValueError(f"{what} {path}: {above} is a file, not a directory. Choose another path, or move "
                             f"{above} away first.")
        if not parent.is_dir():
            raise ValueError(f"{what} {path}: its parent directory {parent} does not exist; create it first (only the "
                             "last level is created, so that a mistyped path does not put the files on another disk)")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{what} {path}: cannot create it, {parent} is not writable by this process; choose a "
                             "directory you can write to")
        try:
            path.mkdir()
            return True
        except FileExistsError:
            if not path.is_dir():
                raise ValueError(f"{what} {path} is a file, not a directory; point it at a directory on a local "
                                 "disk") from None
            # Another process made it meanwhile: the ranks of one job name the same directory.
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path} is not writable by this process; choose a directory you can write to")
    return False


def direct_io_supported(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT`` and read and written through
    it; if not, warn once per filesystem that the tier falls back to buffered I/O. The probe file
    is removed whatever happens.

    Raises:
        OSError: the probe could not be written for another reason than ``O_DIRECT`` (``ENOSPC``:
            the disk is full).
    """
    if not _O_DIRECT:
        supported = False
    else:
        probe = directory / ".direct-io-probe"
        try:
            supported = _probe_direct_io(probe)
        finally:
            probe.unlink(missing_ok=True)  # on every way out: a full disk must not keep it
    if not supported:
        filesystem = os.stat(directory).st_dev
        with _warned_lock:
            first = filesystem not in _warned
            _warned.add(filesystem)
        if first:
            warnings.warn(
                f"the filesystem of {directory} does not take direct I/O (O_DIRECT): the disk tier uses "
                "buffered I/O there, so the page cache may hold a second copy of the state and reads may "
                "seem faster than the disk. Point the tier at a local disk (ext4, xfs) to avoid both.",
                stacklevel=3)
    return supported


def _probe_direct_io(probe: Path) -> bool:
    """Whether ``probe`` can be created, written and read with ``O_DIRECT`` (``EINVAL``: no)."""
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise OSError(error.errno, error.strerror, str(probe)) from None
    try:
        page = AlignedBuffer(PAGE)
        os.pwritev(fd, [page.view(0, PAGE)], 0)
        os.preadv(fd, [page.view(0, PAGE)], 0)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise OSError(error.errno, error.strerror, str(probe)) from None
    finally:
        os.close(fd)
    return True


class StateFile:
    """One file of the tier, opened once; holds ``allocated`` bytes, preallocated.

    Args:
        path: the file (created; it must not exist).
        direct: open with ``O_DIRECT``.
        counters: where the time and bytes of reads and writes are added.
    """

    def __init__(self, path: Path, direct: bool, counters: DiskCounters) -> None:
        self.path = path
        self.counters = counters
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (_O_DIRECT if direct else 0)
        self.fd: int | None = os.open(path, flags, 0o600)
        self.allocated = 0

    def reserve(self, nbytes: int) -> None:
        """Make the file hold ``nbytes``, its blocks allocated now so that a write cannot find the
        disk full. Raises ``OSError`` (``ENOSPC``: the disk is full) naming the file."""
        if nbytes <= self.allocated:
            return
        assert self.fd is not None, "internal error: a closed state file was written"
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(self.path)) from None
        self.allocated = nbytes

    def write(self, buffer: AlignedBuffer, nbytes: int) -> None:
        """Write the first ``nbytes`` (page-aligned) of ``buffer`` at the start of the file."""
        self._transfer(buffer, nbytes, os.pwritev)

    def read(self, buffer: AlignedBuffer, nbytes: int) -> None:
        """Read the first ``nbytes`` (page-aligned) of the file into ``buffer``."""
        self._transfer(buffer, nbytes, os.preadv)

    def _transfer(self, buffer: AlignedBuffer, nbytes: int, call) -> None:  # type: ignore[no-untyped-def]
        assert self.fd is not None, "internal error: a closed state file was used"
        assert nbytes % PAGE == 0 and nbytes <= buffer.nbytes, "internal error: an unaligned transfer"
        reading = call is os.preadv
        start = time.perf_counter()
        done = 0
        try:
            while done < nbytes:
                moved = call(self.fd, [buffer.view(done, min(done + CHUNK, nbytes))], done)
                if moved <= 0:
                    raise OSError(errno.EIO, "the file ended before the state did" if reading
                                  else "nothing was written", str(self.path))
                done += moved
        except OSError as error:
            if error.filename is None:
                raise OSError(error.errno, error.strerror, str(self.path)) from None
            raise
        finally:
            seconds = time.perf_counter() - start
            if reading:
                self.counters.read_bytes += done
                self.counters.read_seconds += seconds
            else:
                self.counters.write_bytes += done
                self.counters.write_seconds += seconds

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.allocated = 0
