"""What a forward may do to the model besides computing, and the transforms around it.

- A layer that writes a parameter in place in forward (``nn.Embedding(max_norm=...)``, a pre-hook
  that clamps a weight) is refused at that forward, naming the parameter (Note: [Parameters
  written in forward] in ``offload/walk/slice_walk.py``); the advice it gives trains as the plain
  model does, bit for bit.
- ``torch.nn.utils.parametrize.cached()`` around forward and backward gives the plain model's
  gradients; what cannot be exact in it is refused (Note: [Parametrizations cached around a run]
  in ``offload/walk/binding.py``, rule 4 of Note: [Transforms the walk refuses]).
- ``torch.__future__.set_swap_module_params_on_conversion(True)``: ``.double()`` and
  ``load_state_dict`` swap the parameters as in the plain model (nothing holds a weak reference
  to them).
- Batched gradients, forward-mode AD and ``torch.func`` transforms: what works is the plain
  model's, bit for bit; the rest is refused with a message naming OffloadModel (Note:
  [Transforms the walk refuses] in ``offload/autograd/refusals.py``).
"""

from __future__ import annotations

import copy
import functools
import weakref

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.nn.utils import parametrize

from offload import OffloadModel

from .helpers import ACTIVATIONS, DEVICES, HostStepped, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}


def _pair(build, device: str, **kwargs):
    torch.manual_seed(0)
    plain = build().to(device)
    kwargs.setdefault("num_slices", 3)
    return plain, OffloadModel(copy.deepcopy(plain).cpu(), device=device, **kwargs)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3))


# -- parameters written in forward ----------------------------------------------------------------


