"""Grad modes and autograd features around the model's call that the plain model takes in its stride:
backward under ``torch.inference_mode()`` or ``torch.no_grad()``, ``torch.func.functional_call``
with fast weights (MAML) or under a ``torch.func`` transform, ``torch.compile(fullgraph=True)`` and
``disable_saved_tensors_hooks()``. Where the model runs, its gradients are the unwrapped model's bit
for bit; where it cannot, its error names OffloadModel and says what to do (Note: [Transforms the
walk refuses] in ``offload/autograd/refusals.py``)."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import disable_saved_tensors_hooks
from torch.func import functional_call

import offload
from offload import OffloadModel, OffloadOptimizer
from offload.autograd import refusals
from offload.model import EAGER_RUN_REASON

from .helpers import ACTIVATIONS, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def pair(**settings: Any) -> tuple[nn.Sequential, OffloadModel]:
    """The plain model and the offloaded one, from the same weights."""
    plain = network()
    return copy.deepcopy(plain), OffloadModel(plain, device="cpu", **settings)


def batch(seed: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))


def told(error: BaseException) -> str:
    """An error's message and notes (PEP 678) together, as the user reads them."""
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


def assert_trains_as_plain(plain: nn.Module, model: OffloadModel) -> None:
    """A plain training step after the case under test: the model was left as it was."""
    plain.zero_grad()
    model.zero_grad()
    x = batch(7)
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    assert_same_grads(model, plain, **EXACT)


# -- backward under another grad mode -----------------------------------------------------------


@pytest.mark.parametrize("activations", list(ACTIVATIONS))
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_backward_under_inference_mode_or_no_grad_gives_the_plain_models_gradients(mode, num_slices, activations):
    # Autograd runs the backward's nodes in the caller's mode; the walk's recompute and its watch
    # of the accumulation nodes work in inference mode too.
    plain, model = pair(num_slices=num_slices, **ACTIVATIONS[activations])
    entered = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    for step in range(2):  # the second adds onto the first's .grad
        want, got = plain(batch(step)).square().sum(), model(batch(step)).square().sum()
        with entered():
            want.backward()
            got.backward()
        assert_same_grads(model, plain, **EXACT)
    assert_trains_as_plain(plain, model)


# -- torch.func --------------------------------------------------------------------------------


@pytest.mark.parametrize("activations", list(ACTIVATIONS))
def test_functional_call_with_fast_weights_warns_nothing_and_gives_the_plain_models_gradients(activations):
    # MAML: the weights passed are functions of the parameters, not leaves; the model reads no
    # .grad of theirs (PyTorch warns on that), and their gradients reach the parameters through them.
    plain, model = pair(num_slices=2, **ACTIVATIONS[activations])
    x = batch(0)
    losses = []
    for module in (plain, model):
        fast = {name: p * 0.5 + 0.1 for name, p in module.named_parameters()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = functional_call(module, fast, (x,)).square().sum()
            loss.backward()
        assert not [w for w in caught if "leaf" in str(w.message)], [str(w.message) for w in caught]
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], **EXACT)
    assert_same_grads(model, plain, **EXACT)


def test_fast_weights_with_norms_in_backward_warn_nothing_and_train_as_plain():
    # The norms read as each slice's gradients land (after a first clip) skip the non-leaf
    # tensors functional_call passed: they have no .grad to clip, and reading it warns.
    plain, model = pair(num_slices=2)
    optimizers = (torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True),
                  OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, norms_in_backward=True))
    for step in range(3):
        norms = []
        for module, optimizer, clip in zip((plain, model), optimizers,
                                           (torch.nn.utils.clip_grad_norm_, offload.clip_grad_norm_)):
            optimizer.zero_grad()
            fast = {name: p * 0.5 + 0.1 for name, p in module.named_parameters()}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                functional_call(module, fast, (batch(step),)).square().sum().backward()
                norms.append(clip(list(module.parameters()), 1.0))
            assert not [w for w in caught if "leaf" in str(w.message)], [str(w.message) for w in caught]
            optimizer.step()
        torch.testing.assert_close(norms[1], norms[0], **EXACT)
    optimizers[1].synchronize()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.parametrize("transform", ["grad", "jacrev"])
