"""Hooks registered or removed between a forward and its backward (rule 7 of Note: [Attribute state]
in ``offload/walk/module_state.py``).

The plain model's backward differentiates the graph its forward built: a forward hook removed
before ``loss.backward()`` shaped that graph, one registered after it did not, and the full backward
hooks that run are those the layer's call found. A recomputed slice re-runs its layers in backward,
so it must run them with the hooks of the forward, not with those registered at backward time. The
reference is the plain model without checkpointing; gradients are compared bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import offload
from offload import OffloadModel

from .helpers import DEVICES, assert_same_grads, microbatched_reference

EXACT = {"rtol": 0.0, "atol": 0.0}

HOOKED = 2  # model[2]: in slice 1 of 3, which backward recomputes (the last one's graph is kept)


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def steer(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """A steering vector applied for one forward."""
    return output + 1.0


def shift(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (args[0] * 2.0,)


def halve(module: nn.Module, grad_input: Any, grad_output: Any) -> tuple[torch.Tensor, ...]:
    """A full backward hook that rescales the gradient reaching the layer's input."""
    return (grad_input[0] * 0.5,)


def halve_before(module: nn.Module, grad_output: Any) -> tuple[torch.Tensor, ...]:
    return (grad_output[0] * 0.5,)


REGISTER: dict[str, Callable[[nn.Module], Any]] = {
    "forward hook": lambda layer: layer.register_forward_hook(steer),
    "forward pre-hook": lambda layer: layer.register_forward_pre_hook(shift),
    "full backward hook": lambda layer: layer.register_full_backward_hook(halve),
    "full backward pre-hook": lambda layer: layer.register_full_backward_pre_hook(halve_before),
}


def hook_tables(module: nn.Module) -> dict[str, list[int]]:
    """The keys of a module's hook tables, copied."""
    return {name: list(getattr(module, name)) for name in ("_forward_pre_hooks", "_forward_hooks",
                                                           "_backward_pre_hooks", "_backward_hooks")}


