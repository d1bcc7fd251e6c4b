"""GPU-only checks: copy ordering under delayed kernels, the device memory budget, pinned memory,
fitting a model larger than a capped device, and loss scaling on CUDA.

The CPU-and-GPU parity tests live in the other files (their ``cuda`` variants); these need the
asynchronous copy path itself.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import offload
from offload import OffloadModel, OffloadOptimizer
from offload.streams import CudaBackend, using_backend
from offload.streams.layouts import Layout

from .helpers import assert_same_grads

pytestmark = pytest.mark.cuda

EXACT = {"rtol": 0.0, "atol": 0.0}


class DelayedCopies(CudaBackend):
    """CUDA streams whose copies start late: the side stream spins before each copy, so compute
    that does not wait for a load reads the slot's old contents, and the host that does not wait
    for an offload reads the buffer's old contents."""

    def __init__(self, device: torch.device, cycles: int = 4_000_000) -> None:
        super().__init__(device)
        self.cycles = cycles

    def copy(self, dst, src, stream, to_device):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(self.cycles)
        super().copy(dst, src, stream, to_device)


class ComputeDoesNotWait(DelayedCopies):
    """A deliberately broken backend: compute never waits for a copy. Proves the tests can fail."""

    def wait_event(self, stream, event):
        if stream == self.current_stream():
            return
        super().wait_event(stream, event)


#: Which side of the race is slowed down: the layers' kernels, or the copies.
DELAYS = ["compute", "copies"]


def build(layers, delay: str, **kwargs) -> OffloadModel:
    """OffloadModel on CUDA, its copies delayed when ``delay == "copies"``."""
    if delay == "copies":
        with using_backend(DelayedCopies(torch.device("cuda", torch.cuda.current_device()))):
            return OffloadModel(layers, device="cuda", **kwargs)
    return OffloadModel(layers, device="cuda", **kwargs)


def cycles(delay: str, compute_cycles: int = 2_000_000) -> int:
    return compute_cycles if delay == "compute" else 0


class Sleepy(nn.Module):
    """A linear layer whose kernels start late: the GPU spins before and after the matmul.

    With little arithmetic per byte and delayed kernels, copies race far ahead of compute; any
    copy not ordered by an event would overwrite a slot or read a gradient too early.
    """

    def __init__(self, width: int, cycles: int, activation: bool = True):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.cycles = cycles
        self.activation = activation

    def forward(self, x):
        torch.cuda._sleep(self.cycles)
        y = self.linear(x)
        if self.activation:
            y = torch.tanh(y)
        torch.cuda._sleep(self.cycles)
        return y


def sleepy_model(width: int = 1024, depth: int = 8, cycles: int = 2_000_000) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Sleepy(width, cycles) for _ in range(depth)], nn.Linear(width, 1)).cuda()


@pytest.mark.parametrize("delay", DELAYS)
@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("checkpoint", [True, False])
def test_delayed_kernels_still_give_exact_gradients(num_microbatches, checkpoint, delay):
    reference = sleepy_model(cycles=cycles(delay))
    model = build(copy.deepcopy(reference), delay, num_slices=8, checkpoint_activation=checkpoint,
                  num_microbatches=num_microbatches)
    for step in range(3):
        x = torch.randn(6, 1024, device="cuda")
        for net in (reference, model):
            for p in net.parameters():
                p.grad = None
        if num_microbatches == 1:
            out_ref = reference(x)
        else:
            from .helpers import microbatched_reference

            out_ref = microbatched_reference(reference, model.partition, x, num_microbatches)
        out_off = model(x)
        torch.testing.assert_close(out_off, out_ref, **EXACT)
        out_ref.pow(2).sum().backward()
        out_off.pow(2).sum().backward()
        # No synchronize here: gradients must be complete when backward returns.
        tol = EXACT if num_microbatches == 1 else {"rtol": 1e-5, "atol": 1e-6}
        assert_same_grads(model, reference, **tol)


