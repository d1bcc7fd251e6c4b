"""Figures as text, and sizes read from text: what the table, the progress lines and errors share.

Holds :func:`parse_size` and :func:`format_size` (public, re-exported by the package), the helpers
that write a time, a ratio to the resident mode and an exception as one line, and the column
layout of a text table. It measures nothing and knows nothing of modes or results: the table
itself is :meth:`~offload.profiling.results.Profile.table`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``"100000"``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` (GB = 10**9, GiB = 2**30).

    Raises:
        ValueError: ``text`` is not a non-negative number with an optional known unit.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; use bytes (100000) or a number with a unit "
                         "(512MiB, 2GiB, 1.5GB)")
    return round(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: int | float | None) -> str:
    """``nbytes`` in GiB, MiB or KiB, e.g. ``"1.25 GiB"``; ``"n/a"`` for ``None``."""
    if nbytes is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}" if unit == "GiB" else f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def format_time(seconds: float | None) -> str:
    """``seconds`` in milliseconds, e.g. ``"12.5 ms"``; ``"n/a"`` for ``None``."""
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def format_ratio(ratio: float | None) -> str:
    """A ratio to the resident mode, e.g. ``"1.52x"``; ``"n/a"`` for ``None``."""
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def error_reason(error: BaseException) -> str:
    """``error`` as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``header`` and ``rows`` as lines of aligned columns, with a rule under the header."""
    widths = [max(len(str(row[k])) for row in [header, *rows]) for k in range(len(header))]
    # The first column (mode labels) reads best left-aligned, numbers right-aligned.
    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if k == 0 else str(c).rjust(w) for k, (c, w) in enumerate(zip(cells, widths)))
    return [line(header), line(["-" * w for w in widths]), *[line(row) for row in rows]]
