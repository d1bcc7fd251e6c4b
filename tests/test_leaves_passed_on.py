"""A boundary leaf that needs a gradient and crosses a slice unchanged shares the saved leaf of the
boundary before (Note: [Leaves that pass through] in ``offload/autograd/records.py``, its last item),
and one that a layer changed does not: gradients equal the plain model's, bit for bit, in every way
of keeping activations."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import OffloadModel

from .helpers import ACTIVATIONS

EXACT = {"rtol": 0.0, "atol": 0.0}
WIDTH = 4


class Split(nn.Module):
    """Hidden states and a second stream that needs a gradient, which the layers after pass on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class Carry(nn.Module):
    """Passes the stream on; ``change`` says how it changes it first, ``use`` how it uses it (an
    addition saves neither operand, so the plain model may change the stream after it)."""

    def __init__(self, change: str = "none", use: str = "add") -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.change, self.use = change, use

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, r = state
        if self.change == "in place":
            r.mul_(2)
        elif self.change == "new memory":
            r.data = r.data * 2  # a write autograd does not count, into memory of its own
        h = self.lin(h)
        return torch.tanh(h + r if self.use == "add" else h * r), r


class Loss(nn.Module):
    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (state[0] ** 2).sum() + (state[1] ** 2).sum()


@pytest.mark.parametrize("activations", sorted(ACTIVATIONS))
@pytest.mark.parametrize("change", ["none", "in place", "new memory"])
def test_a_stream_passed_on_gets_the_plain_gradients(change, activations):
    torch.manual_seed(0)
    # The slices after the change multiply by the stream: their recompute must start from its new values.
    plain = nn.Sequential(Split(), Carry(), Carry(change), Carry(use="mul"), Carry(use="mul"), Loss())
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=6, **ACTIVATIONS[activations])
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1))
    want, got = plain(x), model(x)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, **EXACT)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **EXACT, msg=name)