class SleepyNorm(nn.Module):
    """BatchNorm after a delayed kernel: its running statistics are written back to the host
    while the next slices load; the slot must not be reloaded before that copy read it."""

    def __init__(self, width: int, cycles: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(width)
        self.cycles = cycles

    def forward(self, x):
        torch.cuda._sleep(self.cycles)
        return self.norm(x)


@pytest.mark.parametrize("delay", DELAYS)
@pytest.mark.parametrize("grad", [True, False])
def test_buffer_write_back_is_not_overtaken_by_slot_reuse(grad, delay):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(5):
        layers += [nn.Linear(512, 512), SleepyNorm(512, cycles(delay, 4_000_000))]
    reference = nn.Sequential(*layers).cuda()
    model = build(copy.deepcopy(reference), delay, num_slices=5)
    for _ in range(3):
        x = torch.randn(16, 512, device="cuda")
        with torch.set_grad_enabled(grad):
            out_ref, out_off = reference(x), model(x)
        if grad:
            out_ref.sum().backward()
            out_off.sum().backward()
    # Read right after the call returns: no synchronize in between.
    for (name, b_off), b_ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b_off.cuda(), b_ref, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("delay", DELAYS)
@pytest.mark.parametrize("checkpoint", [True, False])
def test_in_place_first_layers_do_not_corrupt_offloaded_boundaries(checkpoint, delay):
    torch.manual_seed(0)
    # Sleepy without tanh: tanh saves its output, which an in-place ReLU after it would make the
    # plain model's own backward refuse.
    slices = [nn.Sequential(nn.ReLU(inplace=True), Sleepy(1024, cycles(delay), activation=False)) for _ in range(6)]
    reference = nn.Sequential(*copy.deepcopy(slices)).cuda()
    model = build(slices, delay, checkpoint_activation=checkpoint)
    x = torch.randn(8, 1024, device="cuda")
    reference(x.clone()).pow(2).sum().backward()
    model(x.clone()).pow(2).sum().backward()
    assert_same_grads(model, reference, **EXACT)


@pytest.mark.parametrize("delay", DELAYS)
def test_delayed_kernels_with_optimizer_steps_match_the_resident_model(delay):
    reference = sleepy_model(depth=6, cycles=cycles(delay))
    model = build(copy.deepcopy(reference), delay, num_slices=6)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=1e-2)
    opt_off = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(4):
        x = torch.randn(4, 1024, device="cuda")
        for net, opt in ((reference, opt_ref), (model, opt_off)):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            opt.step()
    for p_off, p_ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p_off.cuda(), p_ref, **EXACT)


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("delay", DELAYS)
def test_delayed_kernels_and_copies_with_the_host_update_beside_the_forward(delay, compute_dtype, monkeypatch):
    """OffloadOptimizer's update runs on a host worker while the next forward loads slices: each
    load must wait for its slice's update (and, under a compute dtype, for the shadow the update
    writes). The reference is the same model with synchronous copies and the plain optimizer."""
    layers = sleepy_model(depth=6, cycles=cycles(delay))
    model = build(copy.deepcopy(layers), delay, num_slices=6, compute_dtype=compute_dtype)
    monkeypatch.setenv("OFFLOAD_SYNC_COPIES", "1")
    reference = OffloadModel(copy.deepcopy(layers), device="cuda", num_slices=6, compute_dtype=compute_dtype)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for step in range(4):
        x = torch.randn(4, 1024, device="cuda")
        for net, opt in ((model, optimizer), (reference, plain)):
            opt.zero_grad()
            net(x).float().pow(2).sum().backward()
            opt.step()
    optimizer.synchronize()
    for p_off, p_ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p_off, p_ref, **EXACT)


def test_a_missing_wait_fails_the_delayed_copy_test():
    """The delayed-copies variant can fail: with compute not waiting for its loads, it reads slots
    before they are filled."""
    reference = sleepy_model(depth=6, cycles=0)
    with using_backend(ComputeDoesNotWait(torch.device("cuda", torch.cuda.current_device()))):
        model = OffloadModel(copy.deepcopy(reference), device="cuda", num_slices=6)
    x = torch.randn(4, 1024, device="cuda")
    assert not torch.equal(model(x), reference(x))


def test_synchronous_copies_switch_gives_the_same_result(monkeypatch):
    reference = sleepy_model(depth=4, cycles=100_000)
    asynchronous = OffloadModel(copy.deepcopy(reference), device="cuda", num_slices=4)
    monkeypatch.setenv("OFFLOAD_SYNC_COPIES", "1")
    synchronous = OffloadModel(copy.deepcopy(reference), device="cuda", num_slices=4)
    assert asynchronous._engine.copies.is_async and not synchronous._engine.copies.is_async
    x = torch.randn(5, 1024, device="cuda")
    for net in (asynchronous, synchronous):
        net(x).sum().backward()
    assert_same_grads(asynchronous, synchronous, **EXACT)


def test_host_copies_and_gradients_are_pinned():
    model = OffloadModel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), device="cuda", num_slices=2)
    model(torch.randn(3, 64, device="cuda")).sum().backward()
    for p in model.parameters():
        assert p.device.type == "cpu" and p.is_pinned()
        assert p.grad.device.type == "cpu" and p.grad.is_pinned()


