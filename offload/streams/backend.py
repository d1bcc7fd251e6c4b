"""The stream and event operations the copy engine needs from a device, behind one small interface.

:class:`~offload.streams.CopyStreams` decides *what* is ordered after what (Note: [Copy ordering]);
a backend only carries those decisions out. :class:`CudaBackend` does it with CUDA streams and
events. A stream-ordering checker (``offload.streamcheck``) implements the same interface on the
CPU, with deferred copies and a happens-before race detector, so that the asynchronous code path
users run on a GPU also runs, and is checked, on machines without one.

Which backend a :class:`CopyStreams` uses is chosen when it is built: the one installed with
:func:`using_backend` if any (the checker does this), else :class:`CudaBackend` for a CUDA device,
else none (copies are synchronous and every ready event is ``None``).

:class:`CudaBackend` calls ``torch.cuda`` streams and events, not the device-generic
``torch.Stream`` / ``torch.Event`` / ``torch.accelerator``. On CUDA both reach the same runtime
calls, so switching would gain nothing there; it would only open a path to other accelerators
that no machine of ours can test. The choice is confined to this file: another accelerator gets
its own small backend, picked in :func:`backend_for`, and the ordering logic stays as it is.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .pinned import PinnedAllocator
from .workers import HostWorker

#: A backend's event: completes when the work recorded before it on its stream is done.
#: Opaque to the rest of the package, which only passes events back to the backend.
Event = Any
#: A backend's stream: a queue of device work that runs in order.
Stream = Any


class StreamBackend(abc.ABC):
    """Streams, events and asynchronous copies for one compute device.

    Every method is a primitive; none decides an ordering on its own.
    """

    device: torch.device

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream the caller's compute is queued on."""

    @abc.abstractmethod
    def new_stream(self, role: str) -> Stream:
        """A new stream; ``role`` names it in reports and profiles (``"load"``, ``"offload"``)."""

    @abc.abstractmethod
    def record(self, stream: Stream) -> Event:
        """An event that completes once the work queued on ``stream`` so far is done."""

    @abc.abstractmethod
    def wait_event(self, stream: Stream, event: Event) -> None:
        """Work queued on ``stream`` from now on starts after ``event``."""

    @abc.abstractmethod
    def wait_stream(self, stream: Stream, other: Stream) -> None:
        """Work queued on ``stream`` from now on starts after the work queued on ``other`` so far."""

    @abc.abstractmethod
    def synchronize_event(self, event: Event) -> None:
        """Block the calling thread until ``event`` has completed."""

    @abc.abstractmethod
    def synchronize_stream(self, stream: Stream) -> None:
        """Block the calling thread until the work queued on ``stream`` so far is done."""

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream, to_device: bool) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` without blocking the calling thread.

        ``to_device`` says which side is host memory: ``src`` for a load, ``dst`` for an offload.
        Host memory must come from :meth:`empty_host`, or the copy may block.
        """

    @abc.abstractmethod
    def mark_used(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Device memory of ``tensor`` is used by ``stream``: if it is freed, the allocator must not
        hand it out again before the work queued on ``stream`` so far is done."""

    def mark_host_used(self, tensor: torch.Tensor, event: Event) -> None:
        """Host memory of ``tensor`` is read or written by the copy that ``event`` ends: if it is
        freed, it must not be unmapped before then. Default: nothing (memory that tracks its own
        copies, or none that is unmapped on free)."""

    @abc.abstractmethod
    def empty_host(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory (``torch.uint8``) that copies can use asynchronously."""

    @abc.abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory that copies can use asynchronously."""

    def issuing_on(self, stream: Stream) -> contextlib.AbstractContextManager[Any]:
        """A block whose device work (kernels, collectives) is queued on ``stream`` instead of the
        compute stream. Backends that cannot run device work on a side stream raise.

        Raises:
            NotImplementedError: this backend has no such streams (the stream-ordering checker).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot queue device work on a side stream")

    def new_worker(self, role: str, num_threads: int | None = None, by_key: bool = False) -> HostWorker:
        """A host worker (see ``workers.py``): submitted work runs in order (``by_key``: in key
        order among the ready), off the calling thread, with this backend's device as its current
        device; its events can be passed to :meth:`synchronize_event`."""
        return HostWorker(f"offload {role}", num_threads, device=self.device, by_key=by_key)

    def submit(self, worker: HostWorker, work: Callable[[], None], after: list[Event],
               key: float | None = None) -> Event:
        """Queue ``work`` on ``worker`` (with ``key``, for a worker ``by_key``); the worker first
        waits for ``after``. Returns its event."""
        def waiting() -> None:
            for event in after:
                # The work reads what these copies or other work wrote.
                self.synchronize_event(event)
            work()
        return worker.submit(waiting, key, _all_done(after) if after else None)


class CudaBackend(StreamBackend):
    """CUDA streams and events; host memory is pinned (page-locked)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Host copies and gradient buffers pinned at their own size, not the next power of two.
        self.pinned = PinnedAllocator(device=device)

    def current_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self, role: str) -> Stream:
        return torch.cuda.Stream(self.device)

    def record(self, stream: Stream) -> Event:
        # Blocking: a host that waits for it (wait_host, a host worker, freeing pinned memory) sleeps
        # instead of spinning a core that the host update and the input pipeline need.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def wait_event(self, stream: Stream, event: Event) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        stream.wait_stream(other)

    def synchronize_event(self, event: Event) -> None:
        event.synchronize()

    def synchronize_stream(self, stream: Stream) -> None:
        stream.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream, to_device: bool) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def issuing_on(self, stream: Stream) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def mark_used(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream)

    def mark_host_used(self, tensor: torch.Tensor, event: Event) -> None:
        self.pinned.used_until(tensor, event)

    def empty_host(self, nbytes: int) -> torch.Tensor:
        return self.pinned.empty(nbytes)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()


_installed = threading.local()


@contextlib.contextmanager
def using_backend(backend: StreamBackend) -> Iterator[StreamBackend]:
    """Build every :class:`~offload.streams.CopyStreams` (so every ``OffloadModel``) created in
    this block, in this thread, on ``backend`` instead of the device's own.

    Models built inside keep the backend after the block ends.
    """
    previous = getattr(_installed, "backend", None)
    _installed.backend = backend
    try:
        yield backend
    finally:
        _installed.backend = previous


def backend_for(device: torch.device) -> StreamBackend | None:
    """The backend a copy engine for ``device`` uses, or ``None`` for synchronous copies."""
    installed = getattr(_installed, "backend", None)
    if installed is not None:
        if installed.device != device:
            raise ValueError(f"the installed stream backend serves {installed.device}, not {device}")
        return installed
    if device.type == "cuda":
        return CudaBackend(device)
    return None


def _all_done(events: list[Event]) -> Callable[[], bool]:
    """Whether every one of ``events`` (a device event or a host worker's) has completed, without waiting."""
    return lambda: all(event.query() for event in events)
