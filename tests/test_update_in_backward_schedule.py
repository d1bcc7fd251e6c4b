"""How the updates backward starts meet autograd and the worker: autograd adopts the host
gradients as `.grad` instead of copying them (on the H100 run such a copy of 3.5 GB of float32
gradients added ~0.4 s to each step of a 0.9 B-parameter model, and its bytes to host memory), and
a worker that falls behind leaves the slices still to land to step(), in slice order, and runs
what it holds in the order the next forward loads it."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer


def _adopted(model: OffloadModel) -> int:
    """How many parameters hold, as ``.grad``, memory of the model's pooled gradient buffers."""
    pool = model._engine.pool
    pointers = {b.data.untyped_storage().data_ptr() for buffers in pool._buffers.values() for b in buffers}
    return sum(p.grad is not None and p.grad.untyped_storage().data_ptr() in pointers for p in model.parameters())


def test_gradients_of_the_backward_that_starts_the_update_are_adopted_not_copied():
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), device="cpu", num_slices=4)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True)
    count = len(list(model.parameters()))
    for step in range(3):
        model(torch.randn(8, 32)).sum().backward()
        assert _adopted(model) == count, f"step {step}: autograd copied gradients instead of adopting them"
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer._in_backward.last_started == {0, 1, 2, 3}


def test_a_worker_behind_leaves_the_remaining_slices_to_step_in_slice_order_and_stays_exact():
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)])
    plain = copy.deepcopy(layers)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    model = OffloadModel(layers, device="cpu", num_slices=5)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True)
    optimizer._in_backward.max_backlog = 0
    order = []
    submit = optimizer._updates._submit_update

    def recording(step, *args, **kwargs):
        order.append(step.index)
        return submit(step, *args, **kwargs)

    optimizer._updates._submit_update = recording
    queue = optimizer._updates._submit

    def slow(index, work, *args):
        def slower():
            time.sleep(0.05)  # a host slower than the device: the worker falls behind
            work()
        return queue(index, slower, *args)

    optimizer._updates._submit = slow
    for _ in range(3):
        x = torch.randn(8, 32)
        plain(x).sum().backward()
        model(x).sum().backward()
        reference.step()
        reference.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The last slice lands first and starts at once; once one update is pending, every slice still
    # to land waits for step(), which starts them in slice order.
    started = optimizer._in_backward.last_started
    assert 4 in started and 0 not in started
    assert order[-5:][:len(started)] == sorted(started, reverse=True)
    assert order[-5 + len(started):] == sorted(set(range(5)) - started)
    assert all("behind" in why for why in optimizer._in_backward.deferred.values())


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_the_worker_runs_what_backward_queued_in_the_order_the_next_forward_loads_and_stays_exact(accumulation_steps):
    # Note: [Updates in the next forward's order]: backward queues slice 4's update first and slice
    # 0's last; the next forward needs slice 0 first.
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)])
    plain = copy.deepcopy(layers)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    model = OffloadModel(layers, device="cpu", num_slices=5)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True,
                                 accumulation_steps=accumulation_steps)
    ran: list[int] = []
    backward_done = threading.Event()
    queue = optimizer._updates._submit

    def held(index, work, *args):
        def run():
            # The first update holds the worker until backward has queued the others: a host behind.
            assert backward_done.wait(10), "backward waited for an update"
            ran.append(index)
            work()
        return queue(index, run, *args)

    optimizer._updates._submit = held
    for step in range(3):
        for _ in range(accumulation_steps):
            x = torch.randn(8, 32)
            plain(x).sum().backward()
            out = model(x)  # waits for the last step's updates
            backward_done.clear()
            out.sum().backward()
        backward_done.set()
        reference.step()
        reference.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    assert optimizer._in_backward.last_started == {0, 1, 2, 3, 4}
    # The worker's first pick is whichever update was queued when it came to it (slice 4's when it
    # keeps up; another when it came late, on a loaded machine); it then holds the worker until
    # backward has queued the rest, which run in slice order, not backward's (4, 3, 2, ...).
    first, *rest = ran[-5:]
    assert sorted(ran[-5:]) == [0, 1, 2, 3, 4] and rest == sorted(rest)
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
