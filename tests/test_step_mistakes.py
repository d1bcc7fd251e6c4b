"""Steps in the wrong place, as a first-time user writes them: ``optimizer.step()`` between a
forward and its backward raises PyTorch's error (Note: [A step between a forward and its backward]
in ``offload/walk/steps.py``), and a plain optimizer stepping the parameters an OffloadOptimizer
just stepped waits for that update (Note: [Another optimizer stepping the model's parameters] in
``offload/optimizing/settled_steps.py``). Where plain PyTorch trains, the results are its own, bit
for bit."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of
from offload.streams.updates import SliceUpdates

from .test_optimizer import EXACT, batch, loss_of, network

INPLACE = "modified by an inplace operation"

STEPPED = [
    pytest.param(torch.optim.AdamW, {"lr": 1e-2}, None, id="AdamW-default"),
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, None, id="AdamW-fused"),
    pytest.param(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, None, id="SGD"),
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, torch.bfloat16, id="AdamW-bf16"),
]


class SlowAdamW(torch.optim.AdamW):
    """AdamW whose every step starts late: the update is certainly still pending when step() returns."""

    def step(self, closure=None):
        time.sleep(0.05)
        return super().step(closure)


def offloaded(cls, kwargs, compute_dtype=None, **settings):
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=compute_dtype)
    return model, OffloadOptimizer(model, cls, **kwargs, **settings)


def assert_same_parameters(actual: nn.Module, expected: nn.Module) -> None:
    for (name, p), q in zip(actual.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **EXACT, msg=name)


# -- a step between a forward and its backward ---------------------------------------------------------


@pytest.mark.parametrize("cls, kwargs, compute_dtype", STEPPED)
def test_a_step_between_forward_and_backward_raises(cls, kwargs, compute_dtype):
    # Before the fix the inner optimizers stepped proxies with version counters of their own, so
    # backward recomputed every slice from the updated parameters and raised nothing.
    model, optimizer = offloaded(cls, kwargs, compute_dtype)
    loss_of(model, 0).backward()
    loss = loss_of(model, 1)
    optimizer.step()
    with pytest.raises(RuntimeError, match=INPLACE) as raised:
        loss.backward()
    assert "OffloadOptimizer.step() updated the OffloadModel's parameters between this forward and its backward" \
        in str(raised.value)


def test_plain_pytorch_raises_the_same_error():
    """The promise the error keeps (docs/api.md): the step the plain model refuses."""
    plain = network()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    loss_of(plain, 0).backward()
    loss = loss_of(plain, 1)
    optimizer.step()
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_between_two_backwards_of_a_retained_graph_raises(fused):
    model, optimizer = offloaded(torch.optim.AdamW, {"lr": 1e-2, "fused": fused})
    loss = loss_of(model, 0)
    loss.backward(retain_graph=True)
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


def test_a_step_that_finds_no_gradient_changes_nothing_and_is_no_mistake():
    # As in plain PyTorch: no gradient, no update, no bumped counter.
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=3)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for m, opt in ((plain, plain_optimizer), (model, optimizer)):
        loss = loss_of(m, 0)
        opt.step()
        loss.backward()
        opt.step()
    assert_same_parameters(model, plain)


# -- the loops that must keep working -------------------------------------------------------------------


@pytest.mark.parametrize("cls, kwargs", [p.values[:2] for p in STEPPED[:3]], ids=[p.id for p in STEPPED[:3]])
@pytest.mark.parametrize("loop", ["plain", "accumulation", "closure"])
def test_the_training_loops_stay_exact(cls, kwargs, loop):
    plain = network()
    plain_optimizer = cls(plain.parameters(), **kwargs)
    model, optimizer = offloaded(cls, kwargs)
    for m, opt in ((plain, plain_optimizer), (model, optimizer)):
        for step in range(3):
            if loop == "closure":
                def closure(m=m, opt=opt, step=step):
                    opt.zero_grad()
                    loss = loss_of(m, step)
                    loss.backward()
                    return loss
                opt.step(closure)
                continue
            for micro in range(2 if loop == "accumulation" else 1):
                loss_of(m, 2 * step + micro).backward()
            opt.step()
            opt.zero_grad()
    assert_same_parameters(model, plain)


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_updates_in_backward_trip_no_check(accumulation_steps):
    plain = network()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    model, optimizer = offloaded(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, update_in_backward=True,
                                 accumulation_steps=accumulation_steps)
    for m, opt in ((plain, plain_optimizer), (model, optimizer)):
        for step in range(3):
            for micro in range(accumulation_steps):
                loss_of(m, 2 * step + micro).backward()
            opt.step()
            opt.zero_grad()
    assert_same_parameters(model, plain)


def test_a_step_of_parameters_outside_the_model_only_is_no_mistake():
    # One optimizer over the model and a head beside it: a step that updates the head alone, between
    # the model's forward and its backward, changes nothing the forward read (it raised before).
    def run(offload):
        body, head = network(), nn.Linear(3, 1)
        if offload:
            body = OffloadModel(body, device="cpu", num_slices=3)
            optimizer = OffloadOptimizer(body, torch.optim.AdamW, [*body.parameters(), *head.parameters()], lr=1e-2)
        else:
            optimizer = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-2)
        for step in range(3):
            features = body(batch(step))
            head(features.detach()).pow(2).mean().backward()
            optimizer.step()  # the head only: the body has no gradient yet
            optimizer.zero_grad()
            features.pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return nn.Sequential(body, head)

    assert_same_parameters(run(True), run(False))


def test_a_step_under_a_forward_through_other_weights_is_no_mistake():
    # torch.func.functional_call with weights of the caller's (an EMA's): the forward read those, not
    # the model's parameters, so the model's step before its backward is no mistake (it raised before).
    def run(offload):
        model = network()
        if offload:
            model = OffloadModel(model, device="cpu", num_slices=3)
            optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ema = {name: p.detach().clone() for name, p in model.named_parameters()}
        grads = []
        for step in range(3):
            loss_of(model, step).backward()
            x = batch(50 + step).requires_grad_()
            other = torch.func.functional_call(model, ema, (x,)).pow(2).mean()
            optimizer.step()
            optimizer.zero_grad()
            grads.append(torch.autograd.grad(other, x)[0])
        return model, grads

    (model, grads), (plain, plain_grads) = run(True), run(False)
    assert_same_parameters(model, plain)
    for got, expected in zip(grads, plain_grads):
        torch.testing.assert_close(got, expected, **EXACT)


# -- a plain optimizer stepping the same parameters right after ------------------------------------------


def two_optimizers(model: nn.Module, cls) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """An AdamW (an OffloadOptimizer on an OffloadModel) and a plain SGD with momentum, over the
    same parameters, the second kept as a user who added the first may keep it."""
    first = (OffloadOptimizer(model, cls, lr=1e-2, weight_decay=0.1) if isinstance(model, OffloadModel)
             else cls(model.parameters(), lr=1e-2, weight_decay=0.1))
    return first, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_with_two(model: nn.Module, first, second, synchronize: bool = False) -> list[torch.Tensor]:
    losses = []
    for step in range(3):
        loss = loss_of(model, step)
        loss.backward()
        losses.append(loss.detach())
        first.step()
        if synchronize:
            first.synchronize()
        second.step()
        first.zero_grad(set_to_none=False)
        second.zero_grad(set_to_none=False)
    return losses


def test_a_plain_optimizer_after_offload_optimizer_waits_for_its_update():
    # Before the fix the SGD step ran while SlowAdamW's update was still pending on the worker:
    # SGD's update landed first, under AdamW's weight decay, unlike the plain model's.
    plain = network()
    plain_losses = train_with_two(plain, *two_optimizers(plain, torch.optim.AdamW))
    model = OffloadModel(network(), device="cpu", num_slices=3)
    losses = train_with_two(model, *two_optimizers(model, SlowAdamW))
    torch.testing.assert_close(torch.stack(losses), torch.stack(plain_losses), **EXACT)
    assert_same_parameters(model, plain)


def test_a_plain_optimizer_after_offload_optimizer_under_a_compute_dtype():
    """Under bf16 the oracle is the same run with ``synchronize()`` before the plain step: the
    shadows the pending update wrote must be cast again from what the plain step wrote."""
    runs = []
    for synchronize in (True, False):
        model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
        losses = train_with_two(model, *two_optimizers(model, SlowAdamW), synchronize=synchronize)
        runs.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()],
                     loss_of(model, 3).detach()))
    (losses_a, params_a, next_a), (losses_b, params_b, next_b) = runs
    torch.testing.assert_close(losses_b, losses_a, **EXACT)
    torch.testing.assert_close(params_b, params_a, **EXACT)
    torch.testing.assert_close(next_b, next_a, **EXACT)


def test_an_optimizer_over_other_parameters_does_not_wait(monkeypatch):
    """The wait is for the parameters the step steps: a head outside the model steps at once."""
    model = OffloadModel(network(), device="cpu", num_slices=3)
    head = nn.Linear(3, 2)
    optimizer = OffloadOptimizer(model, SlowAdamW, lr=1e-2)
    head_optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    head(model(batch(0))).sum().backward()
    optimizer.step()
    waits = []
    monkeypatch.setattr(SliceUpdates, "wait_all", lambda self, shadows_stale=False: waits.append(self))
    head_optimizer.step()
    monkeypatch.undo()
    assert waits == [] and engine_of(model).updates.pending()
    optimizer.synchronize()
