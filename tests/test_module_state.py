"""Layers that keep state in plain attributes and change it in forward (Note: [Attribute state]).

The recompute must start from the attributes the forward's run started from, as it does from the
buffers; what cannot be restored is refused with advice. References are the plain layers run the
way OffloadModel runs them (slice by slice, microbatch by microbatch).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from offload import OffloadModel

from .helpers import DEVICES, assert_same_grads, microbatched_reference

EXACT = {"rtol": 0.0, "atol": 0.0}


class Peak(nn.Module):
    """Scales by the largest magnitude seen so far, kept in a plain float attribute (the shape of a
    dynamic rotary embedding: state that grows with the inputs and shapes the output)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.peak = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = float(x.detach().abs().max())
        if seen > self.peak:
            self.peak = seen
        return self.linear(x) / self.peak


class Counter(nn.Module):
    """Counts its calls in a plain int and keeps their scales in a list: output depends on both."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0
        self.scales: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.scales.append(1.0 + 0.5 * self.calls)
        return self.linear(x) * sum(self.scales)


class History(nn.Module):
    """Changes nothing but the contents of its containers: a list grown in place and a dict's entry
    replaced; output depends on both."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seen: list[int] = []
        self.last: dict[str, float] = {"scale": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        self.last["scale"] = self.last["scale"] + 0.25
        return self.linear(x) * (len(self.seen) + self.last["scale"])


class Lazy(nn.Module):
    """Creates a plain tensor attribute on first use (as the long-context rotary tables do) and
    replaces it when the input grows."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = getattr(self, "table", None)
        if table is None or table.shape[0] < x.shape[0]:
            self.table = torch.linspace(0.5, 1.5, x.shape[0], device=x.device)
        return self.linear(x) * self.table[: x.shape[0], None]


class OwnNoise(nn.Module):
    """Adds noise drawn from a generator of its own, kept as a plain attribute (noise injection)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.randn(x.shape, generator=self.generator).to(x.device)


class LayerDrop(nn.Module):
    """Skips its layer when Python's generator says so, as a layer drop does."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if random.random() < 0.5 else self.linear(x)


class NumpyDrop(LayerDrop):
    """The same, by NumPy's global generator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy

        return x if numpy.random.uniform() < 0.5 else self.linear(x)


class NumpyNoise(LayerDrop):
    """Scales by one Gaussian from NumPy's global generator a run: every other one is the cached
    second of a pair, handed out without moving the generator's raw state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy

        return self.linear(x) * float(1.0 + numpy.random.standard_normal())


def library_generators() -> tuple:
    import numpy

    state = numpy.random.get_state()
    return random.getstate(), state[1].tolist(), state[2:]


def stack(kind: type[nn.Module], width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(kind(width), nn.Tanh(), kind(width), nn.Tanh(), nn.Linear(width, width), kind(width))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [Peak, Counter, History, Lazy, OwnNoise, LayerDrop, NumpyDrop, NumpyNoise])
@pytest.mark.parametrize("num_slices", [1, 2, 3])
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_recompute_sees_the_attributes_the_forward_saw(kind, num_slices, num_microbatches, device):
    import numpy

    layers = stack(kind)
    reference = copy.deepcopy(layers).to(device)
    model = OffloadModel(layers, device=device, num_slices=num_slices, num_microbatches=num_microbatches)
    for step, scale in enumerate([1.0, 3.0, 2.0, 5.0]):  # growing, shrinking: every branch of the layers
        x = (torch.randn(4, 6, generator=torch.Generator().manual_seed(step)) * scale).to(device)
        random.seed(step)
        numpy.random.seed(step)
        want = microbatched_reference(reference, model.partition, x, num_microbatches)
        random.seed(step)
        numpy.random.seed(step)
        got = model(x)
        torch.testing.assert_close(got, want, **EXACT)
        drawn = library_generators()
        (want * torch.arange(6.0, device=device)).sum().backward()
        (got * torch.arange(6.0, device=device)).sum().backward()
        assert_same_grads(layers, reference, **EXACT)
        # Backward put back what forward left: the next step starts where the plain layers do.
        assert library_generators() == drawn
        for mine, theirs in zip(layers.modules(), reference.modules()):
            for name in ("peak", "calls", "scales"):
                assert getattr(mine, name, None) == getattr(theirs, name, None)
            if isinstance(mine, OwnNoise):
                assert torch.equal(mine.generator.get_state(), theirs.generator.get_state())
        layers.zero_grad()
        reference.zero_grad()


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_one_numpy_gaussian_a_run_is_replayed(num_microbatches):
    """One Gaussian a run: every other run takes the cached one, which leaves NumPy's raw state as it
    was; its recompute must still take the cached one, and the next run's must not."""
    import numpy

    torch.manual_seed(0)
    layers = nn.Sequential(*[NumpyNoise(6) for _ in range(5)])
    reference = copy.deepcopy(layers)
    model = OffloadModel(layers, device="cpu", num_slices=5, num_microbatches=num_microbatches)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        numpy.random.seed(step)
        want = microbatched_reference(reference, model.partition, x, num_microbatches)
        numpy.random.seed(step)
        got = model(x)
        torch.testing.assert_close(got, want, **EXACT)
        want.sum().backward()
        got.sum().backward()
        assert_same_grads(layers, reference, **EXACT)
        layers.zero_grad()
        reference.zero_grad()


def test_two_forwards_before_their_backwards():
    layers = stack(Peak)
    reference = copy.deepcopy(layers)
    model = OffloadModel(layers, device="cpu", num_slices=2)
    inputs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(s)) * scale
              for s, scale in enumerate([2.0, 4.0])]
    got = [model(x) for x in inputs]
    want = [reference(x) for x in inputs]
    for g, w in zip(reversed(got), reversed(want)):
        w.sum().backward()
        g.sum().backward()
    assert_same_grads(layers, reference, **EXACT)


class InPlaceTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.total = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.detach().sum(0))
        return self.linear(x) + self.total


def test_a_tensor_attribute_changed_in_place_is_refused_with_advice():
    model = OffloadModel(nn.Sequential(InPlaceTensor(), nn.Linear(4, 4)), device="cpu", num_slices=2)
    with pytest.raises(RuntimeError, match=r"InPlaceTensor\.total .*register_buffer\('total'"):
        model(torch.randn(3, 4, requires_grad=True))


def test_as_a_buffer_the_same_state_is_exact():
    class InPlaceBuffer(InPlaceTensor):
        def __init__(self) -> None:
            super().__init__()
            del self.total
            self.register_buffer("total", torch.zeros(4), persistent=False)

    torch.manual_seed(0)
    layers = nn.Sequential(InPlaceBuffer(), nn.Linear(4, 4))
    reference = copy.deepcopy(layers)
    model = OffloadModel(layers, device="cpu", num_slices=2)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(layers, reference, **EXACT)


def test_without_checkpointing_nothing_is_captured(monkeypatch):
    import offload.walk.module_state as module_state

    def refuse(*args, **kwargs):
        raise AssertionError("captured attributes without a recompute to use them")

    monkeypatch.setattr(module_state.AttributeSnapshot, "__init__", refuse)
    model = OffloadModel(stack(Peak), device="cpu", num_slices=2, checkpoint_activation=False)
    model(torch.randn(4, 6)).sum().backward()


def test_a_change_in_the_last_microbatch_does_not_reach_an_earlier_recompute():
    # The last slice's last microbatch keeps its graph and is never recomputed, but it changes the
    # attribute after the earlier microbatch's checkpoint was taken.
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(6, 6), Peak(6))
    reference = copy.deepcopy(layers)
    model = OffloadModel(layers, device="cpu", num_slices=2, num_microbatches=2)
    x = torch.zeros(4, 6)
    x[2:] = 100.0  # the first microbatch leaves the peak at 1, the second raises it
    want = microbatched_reference(reference, model.partition, x, 2)
    got = model(x)
    assert layers[1].peak > 1.0
    want.sum().backward()
    got.sum().backward()
    assert_same_grads(layers, reference, **EXACT)


def test_a_later_forward_changing_the_attributes_does_not_reach_an_earlier_recompute():
    # The first forward changes nothing; the second grows the state before the first's backward.
    class Longest(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(6, 6)
            self.longest = 4

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.longest = max(self.longest, x.shape[0])
            return self.linear(x) / self.longest

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), Longest(), nn.Tanh(), nn.Linear(6, 1))
    reference = copy.deepcopy(layers)
    model = OffloadModel(layers, device="cpu", num_slices=3)
    short, long = torch.randn(4, 6), torch.randn(16, 6)
    got, want = model(short).sum(), reference(short).sum()
    model(long), reference(long)
    got.backward()
    want.backward()
    assert_same_grads(layers, reference, **EXACT)
    assert layers[2].longest == reference[2].longest == 16


class PeakBuffer(nn.Module):
    """:class:`Peak` with its state in a buffer, replaced when it grows."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("peak", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.detach().abs().max()
        if seen > self.peak:
            self.peak = seen.clone()
        return self.linear(x) / self.peak


@pytest.mark.parametrize("changing", [[1], [0, 2], [1, 2]], ids=["second", "first-third", "second-third"])
def test_a_buffer_change_in_a_later_microbatch_does_not_reach_an_earlier_recompute(changing):
    # Rule 3 of Note: [Buffers]: runs that change nothing keep the buffers they found too.
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(6, 6), PeakBuffer(6), nn.Linear(6, 6))
    reference = copy.deepcopy(layers)
    model = OffloadModel(layers, device="cpu", num_slices=2, num_microbatches=3)
    x = torch.zeros(6, 6)
    for k, scale in zip(changing, (100.0, 1000.0)):
        x[2 * k:2 * k + 2] = scale  # microbatch k raises the peak
    want = microbatched_reference(reference, model.partition, x, 3)
    got = model(x)
    torch.testing.assert_close(got, want, **EXACT)
    want.sum().backward()
    got.sum().backward()
    assert_same_grads(layers, reference, **EXACT)
    assert torch.equal(layers[1].peak, reference[1].peak)


@pytest.mark.parametrize("forward_mode, backward_mode", [("train", "eval"), ("eval", "train")])
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_the_recompute_runs_in_the_mode_of_its_forward_not_the_mode_at_backward(forward_mode, backward_mode,
                                                                                 num_microbatches):
    # An evaluation pass between a training forward and its backward switches the model to eval:
    # the plain model's graph was built with dropout and batch statistics, and so must the recompute be.
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Tanh(),
                           nn.Linear(8, 3))
    reference = copy.deepcopy(layers)
    model = OffloadModel(layers, device="cpu", num_slices=3, num_microbatches=num_microbatches)
    for m in (reference, model):
        getattr(m, forward_mode)()
    x = torch.randn(6, 4)
    torch.manual_seed(7)
    want = microbatched_reference(reference, model.partition, x, num_microbatches)
    torch.manual_seed(7)
    got = model(x)
    assert torch.equal(got, want)
    for m in (reference, model):
        getattr(m, backward_mode)()
    want.pow(2).sum().backward()
    got.pow(2).sum().backward()
    assert_same_grads(layers, reference, **EXACT)
    # The mode set before backward is the one the layers have after it.
    assert all(module.training == (backward_mode == "train") for layer in layers for module in layer.modules())