class PinnedCheck(CudaBackend):
    """CUDA streams that note the host side of every asynchronous copy."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.host_sides: list[tuple[bool, tuple[int, ...], bool]] = []  # to_device, shape, pinned

    def copy(self, dst, src, stream, to_device):
        host = src if to_device else dst
        self.host_sides.append((to_device, tuple(host.shape), host.is_pinned()))
        super().copy(dst, src, stream, to_device)


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_cpu_input_reaches_the_device_through_pinned_memory(checkpoint):
    """Every asynchronous copy's host side is pinned, the user's pageable CPU input included: it is
    staged through a pooled pinned buffer (``ActivationOffloader.load_host``)."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).cuda()
    backend = PinnedCheck(torch.device("cuda", torch.cuda.current_device()))
    with using_backend(backend):
        model = OffloadModel(copy.deepcopy(reference), device="cuda", num_slices=3, checkpoint_activation=checkpoint)
    x = torch.randn(7, 64)
    with torch.no_grad():
        model(x)
    # Without a graph the only loads are the slices and the input, which travels as the memory it
    # addresses (Note: [Layouts]): here its elements, flat.
    assert (True, (Layout.of(x).span,), True) in backend.host_sides, "the input did not travel by an asynchronous copy"
    for _ in range(2):
        x = torch.randn(7, 64)  # pageable host memory
        assert not x.is_pinned()
        for net in (reference, model):
            for p in net.parameters():
                p.grad = None
        out = model(x)
        torch.testing.assert_close(out, reference(x.cuda()), **EXACT)
        out.pow(2).sum().backward()
        reference(x.cuda()).pow(2).sum().backward()
        assert_same_grads(model, reference, **EXACT)
    assert all(pinned for _, _, pinned in backend.host_sides), backend.host_sides


def test_an_input_staged_into_a_buffer_a_detached_forward_still_offloads_into():
    """``model(x).detach()`` drops the boundary activations while their (delayed) offloads still
    write their pooled buffers; the next CPU input is staged on the CPU into a buffer of the same
    size, which must wait for that offload first (``HostBuffer.write_event``)."""
    torch.manual_seed(0)
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)]).cuda()
    model = build(copy.deepcopy(reference), "copies", num_slices=4)
    for step in range(3):
        model(torch.randn(8, 64, device="cuda")).detach()
        x = torch.randn(8, 64)  # pageable, as large as a boundary activation
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x.cuda()), **EXACT)


