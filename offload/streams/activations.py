"""Boundary activations (and buffer snapshots) on their way to the host and back.

A tensor is offloaded into a pooled host buffer as soon as compute has produced it, and loaded
back to the device one step before backward needs it. The host copy travels with its ready event;
the pooled buffer remembers the event of the load that last read it, so its next offload cannot
overwrite it early.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import Event
from .copies import CopyStreams
from .host_buffers import HostBuffer, HostBufferPool
from .host_storage import typed_view


@dataclass
class OffloadTicket:
    """What is needed, besides the host tensor itself, to load an offloaded tensor back.

    The host tensor is not kept here on purpose: the caller hands it to ``ctx.save_for_backward``,
    so autograd frees it with the graph and its buffer returns to the pool even while the ticket
    (held by the autograd context) lives on.

    Attributes:
        ready: completes when the offload has written the host tensor.
        buffer: the pooled buffer behind the host tensor.
    """

    ready: Event | None
    buffer: HostBuffer


class ActivationOffloader:
    """Offloads device tensors to pooled host buffers and loads them back.

    Args:
        copies: the copy engine.
        pool: where the host buffers come from.
    """

    def __init__(self, copies: CopyStreams, pool: HostBufferPool) -> None:
        self.copies = copies
        self.pool = pool
        self.offloaded_bytes = 0

    def offload(self, tensor: torch.Tensor) -> tuple[torch.Tensor, OffloadTicket]:
        """Start copying ``tensor`` into a host buffer, as it is now: later compute may update it
        in place (the next layer, the next microbatch) without changing the host copy.

        Returns:
            The host tensor (valid once the ticket's ``ready`` completes) and the ticket.
        """
        source = tensor if tensor.is_contiguous() else tensor.contiguous()
        nbytes = source.numel() * source.element_size()
        buffer = self.pool.take(nbytes)
        host = typed_view(buffer.data, 0, source.dtype, source.shape)
        ready = self.copies.offload(host, source, after=(buffer.read_event,), src_may_change=source is tensor,
                                    label="offload::offload activation")
        buffer.write_event = ready
        self.offloaded_bytes += nbytes
        return host, OffloadTicket(ready, buffer)

    def copy_on_host(self, host_tensor: torch.Tensor) -> tuple[torch.Tensor, OffloadTicket]:
        """A copy of a host tensor in a pooled buffer, made now on the CPU: a snapshot that later
        host writes do not change, in memory that loads can read asynchronously.

        Returns:
            The pooled copy and its ticket (``ready`` is ``None``: the copy is complete).
        """
        nbytes = host_tensor.numel() * host_tensor.element_size()
        buffer = self.pool.take(nbytes)
        # Rule 4 of [Copy ordering]: a load may still be reading what this buffer held before,
        # and an offload may still be writing it (its tensor dropped before the copy landed).
        self.copies.wait_host(buffer.read_event)
        self.copies.wait_host(buffer.write_event)
        copy = typed_view(buffer.data, 0, host_tensor.dtype, host_tensor.shape)
        copy.copy_(host_tensor)
        return copy, OffloadTicket(None, buffer)

    def load_host(self, host_tensor: torch.Tensor) -> tuple[torch.Tensor, Event | None]:
        """Start copying a host tensor the caller owns (a model input) to the device.

        Memory the copy engine did not allocate may be pageable, and an asynchronous copy from
        pageable memory may block the CPU until it is done (CUDA stages it through a bounce
        buffer): such a tensor is first copied on the CPU into a pooled pinned buffer.

        Returns:
            The new device tensor and its ready event.
        """
        if host_tensor.device.type != "cpu" or self.copies.is_pinned(host_tensor):
            return self.copies.to_device(host_tensor)
        staged, ticket = self.copy_on_host(host_tensor.contiguous())
        device_tensor, ready = self.copies.to_device(staged)
        ticket.buffer.read_event = ready
        return device_tensor, ready

    def load(self, ticket: OffloadTicket, host_tensor: torch.Tensor) -> tuple[torch.Tensor, Event | None]:
        """Start copying an offloaded tensor back to the device.

        Args:
            ticket: the ticket :meth:`offload` returned.
            host_tensor: the host tensor, as autograd handed it back from ``ctx.saved_tensors``.

        Returns:
            The new device tensor and its ready event (compute must wait on it).
        """
        device_tensor = torch.empty_like(host_tensor, device=self.copies.device)
        ready = self.copies.load(device_tensor, host_tensor, after=(ticket.ready,), after_queued_compute=True,
                                 label="offload::load activation")
        ticket.buffer.read_event = ready
        return device_tensor, ready
