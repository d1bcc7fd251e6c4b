"""OffloadOptimizer(update_in_backward=True) with an inner optimizer that writes ``.grad`` itself:
an update that backward started and that runs after backward returned, before ``step()``, is the
library's own write into ``.grad``, not a change of the user's. ``step()`` goes on, bit for bit the
plain optimizer's, while a change the user makes there is still refused (Note: [Update in
backward] in ``offload/optimizing/in_backward.py``).

The torch.optim paths that write into the gradient they are given (torch 2.13; every class,
per-tensor, foreach and fused, with and without ``maximize``, ``weight_decay``, momentum,
``nesterov``, ``amsgrad``, ``centered``, ``decoupled_weight_decay``, looked through and stepped):
``SGD(momentum, nesterov=True, foreach=True)`` without ``maximize`` and ``weight_decay`` adds the
momentum into it (``torch._foreach_add_(grads, bufs, alpha=momentum)``), and the per-tensor
``SGD`` with a ``weight_decay`` tensor that requires grad adds the decay into it
(``grad.addcmul_``). Every other path copies the gradient before it writes (``maximize``'s
negation, ``weight_decay``'s out-of-place add, Rprop's clone).

The updates are held on the worker until backward has returned and released before ``step()``, so
that each runs between the two whatever the machine's timing: in a loop, that is when backward
outruns the host (the fuzzer's reproducer slept 50 ms there, as logging would take).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.autograd.accumulation import still_zeroed

from .test_optimizer import assert_same, batch, network
from .test_update_in_backward import Plain, offload_loss, plain_optimizer

pytestmark = [pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation"),
              pytest.mark.filterwarnings("ignore:.*host parameters with (foreach=True|the per-tensor)")]

EXACT = {"rtol": 0.0, "atol": 0.0}
NUM_SLICES = 3


def nesterov() -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "foreach": True}


def decay_requiring_grad() -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    # A fresh tensor per optimizer: each optimizer's groups hold their own.
    return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": torch.tensor(0.01, requires_grad=True),
                             "foreach": False}


#: The inner optimizers that write into the gradient they are given (the module's docstring).
WRITERS: dict[str, Callable[[], tuple[type[torch.optim.Optimizer], dict[str, Any]]]] = {
    "SGD-nesterov-foreach": nesterov,
    "SGD-per-tensor-weight_decay-requiring-grad": decay_requiring_grad,
}


class HeldUpdates:
    """Holds each update handed to the update worker while closed (those backward starts) until
    :meth:`run_held` lets them go and waits until they ran; updates handed over while open (those
    ``step()`` starts) run as usual."""

    def __init__(self, optimizer: OffloadOptimizer) -> None:
        self._open = threading.Event()
        self._open.set()
        self._ran = threading.Semaphore(0)
        self._held = 0
        queue = optimizer._updates._submit

        def submit(index: int, work: Callable[[], None], *args: Any) -> Any:
            if self._open.is_set():
                return queue(index, work, *args)
            self._held += 1

            def held() -> None:
                try:
                    assert self._open.wait(10), "the held update was never let go"
                    work()
                finally:
                    self._ran.release()

            return queue(index, held, *args)

        optimizer._updates._submit = submit

    def close(self) -> None:
        self._open.clear()

    def run_held(self) -> int:
        """Let the held updates run, wait until they ran, and return how many there were."""
        self._open.set()
        for _ in range(self._held):
            assert self._ran.acquire(timeout=10), "a held update did not run"
        held, self._held = self._held, 0
        return held


def backward_held(model: OffloadModel, held: HeldUpdates, x: torch.Tensor, divide: int) -> None:
    """A backward through ``model`` whose updates are held until it has returned (and recorded
    each ``.grad`` for ``step()`` to compare)."""
    loss = offload_loss(model, x, divide)  # its loads wait for the last step's updates
    held.close()
    loss.backward()


@pytest.mark.parametrize("writer, compute_dtype, accumulation_steps, set_to_none", [
    pytest.param("SGD-nesterov-foreach", None, 1, False, id="SGD-nesterov-foreach"),
    pytest.param("SGD-nesterov-foreach", None, 1, True, id="SGD-nesterov-foreach-set_to_none"),
    pytest.param("SGD-nesterov-foreach", None, 2, False, id="SGD-nesterov-foreach-acc2"),
    pytest.param("SGD-nesterov-foreach", torch.bfloat16, 1, False, id="SGD-nesterov-foreach-bf16"),
    pytest.param("SGD-per-tensor-weight_decay-requiring-grad", None, 1, False,
                 id="SGD-per-tensor-weight_decay-requiring-grad"),
    pytest.param("SGD-per-tensor-weight_decay-requiring-grad", None, 2, True,
                 id="SGD-per-tensor-weight_decay-requiring-grad-acc2-set_to_none"),
])
def test_an_update_that_writes_its_gradients_after_backward_is_not_taken_for_a_change(
        writer, compute_dtype, accumulation_steps, set_to_none):
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, compute_dtype=compute_dtype)
    reference = Plain(network(), compute_dtype)
    cls, kwargs = WRITERS[writer]()
    plain = plain_optimizer(cls, reference.model.parameters(), kwargs)
    cls, kwargs = WRITERS[writer]()
    optimizer = OffloadOptimizer(model, cls, update_in_backward=True, accumulation_steps=accumulation_steps, **kwargs)
    held = HeldUpdates(optimizer)
    params = list(model.parameters())  # a read through the model waits for the updates: not while they are held
    for step in range(4):
        for micro in range(accumulation_steps):
            x = batch(10 * step + micro)
            reference.backward(x, accumulation_steps)
            backward_held(model, held, x, accumulation_steps)
            # The first step only checks; from the second on, the backward that ends the
            # accumulation starts every slice's update, which runs only now, after it returned.
            assert held.run_held() == (NUM_SLICES if step > 0 and micro == accumulation_steps - 1 else 0)
        versions = [p.grad._version for p in reference.model.parameters()]
        plain.step()
        assert any(p.grad._version != v for p, v in zip(reference.model.parameters(), versions)), \
            f"{writer} no longer writes into .grad: this test tests nothing"
        optimizer.step()  # raised: "the gradient ... changed between backward and step()"
        assert optimizer._in_backward.last_started == (set(range(NUM_SLICES)) if step > 0 else set())
        optimizer.synchronize()
        # The updates wrote into .grad as the plain optimizer does; but those step() starts (the
        # first step's) get a weight_decay tensor that no longer requires grad, and leave it alone.
        for (name, want), got in zip(reference.model.named_parameters(), params):
            if step > 0 or writer == "SGD-nesterov-foreach":
                torch.testing.assert_close(got.grad, want.grad, **EXACT, msg=lambda m: f"{name}'s .grad: {m}")
        for opt in (plain, optimizer):
            opt.zero_grad(set_to_none=set_to_none)
    assert_same(reference.model, plain, model, optimizer)


def clip(params: list[nn.Parameter]) -> None:
    torch.nn.utils.clip_grad_norm_(params, max_norm=1e-3)


def zero(params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad.zero_()


def replace(params: list[nn.Parameter]) -> None:
    params[0].grad = params[0].grad.clone()


@pytest.mark.parametrize("change", [clip, zero, replace], ids=["clip_grad_norm_", "zeroed-in-place", "replaced"])
@pytest.mark.parametrize("when", ["before-the-updates-ran", "after-the-updates-ran"])
def test_a_change_of_the_gradients_between_backward_and_step_is_still_refused(change, when):
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    cls, kwargs = nesterov()
    optimizer = OffloadOptimizer(model, cls, update_in_backward=True, **kwargs)
    held = HeldUpdates(optimizer)
    params = list(model.parameters())
    for step in range(2):  # the first step only checks; the second starts updates in backward
        backward_held(model, held, batch(step), 1)
        held.run_held()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    backward_held(model, held, batch(2), 1)
    if when == "before-the-updates-ran":
        change(params)
        assert held.run_held() == NUM_SLICES
    else:
        assert held.run_held() == NUM_SLICES
        change(params)
    with pytest.raises(RuntimeError, match="changed between backward and step\\(\\)") as raised:
        optimizer.step()
    assert "The update of slices [0, 1, 2] already ran" in str(raised.value)


def test_a_gradient_the_update_wrote_is_not_taken_for_zeros():
    """Backward adds into a ``.grad`` it takes for the zeros ``zero_grad`` left while its version
    counter stays (rule 6 of Note: [Gradients added in place] in ``offload/autograd/accumulation.py``);
    what the update writes into it moves none, so a ``.grad`` the update wrote is taken for zeros no
    more. Here a frozen weight's ``.grad`` of its own, which the optimizer still steps, as torch steps
    every parameter with a ``.grad``, and which backward leaves alone."""
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    cls, kwargs = nesterov()
    optimizer = OffloadOptimizer(model, cls, update_in_backward=True, **kwargs)
    held = HeldUpdates(optimizer)
    frozen = list(model.parameters())[0]
    for step in range(3):
        if step == 2:
            frozen.requires_grad_(False)
            frozen.grad = torch.zeros_like(frozen)  # not a view of the slice's gradients: a counter of its own
        optimizer.zero_grad(set_to_none=False)
        assert step < 2 or still_zeroed(frozen, frozen.grad)
        backward_held(model, held, batch(step), 1)
        held.run_held()
        optimizer.step()
    assert optimizer._in_backward.last_started == set(range(NUM_SLICES))
    assert frozen.grad.count_nonzero() > 0  # the momentum, added into it by the update
    assert not still_zeroed(frozen, frozen.grad)
