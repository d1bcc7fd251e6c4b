"""Every copy between host and device, and every ordering decision about it.

This is the one file in the package that decides when to wait, record, mark memory as used or
synchronise; the stream backend (``backend.py``) carries those decisions out on the device.
Everything else asks for a copy and gets back the copy's *ready event*.

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
       every forward and backward, when buffers were written back, and before a pooled host
       buffer is written on the CPU. Host tensors the user passes in are copied on the CPU into
       pooled pinned buffers first: an asynchronous copy from pageable memory may block. The
       next input of the same size in the same forward (the next microbatch's rows, a second
       input such as a mask) takes the same buffer, so each copy into it waits for the load of
       the one before.
    5. After an exception the streams are drained (:meth:`CopyStreams.drain`): whatever was in
       flight finishes before compute or the CPU touch that memory again.
    6. Host memory a copy reads or writes is not unmapped before the copy is done: each copy's
       ready event is handed to the backend with the host side (``mark_host_used``), and the
       pinned allocator waits for the last one before it unregisters and unmaps a freed buffer
       (Note: [Registered memory and copies in flight] in ``pinned.py``). The stream-ordering
       checker does not model unmapping, so the mutation test does not cover this one; the CPU
       tests of ``pinned.py`` do.

    Every wait, synchronisation and mark above is needed: the stream-ordering checker's mutation
    test (``tests/test_streamcheck.py``) leaves each one out in turn and a training scenario
    notices, except for the safety nets in Note: [Orderings the end of a walk covers] and the
    mark on a sparse gradient's indices and values (rule 3), whose release the checker does not
    follow (``UNSEEN`` in that test).

    On the CPU, and when asynchronous copies are switched off, copies are synchronous and every
    event is ``None``; the same calls run, so tests on the CPU go through the same code. The
    asynchronous path runs on the CPU too, under the stream-ordering checker (``offload.streamcheck``),
    which installs a simulated backend that defers copies and checks every access for races.

Note: [Copies under a torch.func transform]
    Without a graph (under ``torch.no_grad()``, or with nothing that requires grad) the model runs
    inside ``torch.func.vmap``, ``jvp`` and ``jacfwd`` as any forward (Note: [Transforms the walk
    refuses] in ``offload/autograd/refusals.py``). A
    gradient transform (``jvp``, ``jacfwd``) refuses every in-place operation on a tensor it did
    not wrap, and a slice's load writes the slot, its shadow and the staging buffers in place. Those
    are the walk's own memory, which the layers read as constants (as the plain model reads its
    parameters), so the load runs with the transforms excluded (:func:`outside_func_transforms`);
    the layers' compute, outside it, is transformed as in the plain model.

Note: [Orderings the end of a walk covers]
    Every forward and backward ends with the host waiting for its loads and for what it wrote
    back (rule 4), and an exception drains both side streams (rule 5). Those waits make the
    orderings below redundant today; they stay because they state the rule where the memory is
    used, and because work that lets the host run ahead of a walk's end (an overlapped optimizer,
    say) would remove that cover. The mutation test checks that each is still covered.

    - Marks of device memory as used by a side stream, for slots (loads, the second copy of a
      tied parameter a slice borrows, buffer restores and write-backs), loaded boundary
      activations and the caller's inputs loaded from the host: slots live as long as the model
      (the gradient summation buffers do not: a dropped model is freed at once, those buffers
      with it, so their offloads' marks are needed, as the mutation test shows), an activation
      loaded for a recompute (or a saved tensor loaded for an offloaded slice's backward) is
      freed early only when an exception ends the walk, after the drain, and compute waits for an
      input's load as soon as it is issued (``slice_walk.py:load_inputs``), before anything can
      free the input.
    - The host waiting for the last load of a pooled buffer before refreshing a slice's shadow,
      and offloads into a pooled buffer (boundary activations and saved tensors alike) waiting
      for the load that read it last: such a buffer is reused, and a shadow refreshed, only in a
      later walk, after the end of the walk that loaded it. Not so the host's wait before it
      copies into a pooled buffer (``copy_on_host``): a buffer a caller's input was staged in is
      taken again in the same forward by the next input of its size (rule 4), which the
      mutation test shows.
    - A buffer restore waiting for the offload of a later microbatch's buffer snapshot: the same
      forward waited for the write-back queued after it on the offload stream.
    - After an exception, compute waiting for the side streams: nothing it runs next touches
      their memory before the host has synchronised with them.
    - A slice loading a tied parameter it borrows waiting for the holder's pending update and
      for the last load of the holder's shadow before refreshing it (``_load_borrowed``): the
      holder's own load came first in the same walk (forward walks up, and backward finds the
      holder current from forward), and it waited for both already; the checker does not list
      them as asked. Its wait for the slot to be free of compute is covered by stream order: it
      is issued right after the slice's own load, on the same stream, which waited for it.
    - ``OffloadOptimizer.step()`` waiting for the loads before its updates write the host copies
      (``optimizer.py:step``): user code calls ``step()`` between walks, and every walk ends with
      the host waiting for its loads, so no load is in flight and the wait never reaches the
      backend (the checker does not list it as asked; the test of the lists notices if that
      changes). A forward without backward followed by ``step()`` on earlier gradients is ordered
      by the forward's own wait, which the mutation test shows is needed. Only ``step()`` called
      inside a walk (from a layer's forward hook) would rely on this one.
    - A resident slice's load waiting for the buffer write-back of the slot's last occupant
      (``device_slots.py:prefetch``, Note: [Resident slices] in ``resident_storage.py``):
      write-backs happen in forward only, where the resident slices come first, so the last
      write-back from the slot belongs to an earlier walk, which waited for it at its end.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence

import torch

from .labels import label as region
from .backend import Event, Stream, StreamBackend, backend_for
from .workers import HostWorker


def outside_func_transforms() -> contextlib.AbstractContextManager[object]:
    """A block where the walk writes its own memory, hidden from any ``torch.func`` transform
    the model runs under (Note: [Copies under a torch.func transform]); nothing otherwise."""
    if torch._C._are_functorch_transforms_active():
        return torch._C._DisableFuncTorch()  # type: ignore[return-value]
    return contextlib.nullcontext()


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
        backend = None if synchronous or synchronous_copies_requested() else backend_for(device)
        self.backend: StreamBackend | None = backend
        self.is_async = backend is not None
        if backend is not None:
            # Loads run here so the next slice's host-to-device copy overlaps this slice's compute.
            self.load_stream = backend.new_stream("load")
            # Offloads run here so gradients and activations leave while the next slice computes.
            self.offload_stream = backend.new_stream("offload")
        self._other_streams: list[Stream] = []  # side streams of collectives, drained with these
        # Bytes copied so far, per direction: benchmarks compare them with the link's bandwidth.
        self.loaded_bytes = 0
        self.offloaded_bytes = 0
        #: Device-to-host copies issued so far (each a copy call on the link; a benchmark divides).
        self.offload_copies = 0
        self._last_load: Event | None = None

    @property
    def pins_host_memory(self) -> bool:
        """Whether host buffers come from the backend (pinned): only such memory copies asynchronously."""
        return self.backend is not None

    def empty_host(self, nbytes: int, host_device: torch.device) -> torch.Tensor:
        """``nbytes`` of host memory on ``host_device`` for copies: pinned when copies are asynchronous."""
        if self.backend is not None and host_device.type == "cpu":
            return self.backend.empty_host(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=host_device)

    def _compute_stream(self) -> object:
        assert self.backend is not None
        return self.backend.current_stream()

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
        with region(label):
            backend = self.backend
            if backend is None:
                dst.copy_(src)
                return None
            if after_queued_compute:
                # Rule 2: the allocator may have recycled a block that queued compute still reads.
                backend.wait_stream(self.load_stream, self._compute_stream())
            for event in after:
                if event is not None:
                    # Rule 2: earlier readers of the destination (or the source's offload) first.
                    backend.wait_event(self.load_stream, event)
            backend.copy(dst, src, self.load_stream, to_device=True)
            ready = backend.record(self.load_stream)
            # Rule 6: src's pages must not be unmapped before the copy has read them.
            backend.mark_host_used(src, ready)
            # Rule 2: if dst is freed before compute used it, the copy may still be writing it.
            backend.mark_used(dst, self.load_stream)
            self._last_load = ready
            return ready

    def on_device(self, work: Callable[[], None], after: Iterable[Event | None] = (),
                  label: str = "offload::device copy") -> None:
        """Run ``work``, copies between device tensors (a resident slice's, Note: [Resident slices]
        in ``resident_storage.py``), on the compute stream now, after the events ``after``.

        On the compute stream they follow whatever wrote their sources before (an optimizer step,
        the caller's code between steps, the compute of this walk) without the host waiting, and
        what reads their destinations next is compute too. Nothing crosses the link, so the
        byte counters do not move.
        """
        with region(label):
            backend = self.backend
            if backend is not None:
                for event in after:
                    if event is not None:
                        # Rule 2: earlier readers (or writers) of the destination on a side stream first.
                        backend.wait_event(self._compute_stream(), event)
            work()

    def to_device(self, src: torch.Tensor, after: Iterable[Event | None] = ()) -> tuple[torch.Tensor, Event | None]:
        """A new device tensor holding ``src`` (host memory from :meth:`empty_host`); returns it
        with its ready event."""
        if src.device == self.device:
            return src, None
        dst = torch.empty_like(src, device=self.device)
        return dst, self.load(dst, src, after=after, after_queued_compute=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory that an asynchronous copy can use without blocking."""
        return self.backend is None or self.backend.is_pinned(tensor)

    # -- offloads ----------------------------------------------------------------------------

    def offload(self, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event | None] = (),
                src_may_change: bool = False, label: str = "offload::offload") -> Event | None:
        """Copy ``src`` (device) into ``dst`` (host); return the ready event.

        Args:
            after: events that must complete first: a pending load that still reads ``dst``, or
                a collective that still rewrites ``src``.
            src_may_change: later compute may update ``src`` in place; copy a private snapshot.
        """
        return self.offload_many([dst], [src], after=after, src_may_change=src_may_change, label=label)

    def offload_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                     after: Iterable[Event | None] = (), src_may_change: bool = False,
                     label: str = "offload::offload") -> Event | None:
        """Like :meth:`offload` for several tensors at once, with one ready event for all."""
        self.offloaded_bytes += sum(src.numel() * src.element_size() for src in srcs)
        self.offload_copies += len(srcs)
        with region(label):
            backend = self.backend
            if backend is None:
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src)
                return None
            if src_may_change:
                # Rule 3: a private copy, taken on compute before any later in-place update.
                srcs = [src.clone() for src in srcs]
            # Rule 3: the sources were produced by compute issued so far.
            backend.wait_stream(self.offload_stream, self._compute_stream())
            for event in after:
                if event is not None:
                    # A previous load still reads this host memory, or a collective the sources.
                    backend.wait_event(self.offload_stream, event)
            for dst, src in zip(dsts, srcs):
                backend.copy(dst, src, self.offload_stream, to_device=False)
            ready = backend.record(self.offload_stream)
            for dst in dsts:
                # Rule 6: dst's pages must not be unmapped before the copy has written them.
                backend.mark_host_used(dst, ready)
            for src in srcs:
                # Rule 3: keep the allocator from recycling each source before the copy has read it.
                backend.mark_used(src, self.offload_stream)
            return ready

    def to_host(self, src: torch.Tensor, host_device: torch.device) -> torch.Tensor:
        """A host copy of ``src``, complete when this returns (for small, rare copies)."""
        if src.device == host_device:
            return src
        nbytes = src.numel() * src.element_size()
        dst = self.empty_host(nbytes, host_device).view(src.dtype).view(src.shape)
        self.wait_host(self.offload(dst, src))
        return dst

    # -- ordering ----------------------------------------------------------------------------

    def wait_ready(self, event: Event | None) -> None:
        """Make compute wait for a copy: a load it reads (rule 1), or an offload still reading a
        device buffer that compute is about to overwrite (rule 3)."""
        if event is not None:
            assert self.backend is not None
            # Rules 1 and 3: compute must not touch the memory before that copy is done with it.
            self.backend.wait_event(self._compute_stream(), event)

    def compute_done(self) -> Event | None:
        """An event marking all compute issued so far: a device buffer's free event."""
        if self.backend is None:
            return None
        return self.backend.record(self._compute_stream())

    def wait_host(self, event: Event | None) -> None:
        """Block the CPU until ``event`` (a copy's, or a host worker's) has completed (rule 4)."""
        if event is None:
            return
        # Rule 4: the CPU is about to read (or overwrite) host memory this copy or work touches.
        if self.backend is None:
            event.synchronize()  # a host worker's event: the only kind there is without a backend
        else:
            self.backend.synchronize_event(event)

    def has_completed(self, event: Event | None) -> bool:
        """Whether ``event`` has completed, without waiting: a hint for what to do first. It orders
        nothing; memory the event guards is still waited for with :meth:`wait_host`."""
        return event is None or event.query()

    # -- host work ---------------------------------------------------------------------------

    def new_worker(self, role: str, num_threads: int | None = None, by_key: bool = False) -> HostWorker:
        """A host worker for work that runs beside the caller (an optimizer's update); ``by_key``:
        one that runs the ready work with the lowest key first (``workers.py``)."""
        if self.backend is None:
            return HostWorker(f"offload {role}", num_threads, by_key=by_key)
        return self.backend.new_worker(role, num_threads, by_key)

    def submit(self, worker: HostWorker, work: Callable[[], None], after: Iterable[Event | None] = (),
               key: float | None = None) -> Event:
        """Run ``work`` on ``worker`` after everything submitted to it before (on a worker
        ``by_key``: after nothing else there, in the order of ``key`` among what is ready), after
        what the calling thread did so far, and after the events ``after`` (copies it reads, other
        work); returns the event that completes when it has run."""
        events = [event for event in after if event is not None]
        if self.backend is None:
            if events:
                def waiting() -> None:
                    for event in events:
                        event.synchronize()
                    work()
                return worker.submit(waiting, key, lambda: all(event.query() for event in events))
            return worker.submit(work, key)
        return self.backend.submit(worker, work, events, key)

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
        backend = self.backend
        if backend is None:
            return
        compute = self._compute_stream()
        # Rule 5: device memory the side streams touch is reused by compute next.
        backend.wait_stream(compute, self.load_stream)
        backend.wait_stream(compute, self.offload_stream)
        for stream in self._other_streams:
            # Rule 5: a collective's stream may still rewrite gradients that compute reuses next.
            backend.wait_stream(compute, stream)
        # Rule 5: host memory they touch is reused by the CPU next.
        backend.synchronize_stream(self.load_stream)
        backend.synchronize_stream(self.offload_stream)
        self._last_load = None

    def new_side_stream(self, role: str) -> Stream:
        """Another side stream, for device work that overlaps compute (a collective's; see
        Note: [Device collectives] in ``collectives.py``); drained with the copy streams.

        Raises:
            RuntimeError: copies are synchronous (no backend, so no streams).
        """
        if self.backend is None:
            raise RuntimeError("internal error: a side stream was asked for with synchronous copies")
        stream = self.backend.new_stream(role)
        self._other_streams.append(stream)
        return stream
