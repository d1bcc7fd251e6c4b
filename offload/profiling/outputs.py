"""Where the results go: whether a file can be written at a path, asked before a long run writes it.

Holds :func:`check_output_path`, which :meth:`Profile.write_csv
<offload.profiling.results.Profile.write_csv>` and :meth:`Profile.plot
<offload.profiling.results.Profile.plot>` call before writing, and ``scripts/profile_memory.py``
calls for each output path before the first mode runs, so that a path it cannot write fails in
seconds rather than after every mode has run. Writing the files is the callers' own.
"""

from __future__ import annotations

import os
import tempfile


def check_output_path(path: str | os.PathLike[str], what: str = "output") -> None:
    """Raise if a file cannot be written at ``path``: it is a directory, or its directory is
    missing, is not a directory or cannot be written to. Leaves nothing behind: where ``path``
    does not exist yet, a nameless temporary file is made in its directory and removed.

    Args:
        path: the file to be written.
        what: what it is, for the message (``"--json"``, ``"the CSV"``).

    Raises:
        IsADirectoryError: ``path`` is a directory.
        NotADirectoryError: the directory part of ``path`` is a file.
        FileNotFoundError: the directory part of ``path`` does not exist.
        PermissionError: ``path``, or its directory, cannot be written to.

    Example::

        >>> check_output_path("/tmp", "the CSV")
        Traceback (most recent call last):
        IsADirectoryError: the CSV: '/tmp' is a directory; give the path of a file (in it, or elsewhere)
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what}: {path!r} is a directory; give the path of a file (in it, or elsewhere)")
    parent = os.path.dirname(path) or "."
    if not os.path.exists(parent):
        raise FileNotFoundError(f"{what}: cannot write {path!r}: its directory {parent!r} does not exist")
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"{what}: cannot write {path!r}: {parent!r} is not a directory")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{what}: cannot write {path!r}: the file is not writable")
        return
    try:
        # A file made and removed again: asking os.access is not enough where the file system
        # itself refuses (read-only mounts for the superuser, /proc).
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as error:
        raise PermissionError(f"{what}: cannot write {path!r}: cannot make a file in {parent!r} "
                              f"({error.strerror or error})") from None
