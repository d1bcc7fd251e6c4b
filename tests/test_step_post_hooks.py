"""A step post-hook sees the parameters as the plain optimizer's post-hook does: updated, through
whatever it holds (``param_groups``, which waits for nothing), and what it writes is what the next
forward computes with, under a compute dtype too (``_start_updates`` in ``offload/optimizer.py``)."""

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


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("where", ["own", "global"])
@pytest.mark.parametrize("hook", ["reads", "writes"])
def test_a_step_post_hook_sees_the_updated_parameters_and_its_writes_are_trained_on(hook, where, compute_dtype):
    # Before the fix the hook ran while the slices' updates were still running: it read some
    # slices before their update and some after, and its writes raced with the update (and, under
    # a compute dtype, the next forward used the shadows the update wrote before them).
    plain_model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=compute_dtype)
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=compute_dtype)
    plain = SlowAdamW(plain_model.parameters(), lr=0.05, fused=True)
    optimizer = OffloadOptimizer(model, SlowAdamW, lr=0.05, fused=True)
    seen: dict[int, list[list[torch.Tensor]]] = {id(plain): [], id(optimizer): []}

    def post_hook(opt, args, kwargs):
        if hook == "writes":
            clamp_all(opt)
        seen[id(opt)].append([p.detach().clone() for g in opt.param_groups for p in g["params"]])

    handles = ([opt.register_step_post_hook(post_hook) for opt in (plain, optimizer)] if where == "own"
               else [register_optimizer_step_post_hook(post_hook)])
    try:
        for step in range(3):
            for m, opt in ((plain_model, plain), (model, optimizer)):
                opt.zero_grad()
                loss_of(m, step).backward()
                opt.step()
            with torch.no_grad():  # the forward right after the step computes with what the hook left
                torch.testing.assert_close(model(batch(9)), plain_model(batch(9)), **EXACT,
                                           msg=lambda m: f"step {step}, the next forward: {m}")
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen[id(optimizer)]) == 3
    for step, (got, want) in enumerate(zip(seen[id(optimizer)], seen[id(plain)])):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"what the hook read at step {step}: {m}")
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
