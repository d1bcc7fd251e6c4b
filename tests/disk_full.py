"""A full disk: for the disk tier's files of the given names (``posix_fallocate`` refuses them), or
as the free space a filesystem reports (``shutil.disk_usage``)."""

from __future__ import annotations

import errno
import os
import shutil

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
