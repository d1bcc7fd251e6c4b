"""Give host memory that was freed back to the system.

glibc keeps freed heap memory mapped in the process (it is reused by later allocations, but
counts in the resident set until then): tensors of a few megabytes come from its heap, and
freeing them does not lower the RSS. :func:`give_back_freed_memory` asks it to return every free
page (``malloc_trim(0)``). Called where a large amount of memory was freed that nothing will
reuse soon: the optimizer state a disk tier has just moved to its files.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():  # type: ignore[no-untyped-def]
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc: nothing to ask


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the system (a no-op where the C library has no ``malloc_trim``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
