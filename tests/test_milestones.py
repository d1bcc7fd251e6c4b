"""The walks announce per-slice milestones to subscribers (gradient reduction subscribes)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from offload import OffloadModel
from offload.walk.milestones import Subscriber


class Recorder(Subscriber):
    def __init__(self):
        self.events = []

    def forward_started(self, token):
        self.events.append(("forward", id(token)))

    def gradients_produced(self, token, index, grads):
        assert any(t is not None for t in grads.device_tensors())
        self.events.append(("produced", id(token), index))

    def gradients_leaving(self, token, index, pending):
        self.events.append(("leaving", id(token), index))

    def gradients_landed(self, token, pending):
        # On the host and final: what autograd receives next.
        views = [v for p in pending.values() for v in p.host_views if v is not None]
        assert all(torch.isfinite(v).all() for v in views)
        self.events.append(("landed", id(token), sorted(pending)))


def test_milestones_come_in_walk_order_per_forward():
    model = OffloadModel(nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]), device="cpu", num_slices=3)
    recorder = Recorder()
    model._engine.milestones.subscribe(recorder)
    first, second = model(torch.randn(2, 4)), model(torch.randn(2, 4))
    second.sum().backward()
    first.sum().backward()
    forwards = [e[1] for e in recorder.events if e[0] == "forward"]
    assert len(forwards) == 2
    a, b = forwards
    def walk(token):
        return [event for i in (2, 1, 0) for event in (("produced", token, i), ("leaving", token, i))] + [
            ("landed", token, [0, 1, 2])]
    assert recorder.events[2:] == walk(b) + walk(a)


def test_no_milestones_without_autograd():
    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), device="cpu", num_slices=2)
    recorder = Recorder()
    model._engine.milestones.subscribe(recorder)
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert recorder.events == []


class _Position(nn.Module):
    """Adds a learned tensor of the activations' own shape: autograd returns one tensor as the
    parameter's gradient, the input's and the upstream gradient."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 5, 8))
        self.again = nn.Parameter(torch.randn(1, 5, 8))

    def forward(self, x):
        return x + self.pos + self.again


class _ScalesInPlace(Subscriber):
    """Rewrites each slice's gradients in place when they are produced, as the device average does."""

    rewrites_gradients = True

    def forward_started(self, token):
        pass

    def gradients_produced(self, token, index, grads):
        for g in grads.device_tensors():
            if g is not None:
                g.mul_(10.0)

    def gradients_leaving(self, token, index, pending):
        pass

    def gradients_landed(self, token, pending):
        pass


def test_a_subscriber_rewriting_gradients_in_place_changes_only_that_slices_parameters():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), _Position(), nn.Linear(8, 8))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    model._engine.milestones.subscribe(_ScalesInPlace())
    x = torch.randn(1, 5, 8)
    plain(x).sum().backward()
    model(x).sum().backward()
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, 10.0 * want.grad, rtol=0, atol=0, msg=name)


class _Shift(nn.Module):
    """Adds the sum of a parameter: autograd gives it an expanded gradient, one element seen
    through stride 0, which an in-place rewrite (or NCCL) cannot take."""

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return x + self.shift.sum()


class _ChecksDense(_ScalesInPlace):
    def gradients_produced(self, token, index, grads):
        assert all(g.is_contiguous() for g in grads.device_tensors() if g is not None)
        super().gradients_produced(token, index, grads)


def test_subscribers_get_dense_gradients_even_where_autograd_expands_one():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), _Shift(), nn.Tanh(), nn.Linear(8, 8))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    model._engine.milestones.subscribe(_ChecksDense())
    x = torch.randn(3, 8)
    plain(x).sum().backward()
    model(x).sum().backward()
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, 10.0 * want.grad, rtol=0, atol=0, msg=name)