def _embedding(max_norm: float | None = 1.0) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(20, 8, max_norm=max_norm), nn.Flatten(), nn.Linear(24, 8), nn.Tanh(),
                         nn.Linear(8, 3))


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
@pytest.mark.parametrize("device", DEVICES)
def test_an_embedding_with_max_norm_is_refused_at_its_forward(device: str, grad: bool) -> None:
    _, model = _pair(_embedding, device)
    before = model[0].weight.detach().clone()
    ids = torch.randint(0, 20, (4, 3), generator=torch.Generator().manual_seed(0)) * 3 % 20
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=r"parameter '0\.weight' \(Embedding\) was "
                                                      r"changed in place during forward(.|\n)*max_norm"):
        model(ids.to(device))
    assert torch.equal(model[0].weight.detach(), before)  # the host copy never changed
    # max_norm is a layer setting: without it the model trains again.
    model[0].max_norm = None
    model(ids.to(device)).sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_whose_renormalisation_changed_nothing_does_not_hide_a_later_one(device: str) -> None:
    """nn.Embedding(max_norm=...) calls its renormalisation on every forward: the first here finds
    every row within the norm (its counter moves, the weight stays) and goes through; once the
    rows grow past it, the forward that renormalises them is refused all the same."""
    _, model = _pair(functools.partial(_embedding, max_norm=1e3), device)
    ids = torch.arange(12).reshape(4, 3)
    model(ids.to(device)).sum().backward()
    with torch.no_grad():
        model[0].weight.mul_(1e4)
    before = model[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight' \(Embedding\) was changed in place"):
        model(ids.to(device))
    assert torch.equal(model[0].weight.detach(), before)


@pytest.mark.parametrize("device", DEVICES)
def test_a_weight_that_holds_a_nan_is_not_taken_as_written_and_a_signed_zero_is(device: str) -> None:
    """The counter moves on every forward of an Embedding with max_norm; whether the weight changed
    is told bit for bit: a NaN in a row no batch looks up is not a write (the plain model runs), a
    0.0 made -0.0 is one."""
    plain, model = _pair(functools.partial(_embedding, max_norm=1e3), device)
    for m in (plain, model):
        with torch.no_grad():
            m[0].weight[19, 1] = float("nan")
    ids = torch.arange(12).reshape(4, 3)
    torch.testing.assert_close(model(ids.to(device)), plain(ids.to(device)), **EXACT)

    def negate_zeros(module: nn.Module, args: tuple) -> None:
        with torch.no_grad():
            module.weight[18].copy_(-module.weight[18])  # a row of zeros: the same values, other bits

    with torch.no_grad():
        model[0].weight[18] = 0.0
    model[0].register_forward_pre_hook(negate_zeros)
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight' \(Embedding\) was changed in place"):
        model(ids.to(device))


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_weight_clamped_by_a_pre_hook_is_refused_beside_buffers_written(device: str, compute_dtype) -> None:
    """The clamped weight shares its slice with a BatchNorm whose counter forward writes: only the
    parameter's write is refused."""
    clamped = nn.Linear(10, 10)
    layers = nn.Sequential(nn.Linear(6, 10), nn.Sequential(nn.BatchNorm1d(10), clamped), nn.Tanh(), nn.Linear(10, 3))
    model = OffloadModel(layers, device=device, num_slices=2, compute_dtype=compute_dtype)
    x = torch.randn(4, 6, device=device)
    model(x).sum().backward()  # the BatchNorm's buffers alone: no refusal

    def clamp(module: nn.Module, args: tuple) -> None:
        with torch.no_grad():
            module.weight.clamp_(-0.1, 0.1)

    clamped.register_forward_pre_hook(clamp)
    with pytest.raises(RuntimeError, match=r"parameter '1\.1\.weight' \(Linear\) was changed in place"):
        model(x)


@pytest.mark.parametrize("device", DEVICES)
def test_renormalising_outside_forward_as_the_refusal_advises_trains_as_the_plain_model(device: str) -> None:
    torch.manual_seed(0)
    plain = _embedding().to(device)
    model = OffloadModel(copy.deepcopy(plain).cpu(), device=device, num_slices=3)
    model[0].max_norm = None
    plain_opt = HostStepped(plain, lambda params: torch.optim.SGD(params, lr=0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        ids = torch.randint(0, 20, (4, 3), generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            torch.embedding_renorm_(model[0].weight, ids, 1.0, 2.0)
        expected, out = plain(ids.to(device)), model(ids.to(device))
        torch.testing.assert_close(out, expected, **EXACT)
        expected.pow(2).sum().backward()
        out.pow(2).sum().backward()
        assert_same_grads(model, plain, **EXACT)
        plain_opt.step(), opt.step()
        plain_opt.zero_grad(), opt.zero_grad()
    torch.testing.assert_close(model[0].weight.detach(), plain[0].weight.detach().cpu(), **EXACT)


# -- parametrize.cached() ---------------------------------------------------------------------------


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(w + w.T) * 1.5


def _parametrized() -> nn.Sequential:
    model = _mlp()
    parametrize.register_parametrization(model[2], "weight", Symmetric())
    return model


class Twice(nn.Module):
    """Uses its parametrized weight twice in one forward: the cache computes it once."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 10)
        parametrize.register_parametrization(self.linear, "weight", Symmetric())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x)))


@pytest.mark.parametrize("activations", list(ACTIVATIONS))
@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_and_backward_inside_parametrize_cached_are_the_plain_models(device: str, activations: str) -> None:
    def build() -> nn.Sequential:
        model = _parametrized()
        model.insert(3, Twice())
        return model

    plain, model = _pair(build, device, **ACTIVATIONS[activations])
    x = torch.randn(4, 6, device=device)
    for net in (plain, model):
        with parametrize.cached():
            net(x).pow(2).sum().backward()
    assert model[2].parametrizations.weight.original.grad is not None
    assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
def test_the_callers_cache_entries_stay_as_they_were(device: str) -> None:
    plain, model = _pair(_parametrized, device)
    x = torch.randn(4, 6, device=device)
    with parametrize.cached():
        host_weight = model[2].weight  # cached from the host copy, outside the model
        with torch.no_grad():
            first, second = model(x), model(2 * x)
            expected = plain(x), plain(2 * x)
        out = model(x)
        assert model[2].weight is host_weight
    torch.testing.assert_close((first, second), expected, **EXACT)
    out.sum().backward()
    with parametrize.cached():
        plain(x).sum().backward()
    assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
def test_what_parametrize_cached_would_share_across_runs_is_refused(device: str) -> None:
    _, model = _pair(_parametrized, device)
    x = torch.randn(4, 6, device=device)
    with parametrize.cached():
        model(x)
        with pytest.raises(RuntimeError, match=r"OffloadModel: a second forward that builds a graph inside one "
                                               r"torch\.nn\.utils\.parametrize\.cached\(\) block"):
            model(x)
    model.num_microbatches = 2
    with parametrize.cached(), pytest.raises(RuntimeError, match=r"OffloadModel: a forward in 2 microbatches"):
        model(x)
    # Outside the block, and in a new one, the model runs.
    model(x).sum().backward()
    model.num_microbatches = 1
    with parametrize.cached():
        model(x).sum().backward()


# -- parameters swapped on conversion ---------------------------------------------------------------


@pytest.fixture
def swapping():
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


@pytest.mark.parametrize("device", DEVICES)
def test_conversions_that_swap_parameters_work_as_on_the_plain_model(device: str, swapping: None) -> None:
    plain, model = _pair(_mlp, device)
    x = torch.randn(4, 6, device=device)
    # Gradients added onto earlier ones teach the model which parameters take gradients from
    # outside it (Note: [Adding onto earlier gradients]): nothing of that may hold a parameter weakly.
    model.zero_grad(set_to_none=False)
    for _ in range(2):
        model(x).sum().backward()
    assert all(weakref.getweakrefcount(p) == 0 for p in model.parameters())
    params = list(model.parameters())
    model.double()
    plain.double()
    assert [p.dtype for p in model.parameters()] == [torch.float64] * len(params)
    assert all(a is b for a, b in zip(model.parameters(), params))  # swapped in place, as in the plain model
    model.load_state_dict(plain.state_dict())
    model.zero_grad()
    expected, out = plain(x.double()), model(x.double())
    torch.testing.assert_close(out, expected, **EXACT)
    expected.sum().backward()
    out.sum().backward()
    assert_same_grads(model, plain, **EXACT)


# -- batched gradients, forward-mode AD, torch.func -------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_batched_parameter_gradients_are_refused_and_batched_input_gradients_are_exact(device: str) -> None:
    plain, model = _pair(_mlp, device)
    x = torch.randn(4, 6, device=device, requires_grad=True)
    rows = torch.eye(12, device=device).reshape(12, 4, 3)
    with pytest.raises(RuntimeError, match=r"OffloadModel: torch\.autograd\.grad\(\.\.\., is_grads_batched=True\) "
                                           r"cannot give the model's parameter gradients"):
        torch.autograd.grad(model(x), list(model.parameters()), grad_outputs=rows, is_grads_batched=True)
    expected = torch.autograd.grad(plain(x), x, grad_outputs=rows, is_grads_batched=True)[0]
    got = torch.autograd.grad(model(x), x, grad_outputs=rows, is_grads_batched=True)[0]
    torch.testing.assert_close(got, expected, **EXACT)
    model(x).sum().backward()  # the model trains on after the refusal
    plain(x).sum().backward()
    assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_mode_ad_is_refused_with_a_graph_and_exact_without(device: str) -> None:
    plain, model = _pair(_mlp, device)
    x, tangent = torch.randn(2, 6, device=device), torch.randn(2, 6, device=device)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=r"OffloadModel: forward-mode AD(.|\n)*torch\.no_grad"):
        model(fwAD.make_dual(x, tangent))
    tangents = []
    for net in (plain, model):
        with torch.no_grad(), fwAD.dual_level():
            tangents.append(fwAD.unpack_dual(net(fwAD.make_dual(x, tangent))).tangent)
    torch.testing.assert_close(tangents[1], tangents[0], **EXACT)


@pytest.mark.parametrize("transform", ["vmap", "jvp"])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_transforms_are_refused_with_a_graph_and_vmap_is_exact_without(device: str, transform: str) -> None:
    plain, model = _pair(_mlp, device)
    x = torch.randn(3, 2, 6, device=device)
    transformed = (torch.func.vmap(model) if transform == "vmap"
                   else lambda inputs: torch.func.jvp(model, (inputs,), (torch.ones_like(inputs),)))
    with pytest.raises(RuntimeError, match=r"OffloadModel: torch\.func transforms"):
        transformed(x)
    with torch.no_grad():
        torch.testing.assert_close(torch.func.vmap(model)(x), torch.func.vmap(plain)(x), **EXACT)
