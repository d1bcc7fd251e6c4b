"""Autograd at the model's edges: ``torch.func`` transforms and forward-mode AD over a model that
builds no graph, in one microbatch or several; a tied weight that the loss also uses outside the
model; an in-place first layer on an input that needs a gradient.

Each compares with the unwrapped model: bit for bit where OffloadModel promises it, and where it
does not (Note: [Chunks with a version counter of their own] in ``offload/walk/microbatch.py``,
Note: [Leaves enter through a copy] in ``offload/autograd/slice_graph.py``, docs/api.md), by how
much it differs, or that it says so.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn

from offload import OffloadModel

from .helpers import ACTIVATIONS, DEVICES

EXACT = {"rtol": 0.0, "atol": 0.0}


def _plain(device: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(device)


def _without_a_graph(how: str, model: nn.Module):
    """``torch.no_grad()``, or a frozen model (nothing requires grad): either way no graph is built."""
    if how == "frozen":
        model.requires_grad_(False)
        return contextlib.nullcontext()
    return torch.no_grad()


# -- torch.func transforms without a graph ----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [1, 2, 3])
def test_vmap_under_no_grad_gives_the_plain_models_result(device, num_microbatches):
    # Several microbatches run as one under a transform: its tensors have no memory to join by.
    plain = _plain(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, num_microbatches=num_microbatches)
    xs = torch.randn(3, 4, 6, device=device)  # vmap over dim 0: each call sees a [4, 6] batch
    with torch.no_grad():
        expected = torch.func.vmap(plain)(xs)
        got = torch.func.vmap(model)(xs)
    torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("how", ["no_grad", "frozen"])
@pytest.mark.parametrize("settings", [{}, {"resident_slices": 1}, {"checkpoint_activation": False}],
                         ids=["streamed", "resident", "kept"])
def test_jvp_and_jacfwd_without_a_graph_give_the_plain_models_results(device, num_microbatches, how, settings):
    # A gradient transform refuses in-place writes to tensors it did not wrap; the slices' loads write
    # the walk's own memory outside it (Note: [Copies under a torch.func transform] in copies.py).
    plain = _plain(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, num_microbatches=num_microbatches,
                         **settings)
    x, tangent = torch.randn(4, 6, device=device), torch.randn(4, 6, device=device)
    with torch.no_grad():
        expected_out, expected_tangent = torch.func.jvp(plain, (x,), (tangent,))
        expected_jacobian = torch.func.jacfwd(plain)(x[:2])
    with _without_a_graph(how, model):
        out, out_tangent = torch.func.jvp(model, (x,), (tangent,))
        jacobian = torch.func.jacfwd(model)(x[:2])
    torch.testing.assert_close(out, expected_out, **EXACT)
    torch.testing.assert_close(out_tangent, expected_tangent, **EXACT)
    torch.testing.assert_close(jacobian, expected_jacobian, **EXACT)
    assert model._engine.slots.loads > 0  # the slices did stream through the slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [2, 3])
def test_forward_ad_under_no_grad_keeps_each_microbatchs_tangent(device, num_microbatches):
    # A dual input is cut into views (which carry the tangent), never into aliases of its memory.
    plain = _plain(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, num_microbatches=num_microbatches)
    x, tangent = torch.randn(6, 6, device=device), torch.randn(6, 6, device=device)
    with torch.no_grad(), forward_ad.dual_level():
        # What the model computes: each microbatch's rows through the plain model, joined.
        chunks = [forward_ad.unpack_dual(plain(forward_ad.make_dual(a, t)))
                  for a, t in zip(x.tensor_split(num_microbatches), tangent.tensor_split(num_microbatches))]
        got = forward_ad.unpack_dual(model(forward_ad.make_dual(x, tangent)))
    assert got.tangent is not None
    torch.testing.assert_close(got.primal, torch.cat([c.primal for c in chunks]), **EXACT)
    torch.testing.assert_close(got.tangent, torch.cat([c.tangent for c in chunks]), **EXACT)


# -- a tied weight used outside the model too -------------------------------------------------------


class _Embedding(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.embedding = nn.Embedding(10, 6)
        self.embedding.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


class _Head(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()


def _tied(device: str) -> nn.Sequential:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(10, 6))
    return nn.Sequential(_Embedding(weight), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), _Head(weight)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("penalty", [False, True], ids=["loss_of_the_output", "with_a_penalty_on_the_weight"])
def test_a_tied_weight_that_the_loss_also_uses_outside(device, activations, penalty):
    # The model hands autograd the tied weight's two slices' gradients summed; a term outside the
    # model is added onto that sum, where the plain model adds it onto the head's before the
    # embedding's: another rounding, at most about one unit in the last place of the largest
    # entry (docs/api.md, Tied parameters across slices). Without such a term, bit for bit.
    plain = _tied(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=2, **ACTIVATIONS[activations])
    ids = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(0)).to(device)
    for net in (plain, model):
        loss = net(ids).pow(2).mean()
        if penalty:
            loss = loss + 1e-2 * net[0].embedding.weight.pow(2).sum()
        loss.backward()
    for (name, expected), got in zip(plain.named_parameters(), model.parameters()):
        expected_grad = expected.grad.to(got.grad.device)  # the offloaded model's are on the host
        if penalty and name == "0.embedding.weight":
            largest = expected_grad.abs().max().item()
            torch.testing.assert_close(got.grad, expected_grad, rtol=0.0,
                                       atol=torch.finfo(expected.dtype).eps * largest)
        else:
            torch.testing.assert_close(got.grad, expected_grad, **EXACT, msg=lambda m: f"{name}: {m}")


# -- an in-place first layer on an input that needs a gradient ------------------------------------


class _AddsInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("first", [nn.ReLU(inplace=True), _AddsInPlace()], ids=["relu_", "add_"])
def test_an_in_place_first_layer_on_an_input_that_needs_a_gradient_warns(activations, num_microbatches, first):
    # The input enters through a copy, which the layer writes: the caller's tensor keeps its values,
    # where the plain model changes it (Note: [Leaves enter through a copy] in slice_graph.py).
    torch.manual_seed(0)
    plain = nn.Sequential(first, nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2, num_microbatches=num_microbatches,
                         **ACTIVATIONS[activations])
    leaf = torch.randn(4, 6, requires_grad=True)
    h = leaf * 1
    before = h.detach().clone()
    with pytest.warns(UserWarning, match=r"first slice \(layers 0, 1, 2\) wrote the model's input in place"):
        model(h).sum().backward()
    torch.testing.assert_close(h.detach(), before, **EXACT)  # what the warning says: not written
    # The model's own gradients are the plain model's.
    expected_leaf = leaf.detach().clone().requires_grad_()
    plain(expected_leaf * 1).sum().backward()
    tolerance = EXACT if num_microbatches == 1 else {"rtol": 1e-6, "atol": 1e-7}
    torch.testing.assert_close(leaf.grad, expected_leaf.grad, **tolerance)


@pytest.mark.parametrize("first", [nn.ReLU(), nn.ReLU(inplace=True)], ids=["out_of_place", "in_place_no_grad_input"])
def test_no_warning_where_the_callers_input_is_written_as_in_the_plain_model(first):
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(first, nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)), device="cpu",
                         num_slices=2, num_microbatches=2)
    x = torch.randn(4, 6, requires_grad=not first.inplace)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