def process_hook_tables() -> dict[str, list[int]]:
    return {name: list(getattr(torch_module, name)) for name in (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")}


def loss_with_hook(model: nn.Module, x: torch.Tensor, kind: str, when: str) -> torch.Tensor:
    """The loss of a forward, the hook on ``model[HOOKED]`` active in it and removed before backward
    (``removed``), or registered after it (``added``); in the second case it stays registered."""
    if when == "removed":
        handle = REGISTER[kind](model[HOOKED])
        loss = model(x).pow(2).sum()
        handle.remove()
    else:
        loss = model(x).pow(2).sum()
        REGISTER[kind](model[HOOKED])
    return loss


@pytest.mark.parametrize("when", ["removed", "added"])
@pytest.mark.parametrize("kind", list(REGISTER))
@pytest.mark.parametrize("device", DEVICES)
def test_a_recompute_runs_with_the_hooks_of_its_forward(device, kind, when):
    plain = layers()
    wrapped = copy.deepcopy(plain)
    model = OffloadModel(wrapped, device=device, num_slices=3)
    assert str(HOOKED) in model.partition[1] and len(model.partition) == 3
    x = torch.randn(5, 8)
    want = loss_with_hook(plain, x, kind, when)
    got = loss_with_hook(model, x.to(device), kind, when)
    torch.testing.assert_close(got.cpu(), want, **EXACT)
    want.backward()
    got.backward()
    assert_same_grads(wrapped, plain, **EXACT)
    # The hooks live after backward are those registered before it.
    counts = [[len(keys) for keys in hook_tables(layer[HOOKED]).values()] for layer in (wrapped, plain)]
    assert counts[0] == counts[1]


@pytest.mark.parametrize("when", ["removed", "added"])
def test_a_process_wide_forward_hook_changed_after_forward(when):
    plain = layers()
    wrapped = copy.deepcopy(plain)
    model = OffloadModel(wrapped, device="cpu", num_slices=3)
    x = torch.randn(5, 8)

    def doubling(module: nn.Module, args: Any, output: Any) -> Any:
        return output * 2.0 if isinstance(module, nn.Tanh) else None  # in every slice

    def backward_of(m: nn.Module) -> torch.Tensor:
        """The loss, its backward run; the hook registered and removed as ``when`` says."""
        handle = torch_module.register_module_forward_hook(doubling) if when == "removed" else None
        try:
            loss = m(x).pow(2).sum()
            if handle is not None:
                handle.remove()
            else:
                handle = torch_module.register_module_forward_hook(doubling)
            loss.backward()
        finally:
            handle.remove()
        return loss.detach()

    torch.testing.assert_close(backward_of(model), backward_of(plain), **EXACT)
    assert_same_grads(wrapped, plain, **EXACT)


class Refused(Exception):
    pass


def test_a_hook_that_raises_in_the_recompute_leaves_the_live_hooks_as_they_were():
    wrapped = layers()
    model = OffloadModel(wrapped, device="cpu", num_slices=3)

    def refuse_in_recompute(module: nn.Module, args: Any, output: Any) -> None:
        if offload.is_recomputing():
            raise Refused("in the recompute")

    handle = wrapped[HOOKED].register_forward_hook(refuse_in_recompute)
    loss = model(torch.randn(5, 8)).pow(2).sum()
    handle.remove()
    # Registered after forward: live at backward, left out of the recompute, live again after it.
    wrapped[HOOKED].register_forward_hook(steer)
    process_handle = torch_module.register_module_forward_hook(lambda module, args, output: None)
    try:
        live, live_process = hook_tables(wrapped[HOOKED]), process_hook_tables()
        with pytest.raises(Refused):
            loss.backward()
        assert hook_tables(wrapped[HOOKED]) == live
        assert process_hook_tables() == live_process
        assert next(iter(wrapped[HOOKED]._forward_hooks.values())) is steer
    finally:
        process_handle.remove()


@pytest.mark.parametrize("kind", ["forward hook", "full backward hook"])
def test_a_hook_removed_after_a_forward_of_several_microbatches(kind):
    plain = layers()
    wrapped = copy.deepcopy(plain)
    model = OffloadModel(wrapped, device="cpu", num_slices=3, num_microbatches=2)
    x = torch.randn(6, 8)
    handles = [REGISTER[kind](plain[HOOKED]), REGISTER[kind](wrapped[HOOKED])]
    want = microbatched_reference(plain, model.partition, x, 2)
    got = model(x)
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(got, want, **EXACT)
    want.pow(2).sum().backward()
    got.pow(2).sum().backward()
    assert_same_grads(wrapped, plain, **EXACT)


class Registrations:
    """What a layer has registered, kept in an object of its own (as ``RouterCapture`` keeps it): a
    change inside it is not layer state that a recompute restores (Note: [Attribute state])."""

    def __init__(self) -> None:
        self.done = False


class HooksItsLinear(nn.Module):
    """Registers a forward hook on its sublayer at its first call, once (as the router capture of
    Note: [Router logits] does): a re-run registers nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.registrations = Registrations()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.registrations.done:
            self.linear.register_forward_hook(steer)
            self.registrations.done = True
        return torch.tanh(self.linear(x))


class Once:
    """A forward hook that steers one call and then removes itself."""

    def __init__(self, layer: nn.Module) -> None:
        self.handle = layer.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        self.handle.remove()
        return output + 1.0


@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("change", ["registered by the run", "removed by the run"])
def test_hooks_the_run_itself_changes(change, num_microbatches):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), HooksItsLinear(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    wrapped = copy.deepcopy(plain)
    model = OffloadModel(wrapped, device="cpu", num_slices=3, num_microbatches=num_microbatches)
    assert {"0", "1"} <= {*model.partition[0], *model.partition[1]} and len(model.partition) == 3
    if change == "removed by the run":
        plain[1].registrations.done = wrapped[1].registrations.done = True  # none registered by the run
        Once(plain[1].linear), Once(wrapped[1].linear)
    x = torch.randn(6, 8)
    want = microbatched_reference(plain, model.partition, x, num_microbatches)
    got = model(x)
    torch.testing.assert_close(got, want, **EXACT)
    want.pow(2).sum().backward()
    got.pow(2).sum().backward()
    assert_same_grads(wrapped, plain, **EXACT)
    # After backward, the hooks registered are those of the plain model: the steering hook, or none.
    registered = 1 if change == "registered by the run" else 0
    assert len(wrapped[1].linear._forward_hooks) == len(plain[1].linear._forward_hooks) == registered
