"""Gradients of activations (Grad-CAM): a tensor hook or ``retain_grad()`` registered where
``offload.will_recompute()`` is ``False`` receives the plain model's gradient, for layers in every
slice and every way of keeping activations; one registered in a recomputed slice's forward does
not (that graph keeps nothing), which is what ``will_recompute()`` tells (docs/api.md, "Gradients
of activations")."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
from offload import OffloadModel

from .helpers import ACTIVATIONS

EXACT = {"rtol": 0.0, "atol": 0.0}
LAYERS = [0, 2, 4, 6]  # one per slice of four: the first, middle and last slices


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4), nn.Identity())


def activation_gradients(model: nn.Module, x: torch.Tensor, wait: bool) -> dict[int, list[torch.Tensor]]:
    """Per layer, the gradients its output received in one backward, hooks registered as the docs
    say (``wait``) or on every call."""
    gradients: dict[int, list[torch.Tensor]] = {k: [] for k in LAYERS}
    states: dict[int, list[bool]] = {k: [] for k in LAYERS}

    def keep(k: int):
        def hook(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
            states[k].append(offload.will_recompute())
            if not (wait and offload.will_recompute()):
                output.register_hook(gradients[k].append)
        return hook

    handles = [model[k].register_forward_hook(keep(k)) for k in LAYERS]
    model(x).pow(2).sum().backward()
    for handle in handles:
        handle.remove()
    assert not offload.will_recompute()  # outside any forward
    return gradients, states


@pytest.mark.parametrize("activations", sorted(ACTIVATIONS))
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_hook_registered_where_nothing_will_recompute_gets_the_plain_gradient(activations, num_microbatches):
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4, num_microbatches=num_microbatches,
                         **ACTIVATIONS[activations])
    x = torch.randn(6, 8)
    # With microbatches, the plain layers on each chunk (docs/api.md, "Results"): one gradient per
    # chunk, in the order the backward reaches them.
    expected = [activation_gradients(plain, chunk, wait=True)[0] for chunk in x.chunk(num_microbatches)]
    got, _ = activation_gradients(model, x, wait=True)
    for k in LAYERS:
        assert len(got[k]) == num_microbatches, k
        for gradient in got[k]:
            assert sum(torch.equal(gradient, chunk[k][0]) for chunk in expected) == 1, k


@pytest.mark.parametrize("activations", sorted(ACTIVATIONS))
def test_will_recompute_is_true_exactly_in_the_forwards_whose_graph_keeps_nothing(activations):
    model = OffloadModel(network(), device="cpu", num_slices=4, **ACTIVATIONS[activations])
    x = torch.randn(6, 8)
    got, states = activation_gradients(model, x, wait=False)
    expected, _ = activation_gradients(network(), x, wait=False)
    recomputed = {"recompute": [0, 2, 4], "kept": [], "offload_last": [0, 2], "offload_all": []}[activations]
    for k in LAYERS:
        # A recomputed slice's layer runs twice: in forward (True: its hook's gradient never
        # comes) and in the recompute (False); any other runs once, False.
        assert states[k] == ([True, False] if k in recomputed else [False]), (k, states[k])
        # A hook registered in a recomputed slice's forward never fires: one gradient, the plain one.
        assert len(got[k]) == 1, k
        torch.testing.assert_close(got[k][0], expected[k][0], **EXACT)