def test_a_gradient_transform_over_functional_call_is_refused_with_what_to_do(transform):
    plain, model = pair(num_slices=2)
    x = batch(0)
    params = {name: p.detach() for name, p in model.named_parameters()}
    differentiate = getattr(torch.func, transform)
    with pytest.raises(RuntimeError) as raised:
        differentiate(lambda p: functional_call(model, p, (x,)).square().sum())(params)
    assert refusals.TRANSFORMED_TENSORS.format(name="0.weight") in told(raised.value)
    assert "torch.autograd.grad" in told(raised.value)
    assert_trains_as_plain(plain, model)  # refused before the layout was touched


def test_a_forward_mode_transform_over_the_parameters_is_refused_naming_it():
    plain, model = pair(num_slices=2)
    x = batch(0)
    params = {name: p.detach() for name, p in model.named_parameters()}
    tangents = {name: torch.ones_like(p) for name, p in params.items()}
    with torch.no_grad(), pytest.raises(RuntimeError) as raised:
        torch.func.jvp(lambda p: functional_call(model, p, (x,)), (params,), (tangents,))
    assert refusals.TRANSFORMED_TENSORS.format(name="0.weight") in told(raised.value)
    assert "jvp or jacfwd over them" in told(raised.value) and "need the plain model" in told(raised.value)
    assert_trains_as_plain(plain, model)


def test_vmap_over_stacked_parameters_is_refused_and_over_inputs_runs():
    plain, model = pair(num_slices=2)
    xs = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    stacked = {name: torch.stack([p.detach()] * 3) for name, p in model.named_parameters()}
    with torch.no_grad():
        with pytest.raises(RuntimeError) as raised:
            torch.func.vmap(lambda p, x: functional_call(model, p, (x,)))(stacked, xs)
        assert "OffloadModel: torch.func.functional_call" in told(raised.value)
        torch.testing.assert_close(torch.func.vmap(model)(xs), torch.func.vmap(plain)(xs), **EXACT)
    assert_trains_as_plain(plain, model)


def test_func_grad_over_the_input_gets_a_note_saying_what_to_use():
    _, model = pair(num_slices=2)
    with pytest.raises(RuntimeError) as raised:
        torch.func.grad(lambda x: model(x).square().sum())(batch(0))
    assert refusals.FUNC_GRADIENT_HOOKS in told(raised.value)


# -- torch.compile -----------------------------------------------------------------------------


@pytest.mark.skipif("reason" not in inspect.signature(torch.compiler.disable).parameters,
                    reason="torch.compiler.disable takes a reason from torch 2.8")
def test_compiling_the_wrapped_model_with_fullgraph_says_what_to_do():
    torch._dynamo.reset()
    _, model = pair(num_slices=2)
    with pytest.raises(Exception) as raised:
        torch.compile(model, fullgraph=True, backend="eager")(batch(0))
    assert EAGER_RUN_REASON in told(raised.value)


# -- saved-tensor hooks ------------------------------------------------------------------------


@pytest.mark.parametrize("activations", ["recompute", "kept"])
def test_a_forward_under_disable_saved_tensors_hooks_names_offload_model(activations):
    plain, model = pair(num_slices=2, **ACTIVATIONS[activations])
    x = batch(0)
    with disable_saved_tensors_hooks("my feature does not work with saved tensor hooks"):
        with pytest.raises(RuntimeError) as raised:
            model(x)
        with torch.no_grad():  # no graph: nothing saved, and the model runs
            torch.testing.assert_close(model(x), plain(x), **EXACT)
    assert "my feature does not work with saved tensor hooks" in told(raised.value)
    assert refusals.DISABLED_HOOKS in told(raised.value)
    # A backward inside the block runs as the plain model's does.
    want, got = plain(x).square().sum(), model(x).square().sum()
    with disable_saved_tensors_hooks("my feature does not work with saved tensor hooks"):
        want.backward()
        got.backward()
    assert_same_grads(model, plain, **EXACT)
