"""Forward-mode AD around and inside the model, and the caller's saved-tensor hooks.

Tangents on the parameters (dual tensors through ``torch.func.functional_call``) are refused in
every mode, never dropped (rule 2 of Note: [Transforms the walk refuses] in
``offload/autograd/refusals.py``); a layer that uses ``torch.autograd.forward_ad`` or
``torch.func.jvp`` itself computes as in the plain model in every activation mode (Note:
[Forward-mode AD inside a layer] in ``offload/autograd/function.py``, rule 2 of Note: [Offloaded
saved tensors] in ``offload/streams/saved_activations.py``); the caller's saved-tensor hooks see
none of the walk's graphs, in backward either, and ``allow_mutation_on_saved_tensors()`` works
(Note: [The caller's saved-tensor hooks] in ``offload/autograd/function.py``).

Everything in float64 on the CPU, compared with the unwrapped model bit for bit: with several
microbatches, with the plain model run chunk by chunk.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn
from torch.autograd.graph import allow_mutation_on_saved_tensors, disable_saved_tensors_hooks, saved_tensors_hooks
from torch.func import functional_call

import offload
from offload import OffloadActivations, OffloadModel

from .helpers import ACTIVATIONS, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}

#: The activation modes, and an offloaded one that keeps its small saves where they are (the
#: default ``min_bytes``: this test's tensors are all small).
MODES = {**ACTIVATIONS, "offload_small_kept": {"offload_activations": OffloadActivations(last=1_000)}}


#: ``(recomputing, forward-mode AD on)`` for each run of a :class:`DualInside`; not an attribute,
#: which the recompute would put back as it was (Note: [Attribute state]).
SWITCH: list[tuple[bool, bool]] = []


class DualInside(nn.Module):
    """A layer with a Jacobian-vector term of its own, by ``torch.autograd.forward_ad``; records
    whether forward-mode AD was on for each run in :data:`SWITCH`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SWITCH.append((offload.is_recomputing(), torch._C._is_fwd_grad_enabled()))
        with forward_ad.dual_level():
            y = forward_ad.unpack_dual(torch.sigmoid(self.linear(forward_ad.make_dual(x, torch.ones_like(x)))))
            # Without forward-mode AD the tangent is None: a zero term, another output.
            term = y.tangent if y.tangent is not None else torch.zeros_like(y.primal)
            return y.primal + 0.1 * term


class JvpInside(nn.Module):
    """A layer with a Jacobian-vector term of its own, by ``torch.func.jvp``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, term = torch.func.jvp(lambda z: torch.tanh(self.linear(z)), (x,), (torch.ones_like(x),))
        return y + 0.1 * term


def network(inner: type[nn.Module] | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    middle = [inner()] if inner is not None else [nn.Linear(7, 7)]
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), *middle, nn.Sigmoid(), nn.Linear(7, 3)).double()


def pair(inner: type[nn.Module] | None = None, **settings: Any) -> tuple[nn.Sequential, OffloadModel]:
    """The plain model and the offloaded one, from the same weights."""
    plain = network(inner)
    return copy.deepcopy(plain), OffloadModel(plain, device="cpu", num_slices=3, **settings)


def batch(seed: int) -> torch.Tensor:
    return torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def chunked(plain: nn.Module, x: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """The plain model's output as the offloaded one computes it: microbatch by microbatch."""
    return torch.cat([plain(chunk) for chunk in torch.tensor_split(x, num_microbatches)])


def assert_trains_as_plain(plain: nn.Module, model: OffloadModel) -> None:
    """A plain training step after the case under test: the model was left as it was."""
    plain.zero_grad()
    model.zero_grad()
    x = batch(7)
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    assert_same_grads(model, plain, **EXACT)


# -- tangents on the parameters ---------------------------------------------------------------------


def _dual_parameters(model: nn.Module, requires_grad: bool = False) -> dict[str, torch.Tensor]:
    tangents = torch.Generator().manual_seed(3)
    return {name: forward_ad.make_dual(p.detach().clone().requires_grad_(requires_grad),
                                       torch.randn(p.shape, dtype=p.dtype, generator=tangents))
            for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["no_grad", "grad_mode_nothing_requires_grad", "dual_input_too", "requires_grad"])
def test_tangents_on_the_parameters_are_refused_not_dropped(case):
    # The plain model's output carries the tangent; before the refusal OffloadModel's carried
    # None, or only the input's share, silently.
    plain, model = pair()
    x, input_tangent = batch(1), batch(2)
    with forward_ad.dual_level():
        inputs = (forward_ad.make_dual(x, input_tangent),) if case == "dual_input_too" else (x,)
        grad = torch.no_grad() if case in ("no_grad", "dual_input_too") else torch.enable_grad()
        with grad:
            expected = forward_ad.unpack_dual(
                functional_call(plain, _dual_parameters(plain, case == "requires_grad"), inputs)).tangent
            assert expected is not None
            with pytest.raises(RuntimeError, match="forward-mode AD with respect to the model's parameters") as error:
                functional_call(model, _dual_parameters(model, case == "requires_grad"), inputs)
    assert "0.weight carries a tangent" in str(error.value)
    assert_trains_as_plain(plain, model)


def test_one_parameter_with_a_tangent_is_named():
    plain, model = pair()
    with forward_ad.dual_level(), torch.no_grad():
        params = {name: p.detach() for name, p in model.named_parameters()}
        params["4.bias"] = forward_ad.make_dual(params["4.bias"], torch.ones_like(params["4.bias"]))
        with pytest.raises(RuntimeError, match=r"4\.bias carries a tangent"):
            functional_call(model, params, (batch(1),))
    assert_trains_as_plain(plain, model)