class Masked(nn.Module):
    """A linear layer whose output is scaled by a mask passed beside its input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mask = inputs
        return torch.tanh(self.linear(x) * mask.view(-1, x.shape[-1]).sum(0))


@pytest.mark.parametrize("checkpoint", [True, False])
def test_cpu_inputs_staged_in_one_forward_wait_for_each_others_loads(checkpoint, monkeypatch):
    """Pageable CPU inputs ``(x, mask)`` in two microbatches: each is copied on the host into a
    pooled pinned buffer and loaded from there (``ActivationOffloader.load_host``). The mask and
    each microbatch's rows of ``x`` have the same size, so they take the same buffer in turn within
    one forward; with delayed copies, a host copy into it that did not wait for the load before
    (``copy_on_host``) would hand that load the next input's bytes. Outputs are compared with the
    plain model run on each microbatch, gradients with the same model on synchronous copies."""
    torch.manual_seed(0)
    width = 256
    layers = nn.Sequential(Masked(width), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    reference = copy.deepcopy(layers).cuda()
    kwargs = {"num_slices": 3, "num_microbatches": 2, "checkpoint_activation": checkpoint}
    model = build(copy.deepcopy(layers), "copies", **kwargs)
    monkeypatch.setenv("OFFLOAD_SYNC_COPIES", "1")
    synchronous = OffloadModel(copy.deepcopy(layers), device="cuda", **kwargs)
    assert model._engine.copies.is_async and not synchronous._engine.copies.is_async
    mask = torch.rand(4 * width)  # no batch dimension (whole to each microbatch); as large as 4 rows of x
    for _ in range(3):
        x = torch.randn(8, width)  # pageable host memory: two microbatches of 4 rows
        assert not x.is_pinned() and not mask.is_pinned()
        for net in (model, synchronous):
            for p in net.parameters():
                p.grad = None
        out = model((x, mask))
        expected = torch.cat([reference((rows.cuda(), mask.cuda())) for rows in x.tensor_split(2)])
        torch.testing.assert_close(out, expected, **EXACT)
        out.pow(2).sum().backward()
        synchronous((x, mask)).pow(2).sum().backward()
        assert_same_grads(model, synchronous, **EXACT)


def _warm_up_cublas(width: int) -> None:
    # cuBLAS allocates its workspace on first use; do that before measuring.
    a = torch.randn(8, width, device="cuda", requires_grad=True)
    b = torch.randn(width, width, device="cuda", requires_grad=True)
    (a @ b).sum().backward()
    del a, b
    torch.cuda.synchronize()


def test_peak_device_memory_stays_under_the_budget():
    width, depth, rows, num_slices = 4096, 8, 16, 8
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = OffloadModel(nn.Sequential(*layers), device="cuda", num_slices=num_slices)
    x = torch.randn(rows, width, device="cuda")
    _warm_up_cublas(width)
    model(x).sum().backward()  # first step allocates the slots and warms the allocator
    for p in model.parameters():
        p.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    model(x).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline

    float_bytes = 4
    assert all(len(names) == 2 for names in model.partition)  # one Linear and its ReLU per slice
    slice_param_bytes = (width * width + width) * float_bytes
    activation = rows * width * float_bytes
    budget = (
        # Slots are allocated before the baseline; they are in `baseline`, not in `peak`.
        # One slice's gradients being produced, the previous slice's still being copied out.
        2 * slice_param_bytes
        # Boundary activations: the current slice's input and output, the next one prefetched,
        # and their gradients.
        + 6 * activation
        # One slice's activations for one microbatch: each Linear and ReLU saves one tensor.
        + 4 * activation
        # Small tensors (loss, events' bookkeeping, rounding of the caching allocator).
        + 8 * 2**20
    )
    assert peak <= budget, f"peak {peak / 2**20:.1f} MiB over budget {budget / 2**20:.1f} MiB"
    # And the slots hold two slices, not the model.
    assert model._engine.slots.slot_nbytes * 2 < depth * slice_param_bytes / 2


def test_a_model_larger_than_the_capped_device_trains():
    width, depth = 4096, 16
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    plain = nn.Sequential(*layers)
    model_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    reference = copy.deepcopy(plain).cuda()
    x = torch.randn(8, width, device="cuda")
    reference(x).sum().backward()
    expected = {n: p.grad.cpu() for n, p in reference.named_parameters()}
    del reference
    gc.collect()
    torch.cuda.empty_cache()

    model = OffloadModel(plain, device="cuda", num_slices=depth)
    total = torch.cuda.get_device_properties(0).total_memory
    cap = model_bytes // 2  # half the parameters alone would not fit
    slice_bytes = model_bytes // depth
    torch.cuda.set_per_process_memory_fraction(cap / total)
    torch.cuda.reset_peak_memory_stats()
    # What is already there (the input, cuBLAS workspaces from the reference run) is not ours.
    base = torch.cuda.memory_allocated()
    try:
        model(x).sum().backward()
        torch.cuda.synchronize()
        # The budget in docs/memory.md: two slots, one slice's gradients (two while one is copied out),
        # and activations that are small here.
        assert torch.cuda.max_memory_allocated() - base <= 4 * slice_bytes + 16 * 2**20
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_and_grad_scaler_on_cuda_with_host_gradients(dtype):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)).cuda()
    model = OffloadModel(copy.deepcopy(reference), device="cuda", num_slices=3)
    # The plain scaler for the resident model, offload's for the host gradients (Note: [Loss scaling
    # with host gradients] in offload/grad_scaler.py).
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**12), offload.GradScaler("cuda", init_scale=2.0**12)]
    optims = [torch.optim.SGD(net.parameters(), lr=1e-2) for net in (reference, model)]
    for _ in range(3):
        x = torch.randn(8, 32, device="cuda")
        for net, scaler, opt in zip((reference, model), scalers, optims):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=dtype):
                loss = net(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    for p_off, p_ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p_off.cuda(), p_ref, **EXACT)
    assert scalers[0].get_scale() == scalers[1].get_scale()


def test_grad_scaler_unscales_host_gradients_while_the_stream_is_busy():
    # torch.amp.GradScaler copies its inverse scale to the host with non_blocking=True, and its
    # host-side unscale reads the copy at once. With kernels still queued on the stream (the user's,
    # or a next forward's), that copy lands late; offload.GradScaler copies it blocking. This checks
    # that the host gradients OffloadModel hands over are unscaled with the right factor even then.
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)), device="cuda", num_slices=2)
    scaler = offload.GradScaler("cuda", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(8, 64, device="cuda")).sum()).backward()
    expected = [p.grad / 2.0**10 for p in model.parameters()]
    torch.cuda._sleep(100_000_000)  # tens of milliseconds of work queued ahead of the scaler's copy
    scaler.unscale_(optimizer)
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, want, **EXACT)
