"""Pinned host memory at the size asked for (offload/streams/pinned.py): on the CPU through a fake
driver that records what is registered, on CUDA for real."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.streams.pinned import PinnedAllocator

from .helpers import CUDA


class FakeDriver:
    """Records registrations; ``refuse`` makes every registration fail."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.registered: dict[int, int] = {}
        self.requests: list[int] = []
        self.small: list[int] = []

    def register(self, address: int, nbytes: int) -> bool:
        self.requests.append(nbytes)
        if self.refuse:
            return False
        self.registered[address] = nbytes
        return True

    def unregister(self, address: int) -> None:
        del self.registered[address]

    def allocate_small(self, nbytes: int) -> torch.Tensor:
        self.small.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def allocator(self) -> PinnedAllocator:
        return PinnedAllocator(self.register, self.unregister, self.allocate_small)


def pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def test_large_buffers_are_registered_at_their_size_not_the_next_power_of_two():
    driver = FakeDriver()
    allocator = driver.allocator()
    sizes = [3 * 2**20 + 5, 2**21 + 2**20, 5 * 2**20]
    tensors = [allocator.empty(n) for n in sizes]
    assert driver.requests == [pages(n) for n in sizes]
    assert [t.numel() for t in tensors] == sizes and all(t.dtype == torch.uint8 for t in tensors)
    assert sorted(driver.registered) == sorted(t.data_ptr() for t in tensors)  # the tensors' own memory
    assert allocator.requested_bytes == sum(sizes)
    assert allocator.reserved_bytes == sum(pages(n) for n in sizes) < 1.01 * sum(sizes)
    for t in tensors:
        t.fill_(7)  # writable memory
    assert all(int(t.sum()) == 7 * t.numel() for t in tensors)


def test_memory_is_unregistered_when_its_last_view_is_freed():
    driver = FakeDriver()
    allocator = driver.allocator()
    flat = allocator.empty(2**21)
    view = flat[64:128].view(torch.float32)
    del flat
    gc.collect()
    assert len(driver.registered) == 1  # a view keeps the buffer, registered
    view.fill_(1.0)
    del view
    gc.collect()
    assert driver.registered == {} and allocator.requested_bytes == allocator.reserved_bytes == 0


def test_small_buffers_go_to_the_caching_allocator_and_are_counted_as_it_reserves():
    driver = FakeDriver()
    allocator = driver.allocator()
    small = allocator.empty(1000)
    assert driver.small == [1000] and driver.requests == []
    assert allocator.reserved_bytes == 1024  # the caching allocator's power of two
    del small
    gc.collect()
    assert allocator.reserved_bytes == 0


def test_a_refused_registration_falls_back_once_with_a_warning():
    driver = FakeDriver(refuse=True)
    allocator = driver.allocator()
    with pytest.warns(RuntimeWarning, match="ulimit -l"):
        first = allocator.empty(2**21)
    second = allocator.empty(2**22)
    assert driver.requests == [2**21]  # tried once
    assert driver.small == [2**21, 2**22] and first.numel() == 2**21 and second.numel() == 2**22


@CUDA
def test_offloaded_training_pins_about_what_it_asks_for_on_cuda():
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(8)])  # 4 MB a layer: no power of two
    plain = [p.detach().clone() for p in layers.parameters()]
    model = OffloadModel(layers, device="cuda", num_slices=4)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    for _ in range(2):
        model(torch.randn(4, 1000, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    assert all(p.is_pinned() and p.grad.is_pinned() for p in model.parameters())
    assert any(not torch.equal(p.detach(), q) for p, q in zip(model.parameters(), plain))
    footprint = model.memory_footprint()
    asked = footprint.host_masters + footprint.host_pool
    assert footprint.pinned and asked <= footprint.pinned_bytes <= 1.02 * asked + 2**20
    allocator = model._engine.copies.backend.pinned
    assert allocator.reserved_bytes < 1.02 * allocator.requested_bytes + 2**20
