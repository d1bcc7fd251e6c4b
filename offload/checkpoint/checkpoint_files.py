"""What a checkpoint's files need and hold beyond DCP's format: a checksum of every data file,
summed when DCP syncs it and checked before a load reads anything, and what a failed save ran into.

What this file holds: :class:`CheckpointError`, :class:`ChecksummingFileSystem` (DCP's local
filesystem, summing each data file once it is written), :func:`verify_checksums`, the error
for a file this user may not read (:func:`unreadable`), and the helpers a save's checks and error
messages use (:func:`free_bytes`, :func:`disk_full`, :func:`failure_text`, :func:`pickled_size`).
What it does not: what is saved or loaded, or the order of the commit
(``offload/checkpoint/saver.py``, ``loader.py``, ``commit.py``).

Note: [Checkpoint checksums]
    DCP keeps no checksums: bytes flipped inside a ``.distcp`` file of the right length load
    silently. Each data file's CRC-32 is computed as it is saved and checked before it is loaded:

    - Saving, once DCP has written a data file and asks for its descriptor to ``fsync`` it, a
      thread reads the file back (from the page cache: the bytes the file holds) and sums it
      while the caller sleeps in the sync, so the sum competes with nothing of the save and
      costs no time where it is faster than the disk. (Summing the buffers as they are written,
      on a helper thread, measured slower: it competes with the writes for the cores.) Without
      a sync, the file is summed when it is closed. Rank 0 records every rank's sums in
      ``offload.json`` (``"crc32": {file: value}``).
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
import threading
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem


#: Bytes read at a time to verify a file (one buffer, reused).
VERIFY_CHUNK = 1 << 20
#: The suffix of DCP's data files.
DATA_SUFFIX = ".distcp"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved here, or cannot be loaded into this model and optimizer
    (incomplete, damaged, or saved from something else). A failed save leaves nothing new
    visible, ``latest`` unchanged and the previous checkpoint intact; a refused load leaves the
    model and optimizer unchanged.

    Attributes:
        shapes: for a checkpoint of a model with the same tensors but other shapes, each differing
            tensor's shape there and here, by name, for a caller's advice; ``None`` otherwise.
    """

    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None


class _SummingStream:
    """A data file DCP writes into. Once DCP asks for its descriptor to sync it, every byte is
    written: a thread reads the file back and sums it (CRC-32) while the sync waits for the disk.
    The rest is the file's own."""

    def __init__(self, raw: Any, path: Path) -> None:
        self.raw = raw
        self.path = path
        self.error: OSError | None = None  # the write that failed (torch's archive writer hides it)
        self._summing: threading.Thread | None = None
        self._crc: list[int] = []
        self._summing_error: OSError | None = None  # what the summing thread ran into, raised by checksum()
        self._written_after = False  # written to after the sum started: it is taken again

    def write(self, data: Any) -> int:
        if self._summing is not None:
            self._written_after = True
        try:
            return self.raw.write(data)
        except OSError as error:
            self.error = error
            raise

    def fileno(self) -> int:
        # DCP asks for the descriptor to fsync the file once it is written: the sum reads it back
        # from the page cache meanwhile, on a thread that competes with nothing of this save
        # (the caller sleeps in the sync).
        self.raw.flush()
        if self._summing is None:
            self._summing = threading.Thread(target=self._sum, name="offload checkpoint crc32", daemon=True)
            self._summing.start()
        return self.raw.fileno()

    def _sum(self) -> None:
        # Kept for checksum() to raise in the saving thread: raised here, it would be printed as
        # an uncaught thread error, and the save would report something else.
        try:
            self._crc.append(file_checksum(self.path))
        except OSError as error:
            self._summing_error = error

    def checksum(self) -> int:
        """The file's CRC-32, once it is written whole (summed now if no sync started it).

        Raises:
            OSError: the file could not be read back (deleted, an I/O error).
        """
        if self._summing is not None:
            self._summing.join()
        if self._summing_error is not None and not self._written_after:
            raise self._summing_error
        if self._summing is None or self._written_after or not self._crc:
            self.raw.flush()
            return file_checksum(self.path)
        return self._crc[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)  # tell, flush, close


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
            summing = _SummingStream(stream, Path(path))
            try:
                yield summing
            except BaseException:
                if summing.error is not None:
                    self.write_errors.append(summing.error)
                if summing._summing is not None:
                    summing._summing.join()
                raise
            self.checksums[Path(path).name] = summing.checksum()


def file_checksum(file: Path) -> int:
    """The CRC-32 of ``file``, read in :data:`VERIFY_CHUNK` pieces into one buffer (mapped memory:
    a freed malloc buffer this large would raise glibc's mmap threshold, and the loads after it
    would keep more memory)."""
    crc = 0
    buffer = mmap.mmap(-1, VERIFY_CHUNK)
    try:
        # Released whatever happens: a view left on the map makes its close raise BufferError,
        # which would hide the error that stopped the read.
        with memoryview(buffer) as view, open(file, "rb", buffering=0) as stream:
            while (count := stream.readinto(view)):
                crc = zlib.crc32(view[:count], crc)
    finally:
        buffer.close()
    return crc


def verify_checksums(path: Path, recorded: dict[str, int] | None, files: Iterable[str]) -> None:
    """Compare each of ``files`` (names in checkpoint ``path``) with its recorded CRC-32; nothing
    to do for a checkpoint saved without checksums (``recorded`` is ``None``).

    Raises:
        CheckpointError: a file's contents differ from what was saved, or this user may not read
            it (permissions), naming it.
    """
    if recorded is None:
        return
    for name in sorted(set(files)):
        if name not in recorded:
            raise CheckpointError(f"checkpoint {path} is damaged: offload.json records no checksum of {name}, "
                                  "which its metadata names")
        try:
            found = file_checksum(path / name)
        except PermissionError as error:
            raise unreadable(path / name, path) from error
        if found != recorded[name]:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {path / name} has CRC-32 {found:08x}, {recorded[name]:08x} was "
                "recorded when it was saved (its bytes changed on disk since). Nothing was loaded: load an "
                "earlier checkpoint, or the same one from a good copy.")


def unreadable(file: Path, checkpoint: Path) -> CheckpointError:
    """The error for ``file`` of ``checkpoint`` (or the directory checkpoints were saved into),
    which this user may not read: a matter of permissions, which no other checkpoint mends (nor is
    it damage: what the file holds cannot be told)."""
    return CheckpointError(f"cannot read {file}: permission denied. Nothing was loaded: give this user read access to "
                           f"{checkpoint} (as its owner: chmod -R u+rX, or a+rX for every user), or load it as the "
                           "user who saved it.")


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
    sink = _CountingSink()
    try:
        torch.save(value, sink)
    except Exception as error:
        # An interrupt (Ctrl-C) inside torch.save's zip writer is replaced by the RuntimeError its
        # closing raises: give the interrupt back, so a caller never reports it as a pickling error.
        interrupt = interrupt_behind(error)
        if interrupt is not None:
            raise interrupt from None
        raise
    return sink.nbytes


def interrupt_behind(error: BaseException) -> BaseException | None:
    """The KeyboardInterrupt (or SystemExit) behind ``error`` (:func:`_errors_in`), if any."""
    return next((e for e in _errors_in(error) if isinstance(e, (KeyboardInterrupt, SystemExit))), None)


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
