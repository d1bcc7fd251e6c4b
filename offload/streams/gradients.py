"""Parameter gradients: summed on the device over microbatches, then offloaded to the host.

Each slice's gradients are accumulated into one of two persistent device gradient buffers and
leave for the host in a single copy while the previous slice computes; the two buffers alternate,
and compute writes into one only after its previous offload has read it. The host side is a
pooled buffer whose views are handed to autograd as the parameters' gradients: autograd adopts
them as ``.grad`` when ``.grad`` is empty and adds them otherwise, so the buffer is reused as soon
as nobody holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .copies import CopyStreams, Event
from .host_buffers import HostBufferPool
from .host_storage import Entry, _align, _itemsize, typed_view


@dataclass
class SliceGradients:
    """One slice's gradients being accumulated on the device.

    Attributes:
        views: per parameter of the slice, its gradient's view into the device buffer, or ``None``
            where no gradient is needed.
        received: per parameter, whether any microbatch produced a gradient yet.
        nbytes: bytes in use at the front of the device buffer.
    """

    views: list[torch.Tensor | None]
    received: list[bool]
    nbytes: int
    buffer_index: int
    entries: Sequence[Entry]

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one microbatch's gradients (aligned with :attr:`views`)."""
        first_dst, first_src, add_dst, add_src = [], [], [], []
        for j, grad in enumerate(grads):
            view = self.views[j]
            if grad is None or view is None:
                continue
            if self.received[j]:
                add_dst.append(view)
                add_src.append(grad)
            else:
                first_dst.append(view)
                first_src.append(grad)
                self.received[j] = True
        if first_dst:
            torch._foreach_copy_(first_dst, first_src)
        if add_dst:
            torch._foreach_add_(add_dst, add_src)


@dataclass
class PendingGradients:
    """Gradients on their way to the host: valid once ``ready`` has completed."""

    host_views: list[torch.Tensor | None]
    ready: Event | None


class GradientOffloader:
    """Device accumulation buffers and the offload of finished slice gradients.

    Args:
        copies: the copy engine.
        pool: where host gradient buffers come from.
        max_nbytes: gradient bytes of the largest slice.
    """

    def __init__(self, copies: CopyStreams, pool: HostBufferPool, max_nbytes: int) -> None:
        self.copies = copies
        self.pool = pool
        self._buffers = [torch.empty(max_nbytes, dtype=torch.uint8, device=copies.device) for _ in range(2)]
        self._offloaded: list[Event | None] = [None, None]
        self._next = 0
        self.offloaded_bytes = 0

    def begin(self, entries: Sequence[Entry], needed: Sequence[bool]) -> SliceGradients:
        """A device buffer for one slice's gradients, laid out for the parameters in ``needed``."""
        index = self._next
        self._next = 1 - index
        # Rule 3 of [Copy ordering]: the previous offload from this buffer must have read it.
        self.copies.wait_ready(self._offloaded[index])
        offset = 0
        views: list[torch.Tensor | None] = []
        for entry, want in zip(entries, needed):
            if not want:
                views.append(None)
                continue
            views.append(typed_view(self._buffers[index], offset, entry.device_dtype, entry.shape))
            offset = _align(offset + entry.shape.numel() * _itemsize(entry.device_dtype))
        return SliceGradients(views, [False] * len(views), offset, index, entries)

    def offload(self, grads: SliceGradients, label: str = "offload::offload gradients") -> PendingGradients:
        """Start copying a slice's finished gradients to a host buffer."""
        if not any(grads.received):
            return PendingGradients([None] * len(grads.views), None)
        host = self.pool.take(grads.nbytes)
        device = self._buffers[grads.buffer_index]
        ready = self.copies.offload(host.data, device[:grads.nbytes], after=(host.read_event,), label=label)
        self._offloaded[grads.buffer_index] = ready
        self.offloaded_bytes += grads.nbytes
        host_views: list[torch.Tensor | None] = []
        for view, received in zip(grads.views, grads.received):
            if view is None or not received:
                host_views.append(None)
                continue
            offset = view.storage_offset() * view.element_size() - device.storage_offset()
            host_views.append(typed_view(host.data, offset, view.dtype, view.shape))
        return PendingGradients(host_views, ready)

    def finish(self, pending: Sequence[PendingGradients]) -> None:
        """Block until every pending gradient is on the host: the optimizer reads them next."""
        self.copies.wait_host_all(p.ready for p in pending)
