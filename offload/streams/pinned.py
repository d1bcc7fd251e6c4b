"""Pinned host memory of the size asked for.

PyTorch's caching host allocator (``torch.empty(..., pin_memory=True)``) rounds every block up to
a power of two: a 2.1 GiB slice takes 4 GiB of page-locked RAM. The host copies, shadows and
pooled gradient buffers are most of the host memory offloading uses, so for them this allocator
maps exactly the pages asked for (anonymous ``mmap``, page-aligned) and registers them with the
driver (``cudaHostRegister``), which pins them as ``cudaHostAlloc`` would: copies from and to them
are asynchronous, and ``Tensor.is_pinned()`` is true. The registration is undone, and the pages
unmapped, when the last tensor that uses them is freed.

Where the kernel offers transparent huge pages on request (``/sys/kernel/mm/transparent_hugepage/
enabled`` set to ``madvise``, as on most distributions), each mapping of 2 MiB or more is advised
for them (``MADV_HUGEPAGE``) before its pages are first touched: the host update streams through
masters, shadows and gradients, and fused AdamW over huge-page mappings took 4-16 % less time than
over 4 KiB pages in each round of ``benchmarks/bench_hugepages.py`` on the 2-core runner
(``benchmarks/results/hugepages_cpu_2026-11-28.json``). ``OFFLOAD_HUGEPAGES=0`` leaves them out.

Small requests (boundary activations of a small batch, below ``small_nbytes``) still go to the
caching allocator: registering costs a driver call and a system call each time, where the caching
allocator reuses its blocks, and rounding a small block wastes little.

If registration fails (a driver or platform that refuses it, host memory running out), the
allocator warns once, naming the driver's error, and falls back to the caching allocator, which is
correct, only larger. The CUDA runtime keeps a refused call's error as the thread's last error,
which the next kernel launch check would raise as its own: it is cleared right after.
(``ulimit -l`` does not apply: the driver pins registered pages itself, outside ``RLIMIT_MEMLOCK``.)

Note: [Registered memory and copies in flight]
    The caching host allocator keeps a freed block until the copies that used it are done (it
    records an event at each copy). Registered mappings are unmapped when their last tensor dies,
    which may happen while an asynchronous copy still reads or writes them (a buffer dropped on
    an exception, a host copy replaced). The copy engine tells the allocator each copy's ready
    event (:meth:`PinnedAllocator.used_until`, from ``copies.py``), and freeing a mapping waits for
    the last one before it unregisters and unmaps the pages. Registration and unregistration run
    under the model's device (they may be called from a host worker, whose thread would otherwise
    talk to GPU 0), and the pages are excluded from ``fork()`` (``MADV_DONTFORK``, as
    ``cudaHostAlloc`` does): a child sharing them copy-on-write would move the parent's pages away
    from the addresses the driver pinned at its next write.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

#: Below this many bytes a request goes to PyTorch's caching host allocator.
SMALL_NBYTES = 1 << 20
#: A transparent huge page: mappings of at least this many bytes are advised for them.
HUGE_PAGE_NBYTES = 2 << 20

#: Pins ``(address, nbytes)``; returns True, or False or the driver's error text when refused.
Register = Callable[[int, int], "bool | str"]
Unregister = Callable[[int], None]


class _Mapping(mmap.mmap):
    """Anonymous pages that undo their registration before they are unmapped."""

    on_free: Callable[[_Mapping], None] | None = None
    #: The ready event of the last copy that read or wrote these pages (Note: [Registered memory
    #: and copies in flight]); ``None`` when none was asked for.
    last_use: Any = None

    def __del__(self) -> None:
        # At interpreter teardown the runtime and the modules it needs may be gone; the process's
        # exit releases the registration and the pages anyway.
        if self.on_free is not None and not sys.is_finalizing():
            self.on_free(self)


class PinnedAllocator:
    """Host byte buffers pinned at their requested size (rounded to whole pages).

    Args:
        register: pins ``(address, nbytes)``; returns whether it worked. Default: the CUDA
            driver's ``cudaHostRegister``.
        unregister: unpins an address ``register`` pinned. Default: ``cudaHostUnregister``.
        small: allocates a small request (default: PyTorch's caching host allocator).
        small_nbytes: requests below this go to ``small``.
        device: the CUDA device registration and unregistration run under (``None``: the
            calling thread's current device).
        clear_error: clears the runtime's last error after a refused registration. Default: the
            CUDA runtime's ``cudaGetLastError``.
        hugepages: advise mappings of 2 MiB or more for transparent huge pages (``None``: unless
            the environment sets ``OFFLOAD_HUGEPAGES=0``).
    """

    def __init__(self, register: Register | None = None, unregister: Unregister | None = None,
                 small: Callable[[int], torch.Tensor] | None = None, small_nbytes: int = SMALL_NBYTES,
                 device: torch.device | None = None, clear_error: Callable[[], None] | None = None,
                 hugepages: bool | None = None) -> None:
        self._register = register if register is not None else _cuda_register
        self._unregister = unregister if unregister is not None else _cuda_unregister
        self._small = small if small is not None else _caching_pinned
        self._clear_error = clear_error if clear_error is not None else _cuda_clear_last_error
        self.small_nbytes = small_nbytes
        self.device = device
        #: Whether mappings of HUGE_PAGE_NBYTES or more are advised for transparent huge pages
        #: (default: unless ``OFFLOAD_HUGEPAGES=0``).
        self.hugepages = os.environ.get("OFFLOAD_HUGEPAGES", "1") != "0" if hugepages is None else hugepages
        # Reentrant: a mapping's finalizer takes it, and garbage collection may run that finalizer
        # in a thread that holds it already.
        self._lock = threading.RLock()
        self._failed = False
        # Start address -> (live mapping, its bytes), for used_until (starts kept sorted for the
        # lookup). Weak: the tensors own their mappings.
        self._starts: list[int] = []
        self._mappings: dict[int, tuple[weakref.ref[_Mapping], int]] = {}
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
        if hasattr(mmap, "MADV_DONTFORK"):
            # Note: [Registered memory and copies in flight]: a fork must not share pinned pages.
            mapping.madvise(mmap.MADV_DONTFORK)
        if self.hugepages and pages >= HUGE_PAGE_NBYTES and hasattr(mmap, "MADV_HUGEPAGE"):
            # Before the registration faults the pages in: advice given after finds them placed.
            with contextlib.suppress(OSError):  # a kernel without THP refuses the advice: 4 KiB pages
                mapping.madvise(mmap.MADV_HUGEPAGE)
        view = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(view)
        del view  # a live export would keep the mapping from closing
        with self._on_device():
            registered = self._register(address, pages)
        if registered is not True:
            # The runtime keeps the refusal as this thread's last error; the next kernel launch
            # check would raise it as its own.
            self._clear_error()
            mapping.close()
            self._fall_back(registered if isinstance(registered, str) else None)
            return self.empty(nbytes)
        with self._lock:
            bisect.insort(self._starts, address)
            self._mappings[address] = (weakref.ref(mapping), pages)
        self._count(nbytes, pages)

        def free(freed: _Mapping, address: int = address) -> None:
            if freed.last_use is not None:
                # Note: [Registered memory and copies in flight]: no DMA into unpinned, unmapped pages.
                freed.last_use.synchronize()
            with self._on_device():
                self._unregister(address)
            with self._lock:
                self._starts.remove(address)
                self._mappings.pop(address, None)
            self._count(-nbytes, -pages)

        mapping.on_free = free
        # The tensor's storage holds the mapping: it is unmapped once no tensor uses it.
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)

    def used_until(self, tensor: torch.Tensor, event: Any) -> None:
        """A copy that ``event`` ends reads or writes ``tensor``: if ``tensor`` is in a mapping of
        this allocator, freeing that mapping waits for ``event`` (Note: [Registered memory and
        copies in flight]). Other memory is left alone: the caching allocator tracks its own."""
        if event is None:
            return
        address = tensor.data_ptr()
        with self._lock:
            at = bisect.bisect_right(self._starts, address) - 1
            if at < 0:
                return
            start = self._starts[at]
            ref, size = self._mappings[start]
            mapping = ref()
            if mapping is not None and address < start + size:
                mapping.last_use = event

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        if self.device is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def _count(self, requested: int, reserved: int) -> None:
        with self._lock:
            self.requested_bytes += requested
            self.reserved_bytes += reserved

    def _fall_back(self, error: str | None) -> None:
        with self._lock:
            if self._failed:
                return
            self._failed = True
        # Not ulimit -l: the driver pins registered pages outside RLIMIT_MEMLOCK.
        warnings.warn(f"registering host memory with the CUDA driver failed ({error or 'no error given'}); pinned "
                      f"buffers now come from PyTorch's caching host allocator, which is as fast but rounds each one "
                      f"up to a power of two (up to twice the pinned memory). If host memory ran out, a smaller model "
                      f"or fewer buffers (see docs/memory.md) will do; a driver or virtualised GPU without "
                      f"cudaHostRegister needs nothing", RuntimeWarning, stacklevel=3)


def size_class(nbytes: int) -> int:
    """The size a pooled pinned buffer for ``nbytes`` gets: below ``SMALL_NBYTES`` the request
    itself (the caching allocator rounds and reuses those); above, the next of four classes per
    power of two (``2**k`` times 1, 1.25, 1.5 or 1.75), whole pages. At most a quarter more memory,
    and requests that vary by less than that reuse one registered buffer."""
    if nbytes < SMALL_NBYTES:
        return nbytes
    step = 1 << (nbytes.bit_length() - 3)  # a quarter of the power of two at or below nbytes
    rounded = -(-nbytes // step) * step
    return -(-rounded // mmap.PAGESIZE) * mmap.PAGESIZE


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


def _cuda_register(address: int, nbytes: int) -> bool | str:
    try:
        cudart = _cudart()
        error = cudart.cudaHostRegister(address, nbytes, 0)
    except (RuntimeError, AttributeError, AssertionError) as failed:
        return str(failed) or type(failed).__name__
    if int(error) == 0:
        return True
    try:
        return f"error {int(error)}: {cudart.cudaGetErrorString(error)}"
    except (RuntimeError, AttributeError, TypeError):
        return f"error {int(error)}"


def _cuda_unregister(address: int) -> None:
    _cudart().cudaHostUnregister(address)


def _cuda_clear_last_error() -> None:
    """Reset the CUDA runtime's last error of this thread (``cudaGetLastError``), which PyTorch's
    binding lacks: through the runtime library this process has loaded."""
    runtime = _runtime_library()
    if runtime is not None:
        runtime.cudaGetLastError()


_runtime: list[Any] = []  # [the loaded libcudart, or None], once looked up


def _runtime_library() -> Any:
    """The CUDA runtime library PyTorch uses (the one mapped into this process, so its per-thread
    last error is the one PyTorch checks), or ``None`` when none is mapped (a static runtime)."""
    if not _runtime:
        library = None
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                paths = {line.split(None, 5)[-1].strip() for line in maps if "libcudart" in line}
        except OSError:
            paths = set()
        for path in sorted(paths):
            try:
                library = ctypes.CDLL(path)
                break
            except OSError:
                continue
        _runtime.append(library)
    return _runtime[0]
