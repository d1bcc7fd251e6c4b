"""Host memory backed by a file on a local disk: a shared mapping whose pages the kernel reads in
when touched and which can be written back and dropped on request.

What this file holds: :class:`MappedFile` (one preallocated, already unlinked file mapped into the
process, seen as a tensor) and the page operations on it (read in, write back and drop, count
what is resident). What it does not: decide which memory goes to disk or when (the model's
master files, ``offload/tiers/master_files.py``), or order that work (host workers of the copy engine,
``copies.py``).

Note: [Mapped masters]
    The float32 masters are what the user's ``nn.Parameter`` objects hold: the optimizer updates
    them in place, ``model.state_dict()``, ``p.detach()`` and a checkpoint read them, at any time.
    A window of buffers that the masters are copied into and out of (what the optimizer state's
    disk tier does, ``offload/tiers/disk_tier.py``) cannot give them a fixed address. A shared mapping
    of a file can: the parameters are views into it, as into a slice's RAM buffer, and every
    access sees the current values, from RAM when the page is resident and from the disk when it
    is not. What keeps it out of RAM is explicit:

    - Before a slice's update, a reader thread asks the kernel to read the whole slice in
      (``MADV_POPULATE_WRITE``), so the update does not stop at each page, and a read error is
      returned as an error instead of a ``SIGBUS`` in the update. A kernel older than 5.14
      refuses that advice (``EINVAL``); there the reader reads the file's range with ``pread``
      instead, which fills the same page cache the mapping uses (the update then takes only
      minor faults) and returns a read error as an error too.
    - After it, a writer thread writes the pages back (``msync(MS_SYNC)``, which reports I/O
      errors), unmaps them (``MADV_DONTNEED``) and drops them from the page cache
      (``POSIX_FADV_DONTNEED``): RAM holds a slice's masters only between its read and its write.

    Both calls go through ``ctypes``, which releases the GIL (Python's ``mmap`` methods do not),
    so they run beside the update and the next forward. The file is unlinked as soon as it is
    mapped: its blocks are freed with the last tensor over the mapping, and a killed process
    leaves nothing behind. A mapping reads through the page cache, not with direct I/O: the
    cached page *is* the memory the tensor uses, so there is no second copy, and it is dropped
    after use, so re-reads come from the disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from .disk import PAGE, DiskCounters, page_aligned

# Linux's values (include/uapi/asm-generic/mman-common.h); Python's mmap module lacks the newer ones.
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
MS_SYNC = 4

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10


#: Bytes a read-through (:func:`_read_through`) reads at a time.
READ_THROUGH_CHUNK = 4 << 20

#: Whether the kernel takes MADV_POPULATE_* (Linux 5.14); None until a read finds out.
_populate_works: bool | None = None

#: Held while a read or a write is added to the counters: the reader, the writer and the caller
#: (a forward casting a slice no update wrote) move one model's masters at once.
_counting = threading.Lock()


def _check(result: int, what: str, path: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}", path)


class MappedFile:
    """``nbytes`` of host memory in a shared mapping of a new file in ``directory``, as a ``uint8``
    tensor (:attr:`tensor`). The file is preallocated (a full disk shows here, as ``OSError``
    ``ENOSPC`` naming the file) and unlinked at once (Note: [Mapped masters]).

    Args:
        directory: where the file is made.
        nbytes: bytes of the mapping (rounded up to pages).
        counters: where the bytes and seconds of reads (:meth:`read_in`) and writes
            (:meth:`write_back`) are added.
        what: what the file holds, for its name and for error messages (``"masters"``, ``"gradients"``).
    """

    def __init__(self, directory: Path, nbytes: int, counters: DiskCounters, what: str = "masters") -> None:
        self.nbytes = page_aligned(max(nbytes, 1))
        self.counters = counters
        self.what = what
        fd, name = tempfile.mkstemp(prefix=f"offload-{what}-", suffix=".bin", dir=directory)
        self.path = name
        try:
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
            except OSError as error:
                raise OSError(error.errno, error.strerror, name) from None
            self._map = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(name)
        self.fd = fd
        # The descriptor goes with the mapping, which goes with the last tensor over it.
        weakref.finalize(self._map, os.close, fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the map alive
        self.address = self.tensor.data_ptr()

    def read_in(self, write: bool = True) -> None:
        """Make every page resident (read from the disk where it is not), ready to be written
        (``write``) or read. Raises ``OSError`` naming the file on a read error."""
        global _populate_works
        advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
        with self._counted(reading=True):
            if _populate_works is not False:
                if _libc.madvise(self.address, self.nbytes, advice) == 0:
                    _populate_works = True
                    return
                code = ctypes.get_errno()
                if code != errno.EINVAL or _populate_works:
                    raise OSError(code, f"reading the {self.what} in: {os.strerror(code)}", self.path)
                _populate_works = False  # Linux before 5.14: read through the file (Note: [Mapped masters])
            _read_through(self.fd, self.nbytes, self.path, self.what)

    def write_back(self) -> None:
        """Write every dirty page to the file, then take every page out of RAM (this process's
        mapping and the page cache). Raises ``OSError`` naming the file on a write error."""
        with self._counted(reading=False):
            _check(_libc.msync(self.address, self.nbytes, MS_SYNC), f"writing the {self.what} back", self.path)
        self.drop()

    @contextlib.contextmanager
    def _counted(self, reading: bool) -> Iterator[None]:
        """Add the mapping's bytes and the seconds the block took to the read or write counters."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start  # read outside the lock: no thread waits for the clock
            with _counting:
                if reading:
                    self.counters.read_bytes += self.nbytes
                    self.counters.read_seconds += seconds
                else:
                    self.counters.write_bytes += self.nbytes
                    self.counters.write_seconds += seconds

    def drop(self) -> None:
        """Take the clean pages out of RAM; dirty ones stay in the page cache until written."""
        _check(_libc.madvise(self.address, self.nbytes, MADV_DONTNEED), f"dropping the {self.what}' pages", self.path)
        os.posix_fadvise(self.fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)

    def discard(self) -> bool:
        """Make the whole file read as zeros, its blocks kept allocated, without writing them and
        without holding RAM (``fallocate(FALLOC_FL_ZERO_RANGE)``: the kernel marks the blocks
        unwritten and drops the pages, mapped ones included). What is written over next then
        faults in zero pages instead of reading the disk. Returns ``False`` where the filesystem
        does not offer it (tmpfs, some network filesystems): nothing changed then."""
        result = _libc.fallocate(self.fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, 0, self.nbytes)
        if result == 0:
            return True
        code = ctypes.get_errno()
        if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise OSError(code, f"discarding the {self.what}: {os.strerror(code)}", self.path)

    def give_space_back(self) -> bool:
        """Give the file's blocks back to the disk now, while tensors may still refer to the
        mapping (``fallocate(FALLOC_FL_PUNCH_HOLE)``): what reads it afterwards reads zeros. For a
        build that raised (Note: [A build that raises] in ``take_in.py``), whose traceback
        may hold the mapping for long. Returns ``False`` where the filesystem refuses: the blocks
        then go with the mapping. Raises nothing: it runs while another error is raised."""
        return _libc.fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, self.nbytes) == 0

    def resident_bytes(self) -> int:
        """Bytes of the mapping in RAM now (``mincore``)."""
        pages = self.nbytes // PAGE
        vector = (ctypes.c_ubyte * pages)()
        _check(_libc.mincore(self.address, self.nbytes, vector), "counting resident pages", self.path)
        return PAGE * sum(1 for page in bytes(vector) if page & 1)


def _read_through(fd: int, nbytes: int, path: str, what: str = "masters") -> None:
    """Read ``nbytes`` of the file into the page cache with ``pread`` (the fallback for
    ``MADV_POPULATE_*``); raises ``OSError`` naming the file on a read error."""
    scratch = bytearray(min(READ_THROUGH_CHUNK, nbytes))
    offset = 0
    while offset < nbytes:
        view = memoryview(scratch)[:min(len(scratch), nbytes - offset)]
        try:
            read = os.preadv(fd, [view], offset)
        except OSError as error:
            raise OSError(error.errno, f"reading the {what} in: {error.strerror}", path) from None
        if read == 0:  # the file is preallocated to nbytes: a short file is a bug, not the end
            raise OSError(errno.EIO, f"reading the {what} in: the file ended early", path)
        offset += read


def mapping_supported() -> bool:
    """Whether this system has the calls :class:`MappedFile` needs (``posix_fadvise``,
    ``posix_fallocate``, ``preadv``; Linux)."""
    return all(hasattr(os, name) for name in ("posix_fadvise", "posix_fallocate", "preadv"))
