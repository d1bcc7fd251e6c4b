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
from offload.streams.host_storage import dense_stride

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
