"""Parameters laid out in another order than row-major keep their layout through OffloadModel.

A ``channels_last`` convolution weight makes the convolution pick other kernels, with other
rounding, and autograd gives ``.grad`` the parameter's layout: host copies, device copies,
shadows and gradients must all keep it, or results stop being the plain model's bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.streams.flat_views import dense_stride

from .helpers import DEVICES, HostStepped
from .test_mixed_precision import converted, master_grads_of

EXACT = {"rtol": 0.0, "atol": 0.0}


def convnet() -> nn.Sequential:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
                           nn.Conv2d(16, 4, 3), nn.Flatten(), nn.Linear(4 * 10 * 10, 3))
    # The convolutions channels_last; the linear weight transposed in memory, another dense layout.
    layers = layers.to(memory_format=torch.channels_last)
    layers[-1].weight = nn.Parameter(layers[-1].weight.detach().t().contiguous().t())
    return layers


def images(device: str, seed: int = 1) -> torch.Tensor:
    x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(seed))
    return x.to(device).to(memory_format=torch.channels_last)


def test_dense_stride_tells_layouts_apart():
    assert dense_stride(torch.empty(2, 3, 4, 5)) is None  # row-major
    cl = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert dense_stride(cl) == cl.stride()
    assert dense_stride(torch.empty(3, 4).t()) == (1, 4)
    assert dense_stride(torch.empty(4, 6)[:, ::2]) is None  # gaps: laid out row-major instead
    assert dense_stride(torch.empty(3).expand(2, 3)) is None  # overlapping


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_layouts_are_kept_and_gradients_are_bit_identical(checkpoint_activation, num_microbatches, device):
    plain = convnet().to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, checkpoint_activation=checkpoint_activation,
                         num_microbatches=num_microbatches)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.stride() == q.stride(), name
    x = images(device)
    if num_microbatches == 1:
        plain(x).square().sum().backward()
    else:  # each slice runs the rows in two halves: so does the reference
        for rows in x.tensor_split(2):
            plain(rows).square().sum().backward()
    model(x).square().sum().backward()
    tolerance = EXACT if num_microbatches == 1 else {"rtol": 1e-5, "atol": 1e-6}
    # .grad is the pooled host buffer itself: autograd would copy a gradient whose layout differs
    # from its parameter's into memory of its own.
    pooled = {b.data.untyped_storage().data_ptr() for buffers in model._engine.pool._buffers.values() for b in buffers}
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad.stride() == q.grad.stride(), name
        assert p.grad.untyped_storage().data_ptr() in pooled, name
        torch.testing.assert_close(p.grad, q.grad.cpu(), **tolerance, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_under_a_compute_dtype_with_the_host_optimizer(device):
    plain = convnet()
    reference = converted(plain, torch.bfloat16).to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, compute_dtype=torch.bfloat16)
    x = images(device).to(torch.bfloat16)
    reference(x).float().square().sum().backward()
    model(x).float().square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), master_grads_of(reference).parameters()):
        assert p.grad.stride() == p.stride(), name
        torch.testing.assert_close(p.grad, q.grad.cpu(), **EXACT, msg=name)
    # The update writes the bfloat16 shadow in the same layout, which the next forward loads.
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1)
    optimizer.step()
    optimizer.synchronize()
    expected = copy.deepcopy(plain)
    with torch.no_grad():
        for p, q in zip(expected.parameters(), model.parameters()):
            p.copy_(q)
    torch.testing.assert_close(model(x), converted(expected, torch.bfloat16).to(device)(x), **EXACT)


@pytest.mark.parametrize("device", DEVICES)
def test_training_steps_match_the_plain_model(device):
    plain = convnet().to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3)

    def make(params):
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    reference = make(plain.parameters()) if device == "cpu" else HostStepped(plain, make)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(3):
        for net, opt in ((plain, reference), (model, optimizer)):
            opt.zero_grad()
            net(images(device, seed=step)).square().sum().backward()
            opt.step()
    optimizer.synchronize()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.stride() == q.stride(), name
        torch.testing.assert_close(p, q.detach().cpu(), **EXACT, msg=name)


# -- inputs and boundary activations (Note: [Layouts] in offload/streams/layouts.py) ---------------


def strided(x: torch.Tensor) -> torch.Tensor:
    """PyTorch's own recipe for a non-dense input (``TestModule``): every other element of a copy."""
    return x.repeat_interleave(2, -1)[..., ::2]


def channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last)


