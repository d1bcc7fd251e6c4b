"""What a checkpoint's files need and hold beyond DCP's format: whether a failed save ran out of
room, and a checksum of every data file, recorded as DCP writes it and checked before
a load reads anything.

What this file holds: :class:`CheckpointError`, :class:`ChecksummingFileSystem` (DCP's local
filesystem, summing each data file as it is written), :func:`verify_checksums`,
:func:`free_bytes` and :func:`disk_full` (whether a failed save ran out of space). What it does
not: what is saved or loaded, or the order of the commit (``offload/checkpoint.py``).

Note: [Checkpoint checksums]
    DCP keeps no checksums: bytes flipped inside a ``.distcp`` file of the right length load
    silently. Each data file's CRC-32 is computed as it is saved and checked before it is loaded:

    - Saving, the sum is taken of the very buffers DCP hands to ``write``, in order (no second
      read of the file): a buffer of :data:`SUM_ASIDE` bytes or more (a tensor) is summed on a
      helper thread while the calling thread writes it, both outside the GIL, and the write
      returns once both are done (the caller may reuse the buffer next). Rank 0 records every
      rank's sums in ``offload.json`` (``"crc32": {file: value}``).
    - Loading, each rank reads each file it will load from once more, in :data:`VERIFY_CHUNK`
      pieces, and compares before anything is loaded: a load pays one more read of its files
      (from the page cache when they were just read or written). A checkpoint saved before
      checksums were recorded has no ``"crc32"`` and loads unchecked.

    CRC-32 (``zlib``, in the standard library, about 2.4 GiB/s on one core here) detects every
    burst of flipped bits up to 32 bits long and any other damage with probability 1 - 2**-32; it
    is not a defence against deliberate tampering. The cost is measured in ``docs/checkpoints.md``.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import shutil
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from .disk_tier import size_text

#: Bytes read at a time to verify a file (one buffer, reused).
VERIFY_CHUNK = 1 << 20
#: Buffers written at least this large are summed on a helper thread while they are written.
SUM_ASIDE = 1 << 20
#: The suffix of DCP's data files.
DATA_SUFFIX = ".distcp"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved here, or cannot be loaded into this model and optimizer
    (incomplete, damaged, or saved from something else). A failed save leaves the previous
    checkpoint intact; a refused load leaves the model and optimizer unchanged."""


class _SummingStream:
    """A data file DCP writes into, summing (CRC-32) what goes through ``write``: a large buffer
    on a helper thread while this one writes it (both release the GIL), so the sum takes no
    time of its own where a core is free; the rest is the file's own."""

    def __init__(self, raw: Any, helper: ThreadPoolExecutor) -> None:
        self.raw = raw
        self.crc = 0
        self.error: OSError | None = None  # the write that failed (torch's archive writer hides it)
        self._helper = helper

    def write(self, data: Any) -> int:
        view = memoryview(data)
        # Summed before write() returns: the caller may reuse the buffer next (a disk tier's slice).
        summing = self._helper.submit(zlib.crc32, view, self.crc) if view.nbytes >= SUM_ASIDE else None
        try:
            written = self.raw.write(data)
        except OSError as error:
            self.error = error
            raise
        finally:
            if summing is not None:
                self.crc = summing.result()
        if summing is None:
            self.crc = zlib.crc32(view, self.crc)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)  # tell, flush, fileno, close


class ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem that records the CRC-32 of each data file it writes
    (Note: [Checkpoint checksums]); a ``FileSystemWriter`` uses it through its ``fs``."""

    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, int] = {}  # file name -> CRC-32, for the files written whole
        self.write_errors: list[OSError] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if mode != "wb" or not str(path).endswith(DATA_SUFFIX):
                yield stream
                return
            # A thread to sum large buffers beside the write (one per file: DCP may write files
            # from several threads).
            with ThreadPoolExecutor(1, thread_name_prefix="offload checkpoint crc32") as helper:
                summing = _SummingStream(stream, helper)
                try:
                    yield summing
                except BaseException:
                    if summing.error is not None:
                        self.write_errors.append(summing.error)
                    raise
            self.checksums[Path(path).name] = summing.crc


def file_checksum(file: Path) -> int:
    """The CRC-32 of ``file``, read in :data:`VERIFY_CHUNK` pieces into one buffer (mapped memory:
    a freed malloc buffer this large would raise glibc's mmap threshold, and the loads after it
    would keep more memory)."""
    crc = 0
    buffer = mmap.mmap(-1, VERIFY_CHUNK)
    try:
        view = memoryview(buffer)
        with open(file, "rb", buffering=0) as stream:
            while (count := stream.readinto(view)):
                crc = zlib.crc32(view[:count], crc)
        view.release()
    finally:
        buffer.close()
    return crc


def verify_checksums(path: Path, recorded: dict[str, int] | None, files: Iterable[str]) -> None:
    """Compare each of ``files`` (names in checkpoint ``path``) with its recorded CRC-32; nothing
    to do for a checkpoint saved without checksums (``recorded`` is ``None``).

    Raises:
        CheckpointError: a file's contents differ from what was saved, naming it.
    """
    if recorded is None:
        return
    for name in sorted(set(files)):
        if name not in recorded:
            raise CheckpointError(f"checkpoint {path} is damaged: offload.json records no checksum of {name}, "
                                  "which its metadata names")
        found = file_checksum(path / name)
        if found != recorded[name]:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {path / name} has CRC-32 {found:08x}, {recorded[name]:08x} was "
                "recorded when it was saved (its bytes changed on disk since). Nothing was loaded: load an "
                "earlier checkpoint, or the same one from a good copy.")


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still write on the filesystem of ``directory``."""
    return shutil.disk_usage(directory).free


def disk_full(error: BaseException, write_errors: Iterable[OSError]) -> bool:
    """Whether a failed save ran out of space: an ``ENOSPC`` (or quota) error in the writes, or
    anywhere among the errors DCP gathered."""
    full = (errno.ENOSPC, errno.EDQUOT)
    if any(e.errno in full for e in write_errors):
        return True
    for found in _errors_in(error):
        if isinstance(found, OSError) and found.errno in full:
            return True
    return False


def _errors_in(error: BaseException) -> Iterator[BaseException]:
    """``error``, the errors it was raised from, and those a ``CheckpointException`` gathered."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            stack += [failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()]
        stack += [c for c in (e.__cause__, e.__context__) if c is not None]


def failure_text(error: BaseException) -> str:
    """What went wrong, in one line per rank for DCP's gathered errors (not its tracebacks)."""
    if isinstance(error, CheckpointException):
        parts = []
        for rank, failure in sorted(error.failures.items()):
            e = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(e).__name__}: {e}")
        return "; ".join(parts)
    return f"{type(error).__name__}: {error}"


def pickled_size(value: Any) -> int:
    """Bytes of ``value`` as DCP writes it (``torch.save``); raises what pickling raises."""
    import torch

    sink = _CountingSink()
    torch.save(value, sink)
    return sink.nbytes


class _CountingSink(io.RawIOBase):
    """A writable file that keeps nothing but the count of bytes written."""

    def __init__(self) -> None:
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.nbytes += n
        return n
