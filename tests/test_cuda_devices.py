"""Which CUDA device host-side work runs under: host workers and pinned-memory registration use
the model's device, not GPU 0 (offload/streams/workers.py, offload/streams/pinned.py). On the CPU
through fakes of ``torch.cuda.set_device``; on a second GPU for real."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.streams import CudaBackend, HostWorker

from .helpers import CUDA


class FakeCurrentDevice:
    """``torch.cuda.set_device`` per thread, as CUDA keeps it: a new thread starts on device 0."""

    def __init__(self) -> None:
        self._local = threading.local()

    def set_device(self, device) -> None:
        self._local.index = torch.device(device).index

    def current(self) -> int:
        return getattr(self._local, "index", 0)


@pytest.mark.parametrize("device, expected", [(torch.device("cuda", 1), 1), (torch.device("cpu"), 0), (None, 0)])
def test_a_host_worker_runs_under_its_device(device, expected, monkeypatch):
    fake = FakeCurrentDevice()
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    seen = []
    worker = HostWorker("test worker", device=device)
    worker.submit(lambda: seen.append(fake.current()))
    worker.submit(lambda: seen.append(fake.current()))
    worker.record().synchronize()
    worker.close(timeout=10)
    assert seen == [expected, expected]


def test_the_cuda_backend_gives_its_workers_and_allocator_its_device(monkeypatch):
    fake = FakeCurrentDevice()
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    backend = CudaBackend(torch.device("cuda", 1))
    worker = backend.new_worker("host update")
    seen = []
    worker.submit(lambda: seen.append(fake.current()))
    worker.record().synchronize()
    worker.close(timeout=10)
    assert seen == [1] and backend.pinned.device == torch.device("cuda", 1)


@CUDA
def test_training_on_the_last_gpu_leaves_gpu_0_alone():
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip("needs two CUDA devices")
    device = torch.device("cuda", count - 1)
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    model = OffloadModel(layers, device=device, num_slices=4)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    for _ in range(2):
        model(torch.randn(4, 1024, device=device)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    assert torch.cuda.memory_allocated(0) == before


def test_events_the_host_may_wait_for_are_blocking(monkeypatch):
    made = []

    class FakeEvent:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def record(self, stream):
            pass

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    CudaBackend(torch.device("cuda", 0)).record(object())
    assert made == [{"blocking": True}]
