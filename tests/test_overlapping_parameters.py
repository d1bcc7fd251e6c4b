"""Parameters whose memory is not dense: refused where their elements overlap, warned about where
they have gaps.

A parameter whose elements share memory (``nn.Parameter(t.expand(4, 4))``) cannot be stepped by a
plain optimizer; a host copy would hold its elements apart and train another model, so it is
refused when the model is built (Note: [Parameters whose elements overlap] in
``offload/streams/host_storage.py``). A strided view (``w[:, ::2]``) is laid out row-major, which
makes the kernels that read it round otherwise: a warning says so, and the dense copy it advises
trains bit for bit. Buffers whose elements overlap are read as in the plain model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from offload import OffloadModel
from offload.streams.flat_views import overlaps_itself

from .helpers import DEVICES

EXACT = {"rtol": 0.0, "atol": 0.0}


class Expanded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 1).expand(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class Strided(nn.Module):
    """A weight that is a column slice of a larger tensor, or (``dense``) a copy of one."""

    def __init__(self, dense: bool) -> None:
        super().__init__()
        w = torch.randn(8, 8)[:, ::2]
        self.w = nn.Parameter(w.contiguous() if dense else w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class Masked(nn.Module):
    """A linear layer that reads an expanded buffer: 12 elements over 4 memory locations."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4).expand(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def strided_model(dense: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Strided(dense), nn.Tanh(), nn.Linear(4, 3))


@pytest.mark.parametrize(("tensor", "overlaps"), [
    (torch.randn(4, 1).expand(4, 4), True),
    (torch.randn(16).as_strided((4, 4), (1, 1)), True),  # no stride 0, yet elements meet
    (torch.randn(8, 8)[:, ::2], False),
    (torch.randn(3, 4).t(), False),
    (torch.randn(16).as_strided((3, 2), (2, 3)), False),  # interleaved, apart
    (torch.arange(8).expand(1, -1), False),  # a stride 0 over one element
    (torch.randn(0, 3).expand(0, 3), False),
    (torch.tensor(1.0), False),
])
def test_overlaps_itself_tells_shared_elements(tensor, overlaps):
    assert overlaps_itself(tensor) is overlaps


def test_expanded_parameter_is_refused_naming_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Expanded(), nn.Linear(4, 2))
    with pytest.raises(ValueError) as raised:
        OffloadModel(model, device="cpu", num_slices=2)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("parameter '1.w' has elements that share memory (shape (4, 4), strides (1, 0)")
    assert "a plain optimizer cannot step it" in message
    assert ".contiguous(), .clone()) and expand it in forward" in message
    assert model[1].w.stride() == (1, 0)  # nothing moved


def test_overlapping_parameter_registered_after_wrap_is_refused_at_layout():
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device="cpu", num_slices=2)
    model[1].weight = nn.Parameter(torch.randn(8).as_strided((2, 4), (1, 1)))
    with pytest.raises(ValueError, match=r"parameter 'Linear\.weight' has elements that share memory"):
        model(torch.randn(3, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_buffer_is_read_as_in_the_plain_model(device):
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), Masked(), nn.Linear(4, 2))

    plain, model = build().to(device), OffloadModel(build(), device=device, num_slices=3)
    x = torch.randn(3, 4, device=device)
    torch.testing.assert_close(model(x), plain(x), **EXACT)
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=name)


@pytest.mark.filterwarnings("ignore:OffloadModel.*viewed memory:UserWarning")  # a view of a temporary: not our subject
def test_strided_parameter_warns_naming_it_and_the_cost():
    with pytest.warns(UserWarning, match=r"parameter 'w' of Strided is not dense \(shape \(8, 4\), strides \(8, 2\)\)"
                      r".*differ from the plain model's in the last bits.*nn\.Parameter\(t\.contiguous\(\)\)"):
        model = OffloadModel(strided_model(dense=False), device="cpu", num_slices=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model[1].extra = nn.Parameter(torch.zeros(2))  # a registration: the slice is laid out again
        model(torch.randn(5, 8))
    assert not [w for w in caught if "is not dense" in str(w.message)]  # laid out row-major already


@pytest.mark.parametrize("device", DEVICES)
def test_dense_copy_of_a_strided_parameter_trains_bit_for_bit_without_a_warning(device):
    plain = strided_model(dense=True).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = OffloadModel(strided_model(dense=True), device=device, num_slices=2)
    assert not [w for w in caught if "is not dense" in str(w.message)]
    x = torch.randn(5, 8, device=device)
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=name)
