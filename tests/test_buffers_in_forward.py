"""Buffers a layer changes in forward in ways other than writing their values in place.

- A buffer resized in place (``buf.resize_``, as torch.ao's per-channel observers and
  ``FakeQuantize`` do on their first call) or pointed at other memory is refused before a later
  layer reads the buffers it overwrote, and nothing of its slice is written back (rule 5 of Note:
  [Buffers] in ``offload/walk/slice_walk.py``); the workarounds the error names train as the plain
  model does.
- A buffer assigned anew (``self.count = self.count + 1``) keeps its update when a later layer of
  its slice raises, as its in-place updates do (docs/api.md, Failures).
- A layer that checkpoints itself around a BatchNorm updates the running statistics once per
  forward, where the plain model's recompute updates them again in backward (docs/api.md,
  Layers that checkpoint themselves).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload import OffloadModel, OffloadOptimizer
from offload.walk.binding import BufferMovedError

from .helpers import DEVICES, HostStepped, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def assert_same_buffers(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name].cpu(), want[name].cpu(), msg=lambda m: f"{name}: {m}", **EXACT)


# -- buffers moved in place ---------------------------------------------------------------------


class Resizes(nn.Module):
    """Keeps the largest value of each feature in a buffer registered as one element, sized on the
    first call as torch.ao's ``PerChannelMinMaxObserver`` sizes ``min_val`` (to ``size`` elements,
    the features first)."""

    def __init__(self, width: int, size: int | None = None) -> None:
        super().__init__()
        self.width, self.size = width, size or width
        self.register_buffer("per_channel", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.per_channel.shape != (self.size,):
                self.per_channel.resize_((self.size,))
            self.per_channel.zero_()
            self.per_channel[:self.width].copy_(x.amax(dim=0))
        return x + self.per_channel[:self.width]


def grows_past_the_slot(width: int) -> Resizes:
    # resize_ past the end of the slot's memory moves all of it.
    return Resizes(width, size=100_000)


class Repoints(nn.Module):
    """Points its buffer at memory of its own (``.data =``), keeping the shape."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("level", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.level.data = self.level + x.detach().mean(0)
        return x + self.level


