"""Reusable host byte buffers for gradients and boundary activations.

Pinning host memory is slow (it maps pages for the device) and unpinned buffers of this size are
handed back to the OS on free and faulted in again on reuse, so buffers are allocated once and
reused. A buffer is handed out again only when nothing outside the pool refers to its memory:
a gradient the user still holds as ``.grad``, or an activation autograd still keeps for backward,
keeps its buffer out of circulation. There is no "return" call to forget.

This file allocates and recycles; the copies into and out of buffers belong to ``copies.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backend import Event


def _storage_use_count(tensor: torch.Tensor) -> int | None:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    return int(use_count(tensor.untyped_storage()._cdata))


@dataclass
class HostBuffer:
    """A pooled host byte buffer.

    Attributes:
        data: the bytes (``torch.uint8``), pinned when copies are asynchronous.
        read_event: ready event of the last load that read this buffer; an offload into it must
            wait for it. ``None`` on the CPU.
        write_event: ready event of the last offload that wrote this buffer; the CPU must wait
            for it before writing the buffer (the buffer may be idle while that copy is still
            running: its tensor was dropped, ``model(x).detach()``). ``None`` on the CPU.
    """

    data: torch.Tensor
    read_event: Event | None = None
    write_event: Event | None = None
    _idle_use_count: int | None = None
    _taken_walk: int = 0
    _allocated_walk: int = 0

    def is_idle(self) -> bool:
        count = _storage_use_count(self.data)
        # Without a way to count references, never reuse: correct, only slower.
        return count is not None and self._idle_use_count is not None and count <= self._idle_use_count


class HostBufferPool:
    """Exact-size host buffers, reused once nothing else refers to them.

    Args:
        allocate: host byte allocator: pinned memory when copies are asynchronous (see
            ``CopyStreams.empty_host``).
        size_class: the bytes a buffer for a request of ``nbytes`` has (at least ``nbytes``), so
            that requests of nearby sizes share buffers; default: exactly ``nbytes``. For pinned
            memory, ``pinned.size_class``: a buffer registered for one batch's activations then
            serves the next batch's, a little longer or shorter, instead of registering anew.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor],
                 size_class: Callable[[int], int] | None = None) -> None:
        self.allocate = allocate
        self.size_class = size_class
        self._buffers: dict[int, list[HostBuffer]] = {}
        self._walk = 0  # walks ended, either way: the one clock buffers age by
        self._backward_walks = [-1, -1]  # the numbers of the last two backward walks

    def take(self, nbytes: int) -> HostBuffer:
        """An idle buffer of ``nbytes`` (or of its size class: callers use the first ``nbytes``),
        allocated if none is idle."""
        if self.size_class is not None:
            nbytes = self.size_class(nbytes)
        for buffer in self._buffers.get(nbytes, ()):
            if buffer.is_idle():
                buffer._taken_walk = self._walk
                return buffer
        data = self.allocate(nbytes)
        buffer = HostBuffer(data)
        buffer._idle_use_count = _storage_use_count(data)
        buffer._taken_walk = buffer._allocated_walk = self._walk
        self._buffers.setdefault(nbytes, []).append(buffer)
        return buffer

    def end_step(self) -> None:
        """A backward walk ended: free idle buffers not taken since the backward before the last
        one ended, in this step or the one before (the shapes changed)."""
        self._keep(lambda b: b._taken_walk > self._backward_walks[0])
        self._backward_walks = [self._backward_walks[1], self._walk]
        self._walk += 1

    def end_forward(self) -> None:
        """A forward walk ended: free idle buffers allocated since the last backward and taken in
        neither this walk nor the one before. Forwards that build a graph no backward follows (an
        evaluation run without ``torch.no_grad()`` over batches of changing shapes) allocate
        buffers of new sizes each time, which backwards would never age; a buffer allocated before
        the last backward ended is the steps' to free, even when such a forward takes it too."""
        last_backward = self._backward_walks[1]
        self._keep(lambda b: b._allocated_walk <= last_backward or b._taken_walk >= self._walk - 1)
        self._walk += 1

    def _keep(self, wanted: Callable[[HostBuffer], bool]) -> None:
        """Free the idle buffers that are not ``wanted``."""
        for nbytes in list(self._buffers):
            kept = [b for b in self._buffers[nbytes] if wanted(b) or not b.is_idle()]
            if kept:
                self._buffers[nbytes] = kept
            else:
                del self._buffers[nbytes]

    def buffers(self) -> list[HostBuffer]:
        """Every buffer the pool holds, idle or not."""
        return [buffer for buffers in self._buffers.values() for buffer in buffers]

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool, idle or not."""
        return sum(nbytes * len(buffers) for nbytes, buffers in self._buffers.items())