def test_input_tangents_while_building_a_graph_are_refused_with_advice_for_the_input_only():
    _, model = pair()
    with forward_ad.dual_level():
        with pytest.raises(RuntimeError, match="for tangents on the model's input") as error:
            model(forward_ad.make_dual(batch(1).requires_grad_(), batch(2)))
    assert "tangents on the parameters are refused in every mode" in str(error.value)


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_input_tangents_without_a_graph_still_go_through(num_microbatches):
    plain, model = pair(num_microbatches=num_microbatches)
    x, tangent = batch(1), batch(2)
    with forward_ad.dual_level(), torch.no_grad():
        expected = forward_ad.unpack_dual(chunked(plain, forward_ad.make_dual(x, tangent), num_microbatches))
        got = forward_ad.unpack_dual(model(forward_ad.make_dual(x, tangent)))
    torch.testing.assert_close(got.primal, expected.primal, **EXACT)
    torch.testing.assert_close(got.tangent, expected.tangent, **EXACT)


# -- forward-mode AD inside a layer -----------------------------------------------------------------


def _train_step_matches(plain: nn.Module, model: OffloadModel, num_microbatches: int) -> None:
    x0 = batch(1)
    x_plain, x_model = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    expected, got = chunked(plain, x_plain, num_microbatches), model(x_model)
    torch.testing.assert_close(got, expected, **EXACT)
    expected.square().sum().backward()
    got.square().sum().backward()
    assert_same_grads(model, plain, **EXACT)
    torch.testing.assert_close(x_model.grad, x_plain.grad, **EXACT)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_layer_using_forward_ad_computes_as_in_the_plain_model(mode, num_microbatches):
    # PyTorch runs a Function's forward with forward-mode AD off: the layer got no tangent in
    # forward (another output) and one in the recompute (another gradient).
    plain, model = pair(DualInside, num_microbatches=num_microbatches, **MODES[mode])
    SWITCH.clear()
    _train_step_matches(plain, model, num_microbatches)
    assert SWITCH and all(on for _, on in SWITCH), SWITCH
    if mode == "recompute":
        assert any(recomputing for recomputing, _ in SWITCH)  # the recompute saw it too


def test_a_layer_using_forward_ad_sees_the_callers_switch():
    plain, model = pair(DualInside)
    SWITCH.clear()
    with forward_ad._set_fwd_grad_enabled(False):
        _train_step_matches(plain, model, 1)
    # The plain model's run, then the offloaded one's forward and its recompute.
    assert SWITCH == [(False, False), (False, False), (True, False)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_layer_using_func_jvp_computes_as_in_the_plain_model(mode, num_microbatches):
    # An offloaded slice's saves include forward-mode AD's zero tangents, which have no memory to
    # copy: they stay where they are.
    plain, model = pair(JvpInside, num_microbatches=num_microbatches, **MODES[mode])
    _train_step_matches(plain, model, num_microbatches)


# -- the caller's saved-tensor hooks ----------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_hooks_around_backward_see_nothing_of_the_walk(mode, num_microbatches):
    # The plain model's backward packs nothing; a recompute packed its saves through the caller's
    # hooks, and a lossy pack (float64 to float32) changed the gradients.
    plain, model = pair(num_microbatches=num_microbatches, **MODES[mode])
    x = batch(1)
    packed: list[tuple[int, ...]] = []

    def lossy(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t.float()

    losses = [chunked(plain, x, num_microbatches).square().sum(), model(x).square().sum()]
    with saved_tensors_hooks(lossy, lambda t: t.double()):
        for loss in losses:
            loss.backward()
    assert packed == []
    assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("mode", list(MODES))
def test_backward_inside_disable_saved_tensors_hooks(mode):
    plain, model = pair(**MODES[mode])
    x = batch(1)
    losses = [plain(x).square().sum(), model(x).square().sum()]
    with disable_saved_tensors_hooks("no hooks here"):
        for loss in losses:
            loss.backward()
    assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_allow_mutation_on_saved_tensors_lets_the_input_change_before_backward(mode, num_microbatches,
                                                                                input_requires_grad):
    # A kept graph saved the caller's input itself, out of sight of the block's hooks, and refused
    # backward as changed in place; the plain model's autograd clones it before the change, and
    # gives the gradients of the unchanged input. (Not the plain model run chunk by chunk inside the
    # block: its chunks are views, which PyTorch does not clone, and it gets other gradients.)
    plain, model = pair(num_microbatches=num_microbatches, **MODES[mode])
    x_plain = batch(1).requires_grad_(input_requires_grad)
    chunked(plain, x_plain, num_microbatches).square().sum().backward()
    x = batch(1).requires_grad_(input_requires_grad)
    with allow_mutation_on_saved_tensors():
        out = model(x)
        with torch.no_grad():
            x.mul_(2.0)  # the batch's buffer reused for the next one
        out.square().sum().backward()
    assert_same_grads(model, plain, **EXACT)
    if input_requires_grad:
        torch.testing.assert_close(x.grad, x_plain.grad, **EXACT)


# -- double backward ---------------------------------------------------------------------------------


def test_autograd_functional_jvp_is_refused_pointing_to_func_jvp_without_a_graph():
    plain, model = pair()
    x, v = batch(1), batch(2)
    with pytest.raises(RuntimeError, match=r"torch\.autograd\.functional\.jvp") as error:
        torch.autograd.functional.jvp(model, x, v)
    assert "torch.func.jvp" in str(error.value) and "torch.no_grad()" in str(error.value)
    with torch.no_grad():  # what the message says to do
        expected = torch.func.jvp(plain, (x,), (v,))
        got = torch.func.jvp(model, (x,), (v,))
    torch.testing.assert_close(got, expected, **EXACT)
