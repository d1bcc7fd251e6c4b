"""A full disk: for the disk tier's files of the given names (``posix_fallocate`` refuses them), as
the free space a filesystem reports (``shutil.disk_usage``), or as a number of pages left for
every file written under a directory (:class:`PageBudget`)."""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import threading

from offload.streams import disk


def refuse_allocating(monkeypatch, *names: str) -> set[str]:
    """Make the tier's ``posix_fallocate`` fail with ``ENOSPC`` for files ending in ``names``;
    returns the set of names, which the caller clears once space is "freed"."""
    refusing = set(names)
    real = os.posix_fallocate

    def fallocate(fd, offset, length):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(tuple(refusing)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    monkeypatch.setattr(disk.os, "posix_fallocate", fallocate)
    return refusing


def report_free(monkeypatch, nbytes: int) -> None:
    """Every filesystem reports ``nbytes`` free (``shutil.disk_usage``, what room checks read)."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=nbytes))


PAGE = 4096
# What a budget wraps: the functions themselves, whatever an earlier budget of the test patched in.
_REAL_OPEN, _REAL_DISK_USAGE = io.open, shutil.disk_usage


class PageBudget:
    """A filesystem under ``directory`` that has ``pages`` pages of room left (``None``: no limit),
    as a small file system counts it: each file takes whole pages as it grows, and a write that
    needs a page beyond the room fails with ``ENOSPC``. ``used`` counts the
    pages taken, so that a save's need can be measured with no limit and then refused a page short.
    Deletions give nothing back: the budget is what a save may take, at most."""

    def __init__(self, monkeypatch, directory, pages: int | None = None) -> None:
        self.directory = os.path.realpath(directory)
        self.pages = pages
        self.used = 0
        self._lock = threading.Lock()
        def counted_open(file, mode="r", *args, **kwargs):
            stream = _REAL_OPEN(file, mode, *args, **kwargs)
            if any(c in mode for c in "wax+") and isinstance(file, (str, os.PathLike)) and self._under(file):
                return _PagedFile(stream, self)
            return stream

        def usage(path):
            found = _REAL_DISK_USAGE(path)
            if self.pages is None or not self._under(path):
                return found
            return found._replace(free=(self.pages - self.used) * PAGE)

        # ``open`` for the files written here, ``io.open`` for pathlib's (DCP's data and metadata).
        monkeypatch.setattr(builtins, "open", counted_open)
        monkeypatch.setattr(io, "open", counted_open)
        monkeypatch.setattr(shutil, "disk_usage", usage)

    def _under(self, path) -> bool:
        return os.path.realpath(path).startswith(self.directory + os.sep)

    def take(self, pages: int) -> None:
        with self._lock:
            if self.pages is not None and self.used + pages > self.pages:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.used += pages


class _PagedFile:
    """A file that takes its pages from a :class:`PageBudget` before it grows into them."""

    def __init__(self, raw, budget: PageBudget) -> None:
        self.raw = raw
        self.budget = budget
        self.size = 0

    def write(self, data) -> int:
        size = self.size + memoryview(data).nbytes
        self.budget.take(-(-size // PAGE) - -(-self.size // PAGE))
        self.size = size
        return self.raw.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return self.raw.__exit__(*exc_info)

    def __getattr__(self, name):
        return getattr(self.raw, name)  # flush, fileno, close, tell
