"""Pinned host memory of the size asked for.

PyTorch's caching host allocator (``torch.empty(..., pin_memory=True)``) rounds every block up to
a power of two: a 2.1 GiB slice takes 4 GiB of page-locked RAM. The host copies, shadows and
pooled gradient buffers are most of the host memory offloading uses, so for them this allocator
maps exactly the pages asked for (anonymous ``mmap``, page-aligned) and registers them with the
driver (``cudaHostRegister``), which pins them as ``cudaHostAlloc`` would: copies from and to them
are asynchronous, and ``Tensor.is_pinned()`` is true. The registration is undone, and the pages
unmapped, when the last tensor that uses them is freed.

Small requests (boundary activations of a small batch, below ``small_nbytes``) still go to the
caching allocator: registering costs a driver call and a system call each time, where the caching
allocator reuses its blocks, and rounding a small block wastes little.

If registration fails (a driver that refuses it, a locked-memory limit), the allocator warns once
and falls back to the caching allocator, which is correct, only larger.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

#: Below this many bytes a request goes to PyTorch's caching host allocator.
SMALL_NBYTES = 1 << 20

Register = Callable[[int, int], bool]
Unregister = Callable[[int], None]


class _Mapping(mmap.mmap):
    """Anonymous pages that undo their registration before they are unmapped."""

    on_free: Callable[[], None] | None = None

    def __del__(self) -> None:
        if self.on_free is not None:
            self.on_free()


class PinnedAllocator:
    """Host byte buffers pinned at their requested size (rounded to whole pages).

    Args:
        register: pins ``(address, nbytes)``; returns whether it worked. Default: the CUDA
            driver's ``cudaHostRegister``.
        unregister: unpins an address ``register`` pinned. Default: ``cudaHostUnregister``.
        small: allocates a small request (default: PyTorch's caching host allocator).
        small_nbytes: requests below this go to ``small``.
    """

    def __init__(self, register: Register | None = None, unregister: Unregister | None = None,
                 small: Callable[[int], torch.Tensor] | None = None, small_nbytes: int = SMALL_NBYTES) -> None:
        self._register = register if register is not None else _cuda_register
        self._unregister = unregister if unregister is not None else _cuda_unregister
        self._small = small if small is not None else _caching_pinned
        self.small_nbytes = small_nbytes
        self._lock = threading.Lock()
        self._failed = False
        #: bytes asked for, and bytes pinned for them, by the buffers alive now
        self.requested_bytes = 0
        self.reserved_bytes = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host memory (``torch.uint8``)."""
        if nbytes < self.small_nbytes or self._failed:
            tensor = self._small(nbytes)
            self._count(nbytes, _caching_reserve(nbytes))
            # The caching allocator keeps the block when the tensor dies: count it as long as the tensor lives.
            _on_storage_free(tensor, lambda: self._count(-nbytes, -_caching_reserve(nbytes)))
            return tensor
        pages = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        mapping = _Mapping(-1, pages, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(view)
        del view  # a live export would keep the mapping from closing
        if not self._register(address, pages):
            mapping.close()
            self._fall_back()
            return self.empty(nbytes)
        self._count(nbytes, pages)

        def free(address: int = address) -> None:
            self._unregister(address)
            self._count(-nbytes, -pages)

        mapping.on_free = free
        # The tensor's storage holds the mapping: it is unmapped once no tensor uses it.
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)

    def _count(self, requested: int, reserved: int) -> None:
        with self._lock:
            self.requested_bytes += requested
            self.reserved_bytes += reserved

    def _fall_back(self) -> None:
        with self._lock:
            if self._failed:
                return
            self._failed = True
        warnings.warn("registering host memory with the CUDA driver failed; pinned buffers now come from PyTorch's "
                      "caching host allocator, which rounds each one up to a power of two (raise the locked-memory "
                      "limit, ulimit -l, if that is what refused it)", RuntimeWarning, stacklevel=3)


def _on_storage_free(tensor: torch.Tensor, callback: Callable[[], None]) -> None:
    """Call ``callback`` once the memory of ``tensor`` is freed (its storage's Python object is
    kept as long as the storage lives)."""
    try:
        weakref.finalize(tensor.untyped_storage(), callback)
    except TypeError:  # a storage type without weak references: count it for ever
        pass


def _caching_reserve(nbytes: int) -> int:
    """What PyTorch's caching host allocator reserves for ``nbytes``: the next power of two."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


def _caching_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _cudart() -> Any:
    return torch.cuda.cudart()


def _cuda_register(address: int, nbytes: int) -> bool:
    try:
        error = _cudart().cudaHostRegister(address, nbytes, 0)
    except (RuntimeError, AttributeError):
        return False
    return int(error) == 0


def _cuda_unregister(address: int) -> None:
    _cudart().cudaHostUnregister(address)
