"""Review of OffloadOptimizer(update_in_backward=True): cases beside the specification in
tests/test_update_in_backward.py where the option once differed from training without it (Note:
[Update in backward] in ``offload/optimizing/in_backward.py``)."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from offload import OffloadModel, OffloadOptimizer
from offload.optimizing.in_backward import BackwardUpdates

from .test_optimizer import batch, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

NUM_SLICES = 3


def _collected(ref: weakref.ref, seconds: float = 5.0) -> bool:
    """Whether ``ref``'s object goes once collected; the update worker may hold its last task a
    moment after it finished."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if ref() is None or time.monotonic() > deadline:
            return ref() is None
        time.sleep(0.01)


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_an_optimizer_dropped_while_the_model_lives_is_freed(update_in_backward):
    """The model's walk holds the subscriber that starts updates from backward; were it to hold
    the optimizer, the optimizer and its state (two float32 copies of the model for AdamW) would
    live as long as the model."""
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=update_in_backward)
    for step in range(2):
        model(batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    ref = weakref.ref(optimizer)
    del optimizer
    assert _collected(ref)
    # ... and its subscriber goes with it: it holds the update worker.
    assert not [s for s in model._engine.milestones.subscribers if isinstance(s, BackwardUpdates)]
    # The model trains on with a new optimizer.
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=update_in_backward)
    for step in range(2):
        model(batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


class _Flaky(torch.autograd.Function):
    """The identity, whose backward raises while ``FlakyLayer.failing`` is set."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if FlakyLayer.failing:
            raise ValueError("a failing backward")
        return grad


class FlakyLayer(torch.nn.Module):
    failing = False

    def forward(self, x):
        return _Flaky.apply(x)


def _flaky_network() -> torch.nn.Sequential:
    """``network()`` with a layer at the end whose backward can fail before any slice's gradients land."""
    return torch.nn.Sequential(*network(), FlakyLayer())


@pytest.mark.parametrize("failing_step", [0, 2], ids=["before-the-checked-step", "after-it"])
def test_training_goes_on_after_a_backward_that_failed_before_any_gradient_landed(failing_step):
    """A backward that raises before any slice's gradients reached the host leaves ``.grad`` and
    the parameters as they were, as autograd does; the user catches it and trains on. It did not
    add into ``.grad``, so it is not one of the accumulation's backwards: counted, the next
    ``step()`` refused "more backwards than declared" where the plain optimizer steps."""
    plain, model = _flaky_network(), OffloadModel(_flaky_network(), device="cpu", num_slices=NUM_SLICES)
    kwargs = {"lr": 0.1, "momentum": 0.9}
    plain_opt = torch.optim.SGD(plain.parameters(), **kwargs)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, update_in_backward=True, **kwargs)
    try:
        for step in range(4):
            for m, opt in ((plain, plain_opt), (model, optimizer)):
                if step == failing_step:
                    FlakyLayer.failing = True
                    with pytest.raises(ValueError, match="a failing backward"):
                        m(batch(100)).pow(2).mean().backward()
                    FlakyLayer.failing = False
                    opt.zero_grad()
                m(batch(step)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        FlakyLayer.failing = False
    optimizer.synchronize()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
