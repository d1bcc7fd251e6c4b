"""Every copy between host and device, and every ordering decision about it.

This is the one file in the package that calls ``wait_stream``, ``wait_event``, ``record_stream``
or synchronises. Everything else asks it for a copy and gets back the copy's *ready event*.

Note: [Copy ordering]
    On CUDA there are three streams. *Compute* is the caller's current stream: layers run there.
    Loads run on ``load_stream`` and offloads on ``offload_stream`` so that they overlap compute.
    The rules, each enforced here and nowhere else:

    1. A load records a ready event; compute waits on it before touching the destination.
    2. A load into memory that compute may still be reading waits first for the events that say
       every earlier reader is done with it (a slot's free event and the write-back that read
       its buffers), or, for freshly allocated memory, for all compute issued so far: the caching
       allocator may hand out a block that a queued kernel still reads. The destination is marked
       as used by ``load_stream`` so that, if it is freed early (an exception), the allocator does
       not hand it out while the copy may still write it.
    3. An offload waits for all compute issued so far (its source was produced there) and marks
       the source as used by ``offload_stream`` so the allocator does not reuse it before the copy
       has read it. A source that later compute may change in place (a boundary activation the
       next layer may update in place, buffers the next microbatch updates) is first copied on
       the compute stream, and the private copy is what travels. Compute that overwrites memory
       an offload reads (a gradient buffer) waits for that offload's ready event.
    4. Host memory is handed back to the CPU only once the copies touching it are done: an
       offload's destination is read by the CPU (optimizer, user code) after its ready event,
       and a load's source may be overwritten (optimizer step, next batch, shadow refresh) only
       after the load. :meth:`CopyStreams.wait_host` is the only blocking call: at the end of
       each backward, at the end of a forward without autograd, and when buffers were written
       back.
    5. After an exception the streams are drained (:meth:`CopyStreams.drain`): whatever was in
       flight finishes before compute or the CPU touch that memory again.

    On the CPU, and when asynchronous copies are switched off, copies are synchronous and every
    event is ``None``; the same calls run, so tests on the CPU go through the same code.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch
from torch.profiler import record_function

Event = torch.cuda.Event

#: Set to 1 to make every copy synchronous, for bisecting a suspected ordering bug.
SYNC_ENV_VAR = "OFFLOAD_SYNC_COPIES"


def synchronous_copies_requested() -> bool:
    return os.environ.get(SYNC_ENV_VAR, "0") not in ("", "0", "false", "False")


class CopyStreams:
    """Host↔device copies for one compute device.

    Args:
        device: the compute device.
        synchronous: force synchronous copies even where asynchronous ones are possible (also
            switched on by the environment variable ``OFFLOAD_SYNC_COPIES=1``). Costs the overlap
            of copies with compute; useful to rule out an ordering bug.
    """

    def __init__(self, device: torch.device, synchronous: bool = False) -> None:
        self.device = device
        self.is_async = device.type == "cuda" and not (synchronous or synchronous_copies_requested())
        if self.is_async:
            # Loads run here so the next slice's host-to-device copy overlaps this slice's compute.
            self.load_stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
            # Offloads run here so gradients and activations leave while the next slice computes.
            self.offload_stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
        else:
            self.load_stream = None
            self.offload_stream = None
        # Bytes copied so far, per direction: benchmarks compare them with the link's bandwidth.
        self.loaded_bytes = 0
        self.offloaded_bytes = 0
        self._last_load: Event | None = None

    @property
    def pins_host_memory(self) -> bool:
        """Whether host buffers should be pinned: only pinned memory copies asynchronously."""
        return self.device.type == "cuda"

    def _compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    # -- loads -------------------------------------------------------------------------------

    def load(self, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event | None] = (),
             after_queued_compute: bool = False, label: str = "offload::load") -> Event | None:
        """Copy ``src`` (host) into ``dst`` (device); return the ready event.

        Args:
            after: events that must complete first: the destination's free event, or the offload
                that filled ``src``.
            after_queued_compute: wait for all compute issued so far before writing ``dst``: it was
                just allocated on the compute stream, or queued compute may still read it (rule 2).
        """
        self.loaded_bytes += src.numel() * src.element_size()
        with record_function(label):
            if not self.is_async:
                dst.copy_(src)
                return None
            assert self.load_stream is not None
            if after_queued_compute:
                # Rule 2: the allocator may have recycled a block that queued compute still reads.
                self.load_stream.wait_stream(self._compute_stream())
            for event in after:
                if event is not None:
                    # Rule 2: earlier readers of the destination (or the source's offload) first.
                    self.load_stream.wait_event(event)
            with torch.cuda.stream(self.load_stream):
                dst.copy_(src, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.load_stream)
            # Rule 2: if dst is freed before compute used it, the copy may still be writing it.
            dst.record_stream(self.load_stream)
            self._last_load = ready
            return ready

    def to_device(self, src: torch.Tensor, after: Iterable[Event | None] = ()) -> tuple[torch.Tensor, Event | None]:
        """A new device tensor holding ``src``; returns it with its ready event."""
        if src.device == self.device:
            return src, None
        dst = torch.empty_like(src, device=self.device)
        return dst, self.load(dst, src, after=after, after_queued_compute=True)

    # -- offloads ----------------------------------------------------------------------------

    def offload(self, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event | None] = (),
                src_may_change: bool = False, label: str = "offload::offload") -> Event | None:
        """Copy ``src`` (device) into ``dst`` (host); return the ready event.

        Args:
            after: events that must complete before ``dst`` may be overwritten (a pending load
                that still reads it).
            src_may_change: later compute may update ``src`` in place; copy a private snapshot.
        """
        return self.offload_many([dst], [src], after=after, src_may_change=src_may_change, label=label)

    def offload_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                     after: Iterable[Event | None] = (), src_may_change: bool = False,
                     label: str = "offload::offload") -> Event | None:
        """Like :meth:`offload` for several tensors at once, with one ready event for all."""
        self.offloaded_bytes += sum(src.numel() * src.element_size() for src in srcs)
        with record_function(label):
            if not self.is_async:
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src)
                return None
            assert self.offload_stream is not None
            if src_may_change:
                # Rule 3: a private copy, taken on compute before any later in-place update.
                srcs = [src.clone() for src in srcs]
            # Rule 3: the sources were produced by compute issued so far.
            self.offload_stream.wait_stream(self._compute_stream())
            for event in after:
                if event is not None:
                    # A previous load still reads this host memory.
                    self.offload_stream.wait_event(event)
            with torch.cuda.stream(self.offload_stream):
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.offload_stream)
            for src in srcs:
                # Rule 3: keep the allocator from recycling each source before the copy has read it.
                src.record_stream(self.offload_stream)
            return ready

    def to_host(self, src: torch.Tensor, host_device: torch.device) -> torch.Tensor:
        """A host copy of ``src``, complete when this returns (for small, rare copies)."""
        if src.device == host_device:
            return src
        dst = torch.empty_like(src, device=host_device)
        self.wait_host(self.offload(dst, src))
        return dst

    # -- ordering ----------------------------------------------------------------------------

    def wait_ready(self, event: Event | None) -> None:
        """Make compute wait for a copy: a load it reads (rule 1), or an offload still reading a
        device buffer that compute is about to overwrite (rule 3)."""
        if event is not None:
            # Rules 1 and 3: compute must not touch the memory before that copy is done with it.
            self._compute_stream().wait_event(event)

    def compute_done(self) -> Event | None:
        """An event marking all compute issued so far: a device buffer's free event."""
        if not self.is_async:
            return None
        event = torch.cuda.Event()
        event.record(self._compute_stream())
        return event

    def wait_host(self, event: Event | None) -> None:
        """Block the CPU until ``event`` has completed (rule 4)."""
        if event is not None:
            # Rule 4: the CPU is about to read (or overwrite) host memory this copy touches.
            event.synchronize()

    def wait_host_all(self, events: Iterable[Event | None]) -> None:
        for event in events:
            self.wait_host(event)

    def wait_loads_done(self) -> None:
        """Block the CPU until every load issued so far has read its host memory (rule 4).

        Loads complete in issue order (one stream), so the last one stands for all.
        """
        self.wait_host(self._last_load)
        self._last_load = None

    def drain(self) -> None:
        """After an exception: let every copy in flight finish before anything reuses its memory (rule 5)."""
        if not self.is_async:
            return
        assert self.load_stream is not None and self.offload_stream is not None
        compute = self._compute_stream()
        # Rule 5: device memory the side streams touch is reused by compute next.
        compute.wait_stream(self.load_stream)
        compute.wait_stream(self.offload_stream)
        # Rule 5: host memory they touch is reused by the CPU next.
        self.load_stream.synchronize()
        self.offload_stream.synchronize()
        self._last_load = None
