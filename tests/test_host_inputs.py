"""Host tensors the caller owns (a CPU input to a model on a GPU) travel through pinned memory.

An asynchronous copy from pageable memory may block the CPU until it is done (CUDA stages it
through a bounce buffer), so ``ActivationOffloader.load_host`` first copies such a tensor on the
CPU into a pooled pinned buffer (rule 4 of Note: [Copy ordering]). These tests drive it through a
backend whose device is not the CPU (``meta``: copies are recorded, never run) and check the
decision itself; the stream-ordering checker reaches the path on its ``cpu:0`` device
(``tests/test_streamcheck.py``, scenario ``host_inputs_staged``), and ``tests/test_cuda.py``
checks it on a real GPU.
"""

from __future__ import annotations

import torch

from offload.streams import ActivationOffloader, CopyStreams, HostBufferPool, StreamBackend, using_backend


class RecordingBackend(StreamBackend):
    """Streams for the ``meta`` device that record each copy and remember which host memory they
    handed out (this backend's pinned memory)."""

    def __init__(self) -> None:
        self.device = torch.device("meta")
        self.copies: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        self._pinned: set[int] = set()

    def current_stream(self):
        return "compute"

    def new_stream(self, role):
        return role

    def record(self, stream):
        return object()

    def wait_event(self, stream, event):
        pass

    def wait_stream(self, stream, other):
        pass

    def synchronize_event(self, event):
        pass

    def synchronize_stream(self, stream):
        pass

    def copy(self, dst, src, stream, to_device):
        self.copies.append((dst, src, to_device))

    def mark_used(self, tensor, stream):
        pass

    def empty_host(self, nbytes):
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        self._pinned.add(tensor.untyped_storage().data_ptr())
        return tensor

    def is_pinned(self, tensor):
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in self._pinned


def offloader(backend: RecordingBackend) -> ActivationOffloader:
    with using_backend(backend):
        copies = CopyStreams(backend.device)
    assert copies.is_async
    return ActivationOffloader(copies, HostBufferPool(lambda nbytes: copies.empty_host(nbytes, torch.device("cpu"))))


def test_a_pageable_input_is_staged_through_a_pooled_pinned_buffer():
    backend = RecordingBackend()
    activations = offloader(backend)
    x = torch.randn(5, 3).t()  # pageable and not contiguous
    device_x, ready = activations.load_host(x)
    # The device copy keeps the input's layout (Note: [Layouts]): the copy moves the memory it addresses.
    assert device_x.device.type == "meta" and device_x.shape == x.shape and device_x.stride() == x.stride()
    [(dst, src, to_device)] = backend.copies
    assert to_device and dst._base is device_x and dst.shape == (15,)
    assert backend.is_pinned(src), "the asynchronous copy reads pageable memory"
    assert src.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    # Staged on the CPU before the copy reads it.
    torch.testing.assert_close(src.as_strided(x.shape, x.stride()), x, rtol=0, atol=0)
    # Rule 4: the pooled buffer is not written again before this load has read it.
    [buffer] = [b for buffers in activations.pool._buffers.values() for b in buffers]
    assert buffer.read_event is ready and ready is not None


def test_a_pinned_input_is_copied_as_it_is():
    backend = RecordingBackend()
    activations = offloader(backend)
    x = activations.copies.empty_host(4 * 6, torch.device("cpu")).view(torch.float32).view(2, 3)
    x.copy_(torch.randn(2, 3))
    activations.load_host(x)
    [(_, src, _)] = backend.copies
    assert src.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and src.shape == (6,)
    assert activations.pool.nbytes == 0, "a pinned input was staged anyway"
