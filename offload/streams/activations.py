"""Boundary activations (and buffer snapshots) on their way to the host and back.

A tensor is offloaded into a pooled host buffer as soon as compute has produced it, and loaded
back to the device one step before backward needs it. The host copy travels with its ready event;
the pooled buffer remembers the event of the load that last read it, so its next offload cannot
overwrite it early. Host and device copies keep the tensor's layout (Note: [Layouts] in
``layouts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import Event
from .copies import CopyStreams
from .host_buffers import HostBuffer, HostBufferPool
from .flat_views import typed_view
from .layouts import Layout


@dataclass
class OffloadTicket:
    """What is needed, besides the host tensor itself, to load an offloaded tensor back.

    The host tensor is not kept here on purpose: the caller hands it to ``ctx.save_for_backward``,
    so autograd frees it with the graph and its buffer returns to the pool even while the ticket
    (held by the autograd context) lives on.

    Attributes:
        ready: completes when the offload has written the host tensor.
        buffer: the pooled buffer behind the host tensor.
        layout: the offloaded tensor's, which the load gives the device copy (alignment included);
            ``None`` for a copy made on the host.
    """

    ready: Event | None
    buffer: HostBuffer
    layout: Layout | None = None


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
        #: of which saved tensors of offloaded slices (Note: [Offloaded saved tensors])
        self.saved_bytes = 0

    def offload(self, tensor: torch.Tensor) -> tuple[torch.Tensor, OffloadTicket]:
        """Start copying ``tensor`` into a host buffer, as it is now: later compute may update it
        in place (the next layer, the next microbatch) without changing the host copy.

        Returns:
            The host tensor (valid once the ticket's ``ready`` completes) and the ticket.
        """
        layout = Layout.of(tensor)
        source = layout.addressed(tensor)
        nbytes = layout.span * tensor.element_size()
        buffer = self.pool.take(nbytes)
        memory = typed_view(buffer.data, 0, tensor.dtype, source.shape)
        ready = self.copies.offload(memory, source, after=(buffer.read_event,), src_may_change=True,
                                    label="offload::offload activation")
        buffer.write_event = ready
        self.offloaded_bytes += nbytes
        return layout.on(memory), OffloadTicket(ready, buffer, layout)

    def offload_saved(self, tensor: torch.Tensor) -> tuple[torch.Tensor, OffloadTicket]:
        """Start copying a tensor autograd saved into a host buffer, without a private snapshot
        first: autograd forbids changing a saved tensor in place before backward (it checks the
        version when unpacking), so the copy may read the tensor itself, and the device memory is
        freed as soon as compute drops it (rule 3 of [Copy ordering] keeps the allocator from
        reusing it before the copy has read it).

        Returns:
            The host tensor (valid once the ticket's ``ready`` completes) and the ticket.
        """
        layout = Layout.of(tensor)
        nbytes = layout.span * tensor.element_size()
        buffer = self.pool.take(nbytes)
        memory = typed_view(buffer.data, 0, tensor.dtype, torch.Size((layout.span,)))
        ready = self.copies.offload(memory, layout.addressed(tensor), after=(buffer.read_event,),
                                    label="offload::offload saved activation")
        buffer.write_event = ready
        self.offloaded_bytes += nbytes
        self.saved_bytes += nbytes
        return layout.on(memory), OffloadTicket(ready, buffer, layout)

    def load_saved(self, ticket: OffloadTicket, host_tensor: torch.Tensor) -> tuple[torch.Tensor, Event | None]:
        """Start copying a saved tensor that :meth:`offload_saved` offloaded back to the device, in
        its layout.

        Returns:
            The new device tensor and its ready event (compute must wait on it).
        """
        return self.load(ticket, host_tensor, label="offload::load saved activation")

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
        if host_tensor.device == self.copies.device:
            return host_tensor, None
        layout = Layout.of(host_tensor)
        source = layout.addressed(host_tensor)
        if host_tensor.device.type != "cpu" or self.copies.is_pinned(host_tensor):
            return self._load_host_memory(layout, source)
        staged, ticket = self.copy_on_host(source)
        device_tensor, ready = self._load_host_memory(layout, staged)
        ticket.buffer.read_event = ready
        return device_tensor, ready

    def _load_host_memory(self, layout: Layout, memory: torch.Tensor) -> tuple[torch.Tensor, Event | None]:
        """A new device tensor of ``layout``, loaded from the host ``memory`` it addresses."""
        device_tensor = layout.empty(memory.dtype, self.copies.device)
        ready = self.copies.load(layout.addressed(device_tensor), memory, after_queued_compute=True)
        return device_tensor, ready

    def load(self, ticket: OffloadTicket, host_tensor: torch.Tensor,
             label: str = "offload::load activation") -> tuple[torch.Tensor, Event | None]:
        """Start copying an offloaded tensor back to the device.

        Args:
            ticket: the ticket :meth:`offload` returned.
            host_tensor: the host tensor, as autograd handed it back from ``ctx.saved_tensors``.
            label: the copy's name in traces.

        Returns:
            The new device tensor and its ready event (compute must wait on it).
        """
        assert ticket.layout is not None, "an offloaded tensor's ticket has its layout"
        layout = ticket.layout
        device_tensor = layout.empty(host_tensor.dtype, self.copies.device)
        ready = self.copies.load(layout.addressed(device_tensor), layout.addressed(host_tensor), after=(ticket.ready,),
                                 after_queued_compute=True, label=label)
        # Rule 4: the pooled buffer is not written again before this load has read it.
        ticket.buffer.read_event = ready
        return device_tensor, ready
