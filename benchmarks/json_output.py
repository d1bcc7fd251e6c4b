"""The checks the benchmarks make on their output paths right after parsing their arguments: that
the ``--json`` file can be written once the run is done, and that the ``--dir`` they write their
files under is a directory (made here when missing), so that a mistyped path fails in a second with
one line from the parser rather than after minutes of measuring with a traceback."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def check_json_path(parser: argparse.ArgumentParser, path: str | os.PathLike[str] | None, flag: str = "--json") -> None:
    """Refuse (``parser.error``: exit status 2) an output ``path`` that is a directory, or whose
    directory neither exists nor can be made; a missing directory is made here. ``None`` (no
    ``--json`` given) passes."""
    if path is None:
        return
    path = Path(path).expanduser()
    if path.is_dir():
        parser.error(f"{flag} {path}: is a directory; give a file name")
    above = path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        parser.error(f"{flag} {path}: {above} is a file, not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # no permission, say
        parser.error(f"{flag} {path}: its directory cannot be made ({error.strerror or error})")
    if not os.access(path.parent, os.W_OK):
        parser.error(f"{flag} {path}: its directory is not writable")


def check_dir(parser: argparse.ArgumentParser, path: str | os.PathLike[str] | None, flag: str = "--dir") -> None:
    """Make the directory ``path`` (and its missing parents), as the run will write there; refuse
    (``parser.error``: exit status 2) one that is a file, or that cannot be made or written to.
    ``None`` (no ``--dir`` given: a temporary directory) passes."""
    if path is None:
        return
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        parser.error(f"{flag} {path}: is a file, not a directory")
    except OSError as error:  # a file above it, no permission
        parser.error(f"{flag} {path}: cannot be made ({error.strerror or error})")
    if not os.access(path, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path}: is not writable")
