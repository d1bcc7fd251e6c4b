"""Finite-difference checks in float64: gradients of inputs and parameters through the full walk."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload import OffloadModel

from .helpers import ACTIVATIONS


def model64(dropout: float, activations: str, num_microbatches: int) -> OffloadModel:
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Linear(3, 4), nn.Tanh(), nn.Dropout(dropout), nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 2)
    ).double()
    return OffloadModel(plain, device="cpu", num_slices=3, num_microbatches=num_microbatches,
                        **ACTIVATIONS[activations])


@pytest.mark.parametrize("activations", ["recompute", "kept", "offload_all"])
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_gradcheck_inputs_and_parameters(activations, num_microbatches):
    model = model64(0.0, activations, num_microbatches)
    params = list(model.parameters())
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    # gradcheck perturbs the parameters in place between calls: every forward must load them anew.
    def fn(x, *ps):
        return model(x)

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("activations", ["recompute", "offload_last"])
def test_gradcheck_with_dropout_replays_the_same_masks(activations):
    model = model64(0.3, activations, 1)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    # Every evaluation starts from the same seed, so the function is deterministic for gradcheck;
    # backward must replay exactly the masks of its own forward.
    def fn(x, *ps):
        torch.manual_seed(11)
        return model(x)

    assert torch.autograd.gradcheck(fn, (x, *model.parameters()), eps=1e-6, atol=1e-5, rtol=1e-4)
