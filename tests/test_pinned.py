"""Pinned host memory at the size asked for (offload/streams/pinned.py): on the CPU through a fake
driver that records what is registered, on CUDA for real."""

from __future__ import annotations

import gc
import mmap
import threading

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.streams import pinned
from offload.streams.pinned import PinnedAllocator

from .helpers import CUDA


class FakeDriver:
    """Records registrations, and every call in order (``calls``); ``refuse`` makes every
    registration fail with that error text (or ``False``), leaving an error behind as the CUDA
    runtime does until it is cleared."""

    def __init__(self, refuse: bool | str = False) -> None:
        self.refuse = refuse
        self.registered: dict[int, int] = {}
        self.requests: list[int] = []
        self.small: list[int] = []
        self.calls: list[str] = []
        self.last_error = 0

    def register(self, address: int, nbytes: int) -> bool | str:
        self.calls.append("register")
        self.requests.append(nbytes)
        if self.refuse is not False:
            self.last_error = 2
            return self.refuse
        self.registered[address] = nbytes
        return True

    def unregister(self, address: int) -> None:
        self.calls.append("unregister")
        del self.registered[address]

    def clear_error(self) -> None:
        self.calls.append("clear error")
        self.last_error = 0

    def allocate_small(self, nbytes: int) -> torch.Tensor:
        self.small.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def allocator(self, **kwargs) -> PinnedAllocator:
        return PinnedAllocator(self.register, self.unregister, self.allocate_small, clear_error=self.clear_error,
                               **kwargs)


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


def test_a_refused_registration_falls_back_once_with_a_warning_and_clears_the_error():
    driver = FakeDriver(refuse="error 2: out of memory")
    allocator = driver.allocator()
    with pytest.warns(RuntimeWarning, match="failed \\(error 2: out of memory\\).*power of two") as caught:
        first = allocator.empty(2**21)
    assert "ulimit" not in str(caught[0].message)  # registered pages are not under RLIMIT_MEMLOCK
    # The next kernel launch would otherwise raise the refusal as its own error.
    assert driver.last_error == 0 and driver.calls == ["register", "clear error"]
    second = allocator.empty(2**22)
    assert driver.requests == [2**21]  # tried once
    assert driver.small == [2**21, 2**22] and first.numel() == 2**21 and second.numel() == 2**22


def test_the_cuda_path_clears_the_runtime_error_after_a_refusal(monkeypatch):
    """The default register and clear functions, through a fake CUDA runtime."""
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, address, nbytes, flags):
            calls.append("cudaHostRegister")
            return 2

        def cudaGetErrorString(self, error):
            return "out of memory"

    class FakeRuntime:
        def cudaGetLastError(self):
            calls.append("cudaGetLastError")
            return 2

    monkeypatch.setattr(pinned, "_cudart", FakeCudart)
    monkeypatch.setattr(pinned, "_runtime_library", FakeRuntime)
    allocator = PinnedAllocator(small=lambda n: torch.empty(n, dtype=torch.uint8))
    with pytest.warns(RuntimeWarning, match="error 2: out of memory"):
        allocator.empty(2**21)
    assert calls == ["cudaHostRegister", "cudaGetLastError"]


class FakeCudaDevice:
    """Stands in for ``torch.cuda.device`` (a context manager) and records the device it is
    entered with; ``current`` is the device a call inside it runs under."""

    current: list[int] = [0]

    def __init__(self, device) -> None:
        self.index = torch.device(device).index

    def __enter__(self):
        FakeCudaDevice.current.append(self.index)

    def __exit__(self, *exc):
        FakeCudaDevice.current.pop()


def test_registration_and_unregistration_run_under_the_models_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", FakeCudaDevice)
    under: list[tuple[str, int]] = []
    driver = FakeDriver()

    def register(address, nbytes):
        under.append(("register", FakeCudaDevice.current[-1]))
        return driver.register(address, nbytes)

    def unregister(address):
        under.append(("unregister", FakeCudaDevice.current[-1]))
        driver.unregister(address)

    allocator = PinnedAllocator(register, unregister, driver.allocate_small, device=torch.device("cuda", 1))
    buffer = allocator.empty(2**21)
    del buffer
    gc.collect()
    assert under == [("register", 1), ("unregister", 1)] and FakeCudaDevice.current == [0]


class FakeEvent:
    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def synchronize(self) -> None:
        self.calls.append(f"synchronize {self.name}")