class Gate(nn.Module):
    """A neighbour whose buffer nobody writes; logs each call to ``calls``."""

    def __init__(self, width: int, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls
        self.register_buffer("enabled", torch.arange(1.0, width + 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("gate")
        return x * self.enabled


def moving_network(layer: Callable[[int], nn.Module], calls: list[str]) -> nn.Sequential:
    """A BatchNorm updated before the moving layer, and a neighbour after it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), layer(6), Gate(6, calls), nn.Linear(6, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer, message", [
    pytest.param(Resizes, r"buffer '2\.per_channel' \(Resizes\) was resized in place to shape \(6,\) \(laid out as "
                 r"\(1,\)\)", id="resized"),
    pytest.param(grows_past_the_slot, r"buffer '2\.per_channel' \(Resizes\) was resized in place to shape \(100000,\)",
                 id="past_the_slot"),
    pytest.param(Repoints, r"buffer '2\.level' \(Repoints\) was pointed at other memory", id="pointed_elsewhere"),
])
@pytest.mark.parametrize("num_slices", [1, 2])
@pytest.mark.parametrize("resident", [False, True])
@pytest.mark.parametrize("grad", [True, False])
def test_a_buffer_moved_in_forward_is_refused_and_its_slice_written_back_unchanged(device, layer, message, num_slices,
                                                                                   resident, grad):
    calls: list[str] = []
    layers = moving_network(layer, calls)
    model = OffloadModel(layers, device=device, num_slices=num_slices, resident_slices=num_slices if resident else 0)
    # The BatchNorm and the neighbour in the moving layer's slice.
    assert any({"1", "2", "3"} <= set(names) for names in model.partition)
    before = buffers_of(layers)
    x = torch.randn(5, 4, device=device)
    for _ in range(2):  # the moved device copy was laid out again: the next forward sees the same
        with torch.set_grad_enabled(grad), pytest.raises(BufferMovedError, match=message) as raised:
            model(x)
        assert isinstance(raised.value, RuntimeError)
        assert "run one forward of the plain model first" in str(raised.value)
        assert calls == []  # refused before the neighbour read what the buffer grew over
        assert_same_buffers(buffers_of(layers), before)  # the BatchNorm's update too: nothing written back


class ResizesAnother(nn.Module):
    """Resizes a buffer another layer registers, reached through a plain list (not a submodule)."""

    def __init__(self, other: nn.Module) -> None:
        super().__init__()
        self.other = [other]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.other[0].enabled.resize_((12,)).fill_(2.0)
        return x


@pytest.mark.parametrize("device", DEVICES)
def test_a_buffer_another_layer_resizes_is_refused_before_anything_is_written_back(device):
    calls: list[str] = []
    torch.manual_seed(0)
    gate = Gate(6, calls)
    layers = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), gate, ResizesAnother(gate), nn.Linear(6, 2))
    model = OffloadModel(layers, device=device, num_slices=1)
    before = buffers_of(layers)
    with pytest.raises(BufferMovedError, match=r"buffer '2\.enabled' \(Gate\) was resized in place to shape \(12,\)"):
        model(torch.randn(5, 4, device=device))
    assert_same_buffers(buffers_of(layers), before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_slices", [1, 3])
def test_a_buffer_given_its_shape_between_forwards_trains_as_the_plain_model(device, num_slices):
    calls: list[str] = []
    layers = moving_network(Resizes, calls)
    model = OffloadModel(layers, device=device, num_slices=num_slices)
    x = torch.randn(5, 4, device=device)
    with pytest.raises(BufferMovedError):
        model(x)
    layers[2].per_channel = torch.zeros(6, device=layers[2].per_channel.device)  # lays its slice out again
    reference = moving_network(Resizes, calls).to(device)
    reference[2].per_channel = torch.zeros(6, device=device)
    for step in range(3):
        x = torch.randn(5, 4, device=device)
        torch.testing.assert_close(model(x), reference(x), **EXACT)
        model(x).sum().backward()
        reference(x).sum().backward()
        assert_same_grads(model, reference, **EXACT)
        assert_same_buffers(buffers_of(layers), buffers_of(reference))


def quantization_aware(seed: int = 0) -> nn.Sequential:
    """The eager-mode QAT workflow: ``prepare_qat`` with the x86 qconfig, whose per-channel weight
    fake-quant sizes its observer's and its own buffers on the first call."""
    torch.manual_seed(seed)
    model = nn.Sequential(tq.QuantStub(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2),
                          tq.DeQuantStub())
    model.train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's own deprecation notices
        return tq.prepare_qat(model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_slices", [1, 3])
def test_prepare_qat_without_a_forward_first_is_refused_leaving_the_host_copies(device, num_slices):
    layers = quantization_aware()
    model = OffloadModel(layers, device=device, num_slices=num_slices)
    before = buffers_of(layers)
    with pytest.raises(BufferMovedError, match=r"buffer '1\.weight_fake_quant\.scale' .* resized in place to shape "
                                               r"\(8,\) \(laid out as \(1,\)\)"):
        model(torch.randn(6, 4, device=device))
    assert_same_buffers(buffers_of(layers), before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_slices", [1, 3])
def test_prepare_qat_after_one_plain_forward_trains_as_the_plain_model(device, num_slices):
    # The workaround the error names: one forward of the plain model sizes every buffer.
    layers, reference = quantization_aware(), quantization_aware()
    warm_up = torch.randn(6, 4)
    layers(warm_up)
    reference(warm_up)
    reference.to(device)
    model = OffloadModel(layers, device=device, num_slices=num_slices)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, fused=True)
    reference_optimizer = HostStepped(reference, lambda params: torch.optim.SGD(params, lr=0.1, fused=True))
    for step in range(3):
        if step == 2:  # observers off for the last step, as QAT schedules do
            model.apply(tq.disable_observer)
            reference.apply(tq.disable_observer)
        x = torch.randn(6, 4, device=device) * (1 + step)
        got, want = model(x), reference(x)
        torch.testing.assert_close(got, want, **EXACT)
        got.square().sum().backward()
        want.square().sum().backward()
        assert_same_grads(model, reference, **EXACT)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        assert_same_buffers(buffers_of(layers), buffers_of(reference))
    optimizer.synchronize()
    torch.testing.assert_close([p.cpu() for p in model.parameters()], [p.cpu() for p in reference.parameters()],
                               **EXACT)


# -- a buffer assigned anew, then a later layer raises ------------------------------------------


class CountsInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return x


class CountsByAssignment(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        self.total = self.total + x.detach().sum(0)
        return x + self.count


class FailsOnce(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("boom")
        return x


def counting_network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), CountsInPlace(), CountsByAssignment(), nn.BatchNorm1d(2), FailsOnce(),
                         nn.Linear(2, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_slices", [1, 2, 6])
@pytest.mark.parametrize("grad", [True, False])
def test_buffers_assigned_before_a_failing_layer_are_kept_as_in_the_plain_model(device, num_slices, grad):
    layers, reference = counting_network(), counting_network().to(device)
    model = OffloadModel(layers, device=device, num_slices=num_slices)
    x = torch.randn(4, 2, device=device)
    for network in (model, reference):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="boom"):
            network(x)
    assert int(layers[2].count) == 1
    assert_same_buffers(buffers_of(layers), buffers_of(reference))
    # Training goes on from the same buffers.
    layers[4].armed = reference[4].armed = False
    x = torch.randn(4, 2, device=device)
    torch.testing.assert_close(model(x), reference(x), **EXACT)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(model, reference, **EXACT)
    assert_same_buffers(buffers_of(layers), buffers_of(reference))


class AssignsWrongShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + torch.ones(3)
        return x


def test_a_failing_layer_still_raises_its_own_error_over_a_buffer_that_cannot_be_kept():
    layers = nn.Sequential(nn.Linear(2, 2), AssignsWrongShape(), CountsByAssignment(), FailsOnce())
    model = OffloadModel(layers, device="cpu", num_slices=1)
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(4, 2))
    assert layers[1].count.shape == () and float(layers[1].count) == 0.0  # left as it was
    assert int(layers[2].count) == 1  # the other is kept


# -- a layer that checkpoints itself around a BatchNorm ------------------------------------------


class CheckpointsItsNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(torch.tanh(self.lin(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_slices", [1, 2])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_a_layer_checkpointing_its_norm_updates_running_statistics_once_per_forward(device, num_slices,
                                                                                      checkpoint_activation):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), CheckpointsItsNorm(), nn.Linear(4, 2)).to(device)
    layers = copy.deepcopy(reference)
    model = OffloadModel(layers, device=device, num_slices=num_slices, checkpoint_activation=checkpoint_activation)
    for step in range(2):
        x = torch.randn(6, 4, device=device)
        got, want = model(x), reference(x)
        torch.testing.assert_close(got, want, **EXACT)
        after_forward = buffers_of(reference)
        got.sum().backward()
        want.sum().backward()  # the plain model's recompute updates its statistics again here
        assert_same_grads(model, reference, **EXACT)
        assert int(reference[1].bn.num_batches_tracked) == int(after_forward["1.bn.num_batches_tracked"]) + 1
        assert int(layers[1].bn.num_batches_tracked) == step + 1
        # Once per forward: the statistics the plain model holds after the same forward.
        assert_same_buffers(buffers_of(layers), after_forward)
        # Both go on from the same statistics (the plain model's second update is left out).
        reference.load_state_dict(model.state_dict())
