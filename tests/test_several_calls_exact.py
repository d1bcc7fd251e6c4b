"""A model called more than once in one loss (a siamese pair, a triplet loss, chosen and rejected
answers): gradients and parameters bit for bit the plain model's with torch.optim, also where
backward adds into zeroed ``.grad`` in place and where a weight is tied across slices (Note:
[Several calls of the model in one backward] in offload/autograd/outside_gradients.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

from .helpers import DEVICES, HostStepped

EXACT = {"rtol": 0.0, "atol": 0.0}

Loss = Callable[[nn.Module, list[torch.Tensor]], torch.Tensor]


def network(tied: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(8, 8))
    if tied:  # the embedding and the head: the first slice holds it, the last borrows it
        model[8].weight = model[0].weight
    return model


def batches(step: int, count: int, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(4, 8, generator=generator).to(device) for _ in range(count)]


def triplet(m: nn.Module, xs: list[torch.Tensor]) -> torch.Tensor:
    return nn.functional.triplet_margin_loss(m(xs[0]), m(xs[1]), m(xs[2]), margin=1.0)


def three_weighted(m: nn.Module, xs: list[torch.Tensor]) -> torch.Tensor:
    return sum((m(x) ** 2).sum() * (i + 1) for i, x in enumerate(xs))


def pair_and_penalty(m: nn.Module, xs: list[torch.Tensor]) -> torch.Tensor:
    # The penalty after the model's first call: its gradient reaches .grad before the last call's.
    return ((m(xs[0]) - m(xs[1])) ** 2).mean() + 1e-2 * m[4].weight.square().sum()


def offloaded(plain: nn.Module, device: str) -> tuple[OffloadModel, OffloadOptimizer]:
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3)
    return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3)


def in_place_additions(model: OffloadModel) -> list[int]:
    """Per walk of a backward, how many gradients it added into ``.grad`` in place."""
    added: list[int] = []
    gradients = model._engine.gradients
    real = gradients.finish

    def counting(pending):
        real(pending)
        added.append(sum(len(p.added) for p in pending))

    gradients.finish = counting
    return added


def step_both_alike(plain: tuple, offloaded_pair: tuple, zeroed_by: str, backward: Callable[[nn.Module], None]) -> None:
    """One step of each (module, optimizer) pair: ``backward(module)``, the step, then zeroing by
    ``zeroed_by`` (keeping tensors); the offloaded gradients and parameters equal the plain ones."""
    grads = []
    for module, opt in (plain, offloaded_pair):
        backward(module)
        grads.append([p.grad.clone() for p in module.parameters()])
        opt.step()
        (module if zeroed_by == "model" else opt).zero_grad(set_to_none=False)
    offloaded_pair[1].synchronize()
    for got, want in zip(*reversed(grads)):
        torch.testing.assert_close(got, want.cpu(), **EXACT)
    for p, q in zip(offloaded_pair[0].parameters(), plain[0].parameters()):
        torch.testing.assert_close(p, q.detach().cpu(), **EXACT)


@pytest.mark.parametrize("zeroed_by", ["model", "optimizer"])
@pytest.mark.parametrize("loss_fn,calls", [(triplet, 3), (three_weighted, 3), (pair_and_penalty, 2)],
                         ids=["triplet", "three-calls", "two-calls-and-a-penalty"])
@pytest.mark.parametrize("device", DEVICES)
def test_calls_after_zero_grad_keeping_tensors_train_as_autograd(loss_fn: Loss, calls, zeroed_by, device):
    """Rule 6 of Note: [Gradients added in place]: only the last call's walk adds into the zeroed
    .grad, so .grad ends as autograd's ``(c + b) + a`` where the first walk adding in place made it
    ``c + (b + a)``; and that walk still adds every gradient in place (no second copy for it)."""
    if device == "cuda" and loss_fn is pair_and_penalty:
        # The penalty's node runs on the CPU's thread, the calls' on the device's: autograd's own order is a race.
        pytest.skip("a penalty on host parameters races the device's nodes")
    plain = network().to(device)
    model, optimizer = offloaded(network(), device)
    reference = HostStepped(plain, lambda params: torch.optim.AdamW(params, lr=1e-3))
    added = in_place_additions(model)
    for step in range(4):
        step_both_alike((plain, reference), (model, optimizer), zeroed_by,
                        lambda module: loss_fn(module, batches(step, calls, device)).backward())
        if step > 0:  # .grad zeroed: the last walk of the backward adds it all
            assert added[-calls:] == [0] * (calls - 1) + [len(list(model.parameters()))]


@pytest.mark.parametrize("zeroed_by", ["model", "optimizer"])
@pytest.mark.parametrize("device", DEVICES)
def test_accumulating_backwards_of_three_calls_each_trains_as_autograd(zeroed_by, device):
    plain = network().to(device)
    model, optimizer = offloaded(network(), device)
    reference = HostStepped(plain, lambda params: torch.optim.AdamW(params, lr=1e-3))
    for step in range(3):
        def three_backwards(module: nn.Module) -> None:
            for k in range(3):
                three_weighted(module, batches(10 * step + k, 3, device)).backward()

        step_both_alike((plain, reference), (model, optimizer), zeroed_by, three_backwards)


@pytest.mark.parametrize("calls", [1, 2, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_a_tied_weight_in_several_calls_trains_as_autograd(calls, device):
    """Note: [A tied weight's gradients summed in place]: each walk but the last leaves its sum to the
    next, which continues it, ``((h2 + e2) + h1) + e1``, where returning each call's sum gave
    ``(h2 + e2) + (h1 + e1)``."""
    plain = network(tied=True).to(device)
    model, optimizer = offloaded(network(tied=True), device)
    assert model.partition[0][0] == "0" and model.partition[-1] == ("8",)  # the uses in two slices
    reference = HostStepped(plain, lambda params: torch.optim.AdamW(params, lr=1e-3))
    for step in range(3):
        for module, opt in ((plain, reference), (model, optimizer)):
            sum((module(x) ** 2).mean() for x in batches(step, calls, device)).backward()
            if module is plain:
                want = module[0].weight.grad.clone()
            else:
                got = module[0].weight.grad.clone()
            opt.step()
            opt.zero_grad()
        optimizer.synchronize()
        torch.testing.assert_close(got, want.cpu(), **EXACT)
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p, q.detach().cpu(), **EXACT)


def test_a_tied_weights_gradient_from_several_calls_by_autograd_grad_is_autograds():
    plain = network(tied=True)
    model = OffloadModel(network(tied=True), device="cpu", num_slices=3)
    results = []
    for module in (plain, model):
        loss = sum((module(x) ** 2).mean() for x in batches(0, 3, "cpu"))
        results.append(torch.autograd.grad(loss, [module[0].weight, module[2].weight]))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, **EXACT)


def test_a_later_call_without_the_tied_weight_is_left_nothing():
    """Step 2 of Note: [Several calls of the model in one backward]: the first call, made with the tied
    weight frozen, has no edge to it, so the second call's walk (which runs first) returns its sum
    rather than leave it to a walk that would drop it."""
    plain = network(tied=True)
    model = OffloadModel(network(tied=True), device="cpu", num_slices=3)
    for module in (plain, model):
        first, second = batches(0, 2, "cpu")
        module[0].weight.requires_grad_(False)
        out = module(first)
        module[0].weight.requires_grad_(True)
        ((out - module(second)) ** 2).mean().backward()
    assert model[0].weight.grad is not None
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad, **EXACT)
    torch.testing.assert_close(model[2].weight.grad, plain[2].weight.grad, **EXACT)