def test_freeing_waits_for_the_last_copy_before_unregistering():
    driver = FakeDriver()
    allocator = driver.allocator()
    flat = allocator.empty(2**21)
    other = allocator.empty(2**21)
    view = flat[4096:8192]
    allocator.used_until(view, FakeEvent(driver.calls, "first copy"))
    allocator.used_until(flat[-10:], FakeEvent(driver.calls, "last copy"))
    allocator.used_until(torch.empty(2**21, dtype=torch.uint8), FakeEvent(driver.calls, "foreign"))  # not ours
    del flat, view
    gc.collect()
    assert driver.calls == ["register", "register", "synchronize last copy", "unregister"]
    del other  # no copy used it: nothing to wait for
    gc.collect()
    assert driver.calls[-1] == "unregister" and len(driver.calls) == 5


def test_a_finalizer_that_runs_while_the_allocator_counts_does_not_deadlock():
    driver = FakeDriver()
    allocator = driver.allocator()
    buffers = [allocator.empty(2**21)]

    def free_inside_the_lock():
        with allocator._lock:  # garbage collection may free a buffer in a thread inside the lock
            buffers.clear()
            gc.collect()

    thread = threading.Thread(target=free_inside_the_lock, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "freeing a buffer inside the allocator's lock deadlocked"
    assert driver.registered == {}


def test_registered_pages_are_not_shared_with_a_forked_child():
    if not hasattr(mmap, "MADV_DONTFORK"):
        pytest.skip("no MADV_DONTFORK on this system")
    allocator = FakeDriver().allocator()
    buffer = allocator.empty(2**21)
    start = f"{buffer.data_ptr():x}-"
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(start))
    flags = next(line for line in lines[at + 1:] if line.startswith("VmFlags:"))
    assert " dc" in flags, flags  # "do not copy" on fork


def vm_flags(tensor: torch.Tensor) -> str:
    """The kernel's flags of the mapping that holds ``tensor`` (``/proc/self/smaps``)."""
    start = f"{tensor.data_ptr():x}-"
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(start))
    return next(line for line in lines[at + 1:] if line.startswith("VmFlags:"))


def test_large_buffers_are_advised_for_huge_pages_unless_turned_off(monkeypatch):
    # "hg": MADV_HUGEPAGE given. Advice, not a promise: whether the pages come huge is the kernel's.
    big, small = 2 * pinned.HUGE_PAGE_NBYTES, pinned.HUGE_PAGE_NBYTES - mmap.PAGESIZE
    allocator = FakeDriver().allocator(small_nbytes=1)
    advised, below = allocator.empty(big), allocator.empty(small)
    assert " hg" in vm_flags(advised) and " hg" not in vm_flags(below)
    monkeypatch.setenv("OFFLOAD_HUGEPAGES", "0")
    assert " hg" not in vm_flags(FakeDriver().allocator().empty(big))
    assert " hg" in vm_flags(FakeDriver().allocator(hugepages=True).empty(big))


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


def test_pooled_pinned_buffers_come_in_size_classes_that_nearby_sizes_share():
    from offload.streams.host_buffers import HostBufferPool
    from offload.streams.pinned import size_class

    assert size_class(1000) == 1000  # the caching allocator's own business
    for nbytes in (2**20, 2**20 + 1, 3 * 2**20 + 5, 5 * 2**20, 2**30 + 7):
        rounded = size_class(nbytes)
        assert nbytes <= rounded <= 1.25 * nbytes and rounded % mmap.PAGESIZE == 0
        assert size_class(rounded) == rounded
    driver = FakeDriver()
    pool = HostBufferPool(driver.allocator().empty, size_class)
    first = pool.take(3 * 2**20 + 5)  # one batch's activation
    assert first.data.numel() == size_class(3 * 2**20 + 5)
    seen = first.data.data_ptr()
    del first
    gc.collect()
    second = pool.take(3 * 2**20 + 4096)  # the next batch's, a little longer: the same buffer
    assert second.data.data_ptr() == seen and len(driver.requests) == 1


def test_buffers_alive_at_interpreter_exit_print_no_ignored_exception(tmp_path):
    """A registered buffer still alive when the interpreter exits is not unregistered then (the
    runtime may be gone, and the exit releases it): no "Exception ignored" on stderr."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import sys, torch\n"
        "from offload.streams.pinned import PinnedAllocator\n"
        "def unregister(address):\n"
        "    if sys.is_finalizing():\n"
        "        raise RuntimeError('the CUDA runtime is gone')\n"
        "allocator = PinnedAllocator(lambda address, nbytes: True, unregister, clear_error=lambda: None)\n"
        "kept = allocator.empty(2**21)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Exception ignored" not in done.stderr, done.stderr