def layout_sensitive() -> nn.Sequential:
    """Layers whose kernels round differently on another layout, in slices of any size."""
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm2d(6), nn.GELU(), nn.Conv2d(6, 6, 3, padding=1), nn.SiLU(), nn.GroupNorm(2, 6),
                         nn.PReLU(6), nn.ConvTranspose2d(6, 4, 3), nn.ELU(), nn.BatchNorm2d(4), nn.Sigmoid(),
                         nn.AdaptiveAvgPool2d(3)).double()


def assert_runs_alike(plain: nn.Module, model: OffloadModel, x: torch.Tensor,
                      prepare, grad_seed: int = 2) -> None:
    """Outputs, input and parameter gradients and buffers of one step, bit for bit (the plain
    module on ``x``'s device; OffloadModel's parameters, gradients and buffers on the host)."""
    x_plain, x_model = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_plain, y_model = plain(prepare(x_plain)), model(prepare(x_model))
    torch.testing.assert_close(y_model, y_plain, **EXACT)
    grad = torch.randn(y_plain.shape, dtype=y_plain.dtype, generator=torch.Generator().manual_seed(grad_seed))
    y_plain.backward(grad.to(x.device))
    y_model.backward(grad.to(x.device))
    torch.testing.assert_close(x_model.grad, x_plain.grad, **EXACT)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad.cpu(), **EXACT, msg=name)
    for (name, b), c in zip(model.named_buffers(), plain.buffers()):
        torch.testing.assert_close(b, c.cpu(), **EXACT, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prepare", [strided, channels_last], ids=["strided", "channels_last"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("num_slices", [1, 2, 4])
def test_inputs_and_boundary_activations_keep_their_layout(prepare, num_slices, checkpoint_activation, device):
    plain = layout_sensitive().to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=num_slices,
                         checkpoint_activation=checkpoint_activation)
    x = torch.randn(4, 6, 7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    # cuDNN's default float64 ConvTranspose2d differs from run to run by 4e-16 in the plain model
    # itself (benchmarks/results/h100-2026-11-26, rerun_diagnose_layouts.log): compare under its
    # deterministic algorithms, as a user asking for reproducible bits would run.
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        assert_runs_alike(plain, model, x, prepare)


class Every(nn.Module):
    """Hands the next layer a view of its input: every ``step``-th column, or the input expanded."""

    def __init__(self, step: int = 2, expand: bool = False) -> None:
        super().__init__()
        self.step, self.expand = step, expand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expand:
            return x[:, :1].expand(-1, 3, -1)
        return x[..., 1::self.step]


@pytest.mark.parametrize("expand", [False, True], ids=["gaps", "overlapping"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_views_crossing_a_boundary_keep_their_strides(expand, checkpoint_activation):
    torch.manual_seed(0)
    # Slices as given: the first ends with the view, so the second starts from it.
    plain = nn.Sequential(nn.Sequential(nn.Linear(8, 8), Every(expand=expand)),
                          nn.Sequential(nn.GELU(), nn.LayerNorm(4 if not expand else 8)), nn.Sigmoid()).double()
    model = OffloadModel(list(copy.deepcopy(plain)), device="cpu", checkpoint_activation=checkpoint_activation)
    x = torch.randn(5, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_runs_alike(plain, model, x, lambda t: t)


def test_an_in_place_first_layer_works_on_a_strided_input():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.ReLU(inplace=True), nn.GELU(), nn.Linear(5, 5)).double()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_runs_alike(plain, model, x, strided)


def test_offloaded_activations_keep_layout_and_alignment():
    from offload.streams import ActivationOffloader, CopyStreams, HostBufferPool
    from offload.streams.layouts import ALIGNMENT, Layout

    copies = CopyStreams(torch.device("cpu"))
    activations = ActivationOffloader(copies, HostBufferPool(lambda n: torch.empty(n, dtype=torch.uint8)))
    base = torch.randn(2, 3, 5, 5)
    for tensor, nbytes in ((channels_last(base), base.numel() * 4),  # dense: its elements only
                           (base[..., 1::2], (base.numel() - 2) * 4),  # gaps: first to last element
                           (base[:, :1].expand(-1, 3, -1, -1), 2 * 75 * 4 - 3 * 25 * 4 + 25 * 4)):  # stride 0
        before = activations.offloaded_bytes
        host, ticket = activations.offload(tensor)
        assert activations.offloaded_bytes - before == Layout.of(tensor).span * 4 == nbytes
        assert host.stride() == tensor.stride()
        loaded, _ = activations.load(ticket, host)
        assert loaded.stride() == tensor.stride()
        assert loaded.data_ptr() % ALIGNMENT == tensor.data_ptr() % ALIGNMENT  # the kernels' alignment too
        assert torch.equal(loaded, tensor)
