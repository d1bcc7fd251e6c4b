"""Outputs, loss and every gradient equal the unwrapped model's.

With one microbatch the offloaded model runs exactly the plain model's operations, so results are
compared bit for bit. With several microbatches the reference runs the plain layers slice by slice
on each chunk (the documented order); outputs are still bit-identical and gradients differ only by
the order in which microbatch contributions are summed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from offload import OffloadModel

from .helpers import ACTIVATIONS, DEVICES, HostStepped, assert_same_grads, clone_model, microbatched_reference, seeded

EXACT = {"rtol": 0.0, "atol": 0.0}


def mlp(width: int = 24, dropout: float = 0.0, depth: int = 4) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(12, width), nn.GELU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(width, 5))
    return nn.Sequential(*layers)


def autocast_context(kind: str, device: str) -> contextlib.AbstractContextManager:
    if kind == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    return torch.autocast(device, dtype=dtype)


def run_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, autocast: str, device: str):
    with autocast_context(autocast, device):
        out = model(x)
        loss = nn.functional.mse_loss(out.float(), target)
    loss.backward()
    return out, loss


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_slices", [1, 2, 3, 5])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("autocast", ["none", "bf16"])
def test_single_microbatch_is_bit_identical(device, num_slices, dropout, activations, autocast):
    torch.manual_seed(0)
    reference = mlp(dropout=dropout).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=num_slices, **ACTIVATIONS[activations])
    x = torch.randn(9, 12, device=device)
    target = torch.randn(9, 5, device=device)
    x_ref = x.clone().requires_grad_()
    x_off = x.clone().requires_grad_()

    out_ref, loss_ref = seeded(7, lambda: run_step(reference, x_ref, target, autocast, device))
    out_off, loss_off = seeded(7, lambda: run_step(model, x_off, target, autocast, device))

    torch.testing.assert_close(out_off, out_ref, **EXACT)
    torch.testing.assert_close(loss_off, loss_ref, **EXACT)
    torch.testing.assert_close(x_off.grad, x_ref.grad, **EXACT)
    assert_same_grads(model, reference, **EXACT)
    # The generators continue where the plain model's did: the recompute replayed, never consumed.
    torch.testing.assert_close(torch.rand(3, device=device), seeded(7, lambda: _consume(reference, x, device)))


def _consume(reference, x, device):
    # Re-run the reference's forward from the same seed to leave the generator where it ended.
    reference(x)
    return torch.rand(3, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("num_microbatches", [2, 3, 4])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("autocast", ["none", "bf16"])
def test_microbatches_match_the_sliced_reference(device, num_slices, num_microbatches, dropout, activations, autocast):
    torch.manual_seed(0)
    reference = mlp(dropout=dropout).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=num_slices,
                         num_microbatches=num_microbatches, **ACTIVATIONS[activations])
    x = torch.randn(10, 12, device=device)
    target = torch.randn(10, 5, device=device)
    x_ref = x.clone().requires_grad_()
    x_off = x.clone().requires_grad_()

    def reference_step():
        with autocast_context(autocast, device):
            out = microbatched_reference(reference, model.partition, x_ref, num_microbatches)
            loss = nn.functional.mse_loss(out.float(), target)
        loss.backward()
        return out, loss

    out_ref, loss_ref = seeded(3, reference_step)
    out_off, loss_off = seeded(3, lambda: run_step(model, x_off, target, autocast, device))

    torch.testing.assert_close(out_off, out_ref, **EXACT)
    torch.testing.assert_close(loss_off, loss_ref, **EXACT)
    # Gradients are sums over microbatches, added in a different order: float32 rounding only.
    tol = {"rtol": 1e-5, "atol": 1e-6} if autocast == "none" else {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(x_off.grad, x_ref.grad, **tol)
    assert_same_grads(model, reference, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_microbatches_without_randomness_match_the_plain_model(device):
    # Without dropout or batch statistics, cutting the batch changes nothing but summation order.
    torch.manual_seed(0)
    reference = mlp().to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=3, num_microbatches=4)
    x = torch.randn(16, 12, device=device)
    out_ref = reference(x)
    out_off = model(x)
    torch.testing.assert_close(out_off, out_ref, rtol=1e-6, atol=1e-6)
    out_ref.pow(2).sum().backward()
    out_off.pow(2).sum().backward()
    assert_same_grads(model, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_training_trajectory_matches(device):
    """Several optimizer steps: the optimizer's in-place updates are what the next forward uses."""
    torch.manual_seed(0)
    reference = mlp(dropout=0.1).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=3)
    opt_ref = HostStepped(reference, lambda params: torch.optim.AdamW(params, lr=1e-2))
    opt_off = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        x = torch.randn(8, 12, device=device)
        target = torch.randn(8, 5, device=device)
        for net, opt in ((reference, opt_ref), (model, opt_off)):
            opt.zero_grad()
            loss = seeded(step, lambda: nn.functional.mse_loss(net(x), target))
            loss.backward()
            opt.step()
    for (name, p_off), p_ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p_off.to(device), p_ref, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_built_on_the_original_parameters_trains_the_model(device):
    torch.manual_seed(0)
    plain = mlp().to(device)
    reference = clone_model(plain)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)  # built before wrapping
    model = OffloadModel(plain, device=device, num_slices=2)
    # On a GPU the reference's optimizer steps host copies, as OffloadModel's does.
    opt_ref = HostStepped(reference, lambda params: torch.optim.SGD(params, lr=0.1))
    x = torch.randn(6, 12, device=device)
    for net, opt in ((model, optimizer), (reference, opt_ref)):
        for _ in range(2):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    torch.testing.assert_close(model(x), reference(x), **EXACT)
