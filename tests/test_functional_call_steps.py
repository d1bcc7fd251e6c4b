"""``step()`` after a backward that started updates (``update_in_backward``), with the slices laid
out again in between: by a ``torch.func.functional_call`` (EMA weights evaluated between backward
and ``step()``) or by a layer's parameter replaced. The step updates what backward did not, once,
as the plain optimizer does.

See Note: [A plan kept for its step()] in ``offload/optimizing/in_backward.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call

from offload import OffloadModel, OffloadOptimizer

from .test_optimizer import EXACT, assert_same, batch, network


def twins(**settings) -> tuple[tuple[nn.Module, torch.optim.Optimizer], tuple[OffloadModel, OffloadOptimizer]]:
    """The plain model under ``torch.optim.AdamW``, and its twin offloaded under OffloadOptimizer."""
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=True, **settings)
    return (plain, torch.optim.AdamW(plain.parameters(), lr=1e-2)), (model, optimizer)


def train(module: nn.Module, optimizer: torch.optim.Optimizer, between: Callable[[nn.Module, int], None],
          after: Callable[[nn.Module], None] = lambda module: None) -> None:
    """Four steps, with ``between(module, step)`` between each backward and its ``step()``, and
    ``after(module)`` after the step (backward updates the parameters before it: only then are
    they the plain model's)."""
    for step in range(4):
        optimizer.zero_grad()
        module(batch(step)).square().sum().backward()
        between(module, step)
        optimizer.step()
        after(module)


@pytest.mark.parametrize("deferred", [False, True], ids=["all_in_backward", "slice_2_at_step"])
def test_an_ema_evaluated_between_backward_and_step_changes_no_update(deferred):
    (plain, plain_opt), (model, optimizer) = twins()
    if deferred:  # a gradient hook leaves slice 2's update to step() (Note: [Update in backward])
        model[5].weight.register_post_accumulate_grad_hook(lambda p: None)
    outputs = []
    for module, opt in ((plain, plain_opt), (model, optimizer)):
        ema = {name: p.detach().clone() for name, p in module.named_parameters()}

        def evaluate(module: nn.Module, step: int, ema: dict[str, torch.Tensor] = ema) -> None:
            with torch.no_grad():
                outputs.append(functional_call(module, ema, (batch(step),)))

        @torch.no_grad()
        def average(module: nn.Module, ema: dict[str, torch.Tensor] = ema) -> None:
            for name, p in module.named_parameters():
                ema[name].lerp_(p, 0.1)

        train(module, opt, evaluate, average)
    if deferred:
        assert optimizer._in_backward.deferred.keys() == {2}
    assert optimizer._in_backward.last_started  # backward did update, and the step did not again
    assert_same(plain, plain_opt, model, optimizer)
    for got, want in zip(outputs[4:], outputs[:4]):
        torch.testing.assert_close(got, want, **EXACT)


def test_a_parameter_replaced_between_backward_and_step_is_stepped_once():
    (plain, plain_opt), (model, optimizer) = twins()
    old = []
    for module, opt in ((plain, plain_opt), (model, optimizer)):
        def replace(module: nn.Module, step: int) -> None:
            if step == 2:  # the slice is laid out again around the new parameter by the next forward
                old.append(module[0].weight)
                # Not of the old one's values: backward has updated those already here, not plainly.
                module[0].weight = nn.Parameter(torch.full_like(module[0].weight, 0.5))
                with torch.no_grad():
                    module(batch(99))

        train(module, opt, replace)
    optimizer.synchronize()
    torch.testing.assert_close(old[1], old[0], **EXACT)
    torch.testing.assert_close(optimizer.state[old[1]]["exp_avg"], plain_opt.state[old[0]]["exp_avg"], **EXACT)
    torch.testing.assert_close(optimizer.state[old[1]]["exp_avg_sq"], plain_opt.state[old[0]]["exp_avg_sq"], **EXACT)
    assert_same(plain, plain_opt, model, optimizer)
