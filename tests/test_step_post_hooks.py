"""A step post-hook sees the parameters as the plain optimizer's post-hook does: updated, through
whatever it holds (``param_groups``, which waits for nothing), and what it writes is what the next
forward computes with (``_start_updates`` in ``offload/optimizer.py``)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from offload import OffloadModel, OffloadOptimizer

from .test_optimizer import EXACT, batch, loss_of, network


class SlowAdamW(torch.optim.AdamW):
    """AdamW whose every step starts late: an update still running when step() returns is certain."""

    def step(self, closure=None):
        time.sleep(0.05)
        return super().step(closure)


def clamp_all(optimizer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.clamp_(-0.2, 0.2)


def hooked(optimizers, hook, where):
    """Register ``hook`` as a step post-hook of each of ``optimizers`` (``own``) or globally; the handles."""
    if where == "own":
        return [opt.register_step_post_hook(hook) for opt in optimizers]
    return [register_optimizer_step_post_hook(hook)]


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("where", ["own", "global"])
def test_a_step_post_hook_reads_the_parameters_updated(where, compute_dtype):
    # Before the fix the hook ran while the slices' updates were still running: it read some
    # slices before their update and some after.
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=compute_dtype)
    optimizer = OffloadOptimizer(model, SlowAdamW, lr=0.05, fused=True)
    seen: list[list[torch.Tensor]] = []

    def post_hook(opt, args, kwargs):
        if opt is optimizer:
            seen.append([p.detach().clone() for g in opt.param_groups for p in g["params"]])

    handles = hooked([optimizer], post_hook, where)
    try:
        for step in range(3):
            optimizer.zero_grad()
            loss_of(model, step).backward()
            optimizer.step()
            optimizer.synchronize()
            for a, b in zip(seen[-1], model.parameters(), strict=True):  # through the model: waits
                torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"what the hook read at step {step}: {m}")
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) == 3


@pytest.mark.parametrize("where", ["own", "global"])
def test_what_a_step_post_hook_writes_is_trained_on_as_with_the_plain_optimizer(where):
    # Before the fix the hook's writes raced with the updates still running.
    torch.manual_seed(0)
    plain_model, model = network(), OffloadModel(network(), device="cpu", num_slices=3)
    plain = SlowAdamW(plain_model.parameters(), lr=0.05, fused=True)
    optimizer = OffloadOptimizer(model, SlowAdamW, lr=0.05, fused=True)
    handles = hooked([plain, optimizer], lambda opt, args, kwargs: clamp_all(opt), where)
    try:
        for step in range(3):
            for m, opt in ((plain_model, plain), (model, optimizer)):
                opt.zero_grad()
                loss_of(m, step).backward()
                opt.step()
            with torch.no_grad():
                torch.testing.assert_close(model(batch(9)), plain_model(batch(9)), **EXACT,
                                           msg=lambda m: f"step {step}, the next forward: {m}")
    finally:
        for handle in handles:
            handle.remove()
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, **EXACT)


def test_without_a_post_hook_step_returns_before_the_updates_are_done():
    # The wait is the hooks' alone: without one, the updates overlap what follows step().
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, SlowAdamW, lr=0.05, fused=True)
    for step in range(2):  # the first step of a class of its own waits, to learn whether it draws random numbers
        optimizer.zero_grad()
        loss_of(model, step).backward()
        optimizer.step()
    assert model._engine.updates.pending() and not all(model._engine.updates.done(i) for i in range(3))
    optimizer.synchronize()
