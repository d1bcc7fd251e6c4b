"""An exception inside a layer (the stand-in for device out-of-memory) propagates unchanged, leaves
the host parameters and gradients intact (but what a backward added onto earlier gradients before it
failed, which its error says), and the next ordinary step succeeds."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from offload import OffloadModel

from .helpers import DEVICES, assert_same_grads, clone_model


class SimulatedOutOfMemory(RuntimeError):
    pass


class Faulty(nn.Module):
    """A linear layer that raises on chosen forward calls, or in its backward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        # Held one level down, where the recompute does not restore them (Note: [Attribute state]):
        # the count includes recomputes, and a plan set between forward and backward holds there.
        self.plan = SimpleNamespace(calls=0, fail_on_calls=set())
        self.fail_in_backward = False

    @property
    def calls(self) -> int:
        return self.plan.calls

    @property
    def fail_on_calls(self) -> set[int]:
        return self.plan.fail_on_calls

    @fail_on_calls.setter
    def fail_on_calls(self, calls: set[int]) -> None:
        self.plan.fail_on_calls = calls

    def forward(self, x):
        self.plan.calls += 1
        if self.calls in self.fail_on_calls:
            raise SimulatedOutOfMemory("CUDA out of memory (simulated)")
        y = self.linear(x)
        return _RaiseInBackward.apply(y) if self.fail_in_backward else y


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise SimulatedOutOfMemory("CUDA out of memory in backward (simulated)")


def build(device: str, faulty_position: int):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)]
    layers.insert(faulty_position, Faulty())
    reference = nn.Sequential(*layers).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=4)
    # Position 6 lands in the last slice, whose graph is kept rather than recomputed.
    assert (str(faulty_position) in model.partition[-1]) == (faulty_position == 6)
    return reference, model


def host_state(model: nn.Module):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()})


def assert_intact(model: nn.Module, state) -> None:
    values, grads = state
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[k]), f"{k} changed"
    for n, p in model.named_parameters():
        if grads[n] is None:
            assert p.grad is None, f"{n} got a gradient"
        else:
            assert torch.equal(p.grad, grads[n]), f"{n}.grad changed"


def assert_nothing_stashed(model: OffloadModel) -> None:
    # Gradients the user holds as .grad keep their host buffers; everything else must be released.
    for p in model.parameters():
        p.grad = None
    gc.collect()
    engine = model._engine
    assert not any(slot.in_use for slot in engine.slots._slots)
    for buffers in engine.pool._buffers.values():
        assert all(b.is_idle() for b in buffers)


def assert_recovered(model, reference, state, device, notes=None) -> None:
    """After the fault: nothing changed on the host, nothing is held, and training goes on. With
    ``notes`` (the error's, from a backward that added gradients onto earlier ones before it failed:
    Note: [Adding onto earlier gradients]) the gradients may hold part of that backward, and the
    error says so."""
    if notes is not None:
        values, grads = state
        assert any("onto those of earlier backwards" in note and "run the accumulation again" in note
                   for note in notes), "the error does not say the gradients changed"
        state = values, {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_intact(model, state)
    assert_nothing_stashed(model)
    next_step_matches(model, reference, device)


def first_backward(model, device, grads: str) -> None:
    """A good step first: .grad exists, zeroed (a failed backward undoes exactly what it added) or
    holding that step's gradients (the next backward adds onto them as slices land)."""
    model(torch.randn(5, 4, device=device)).sum().backward()
    if grads == "zeroed":
        model.zero_grad(set_to_none=False)


def next_step_matches(model, reference, device):
    for net in (model, reference):
        for p in net.parameters():
            p.grad = None
    x = torch.randn(5, 4, device=device)
    model(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    assert_same_grads(model, reference, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("faulty_position", [0, 3, 6])
def test_fault_in_forward(device, faulty_position):
    reference, model = build(device, faulty_position)
    model(torch.randn(5, 4, device=device)).sum().backward()  # a good step first: .grad exists
    reference(torch.randn(5, 4, device=device))
    state = host_state(model)
    faulty = model._modules[str(faulty_position)]
    faulty.fail_on_calls = {faulty.calls + 1}
    with pytest.raises(SimulatedOutOfMemory, match="simulated"):
        model(torch.randn(5, 4, device=device))
    assert_recovered(model, reference, state, device)


@pytest.mark.parametrize("grads", ["zeroed", "accumulating"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("faulty_position", [0, 3])
def test_fault_during_recompute(device, faulty_position, grads):
    reference, model = build(device, faulty_position)
    first_backward(model, device, grads)
    state = host_state(model)
    faulty = model._modules[str(faulty_position)]
    loss = model(torch.randn(5, 4, device=device)).sum()
    faulty.fail_on_calls = {faulty.calls + 1}  # the recompute in backward
    with pytest.raises(SimulatedOutOfMemory, match="simulated") as failed:
        loss.backward()
    del loss
    # A fault in slice 0 comes after the later slices' gradients were added onto the earlier ones.
    added = grads == "accumulating" and faulty_position == 0
    notes = list(getattr(failed.value, "__notes__", ())) if added else None
    del failed  # its traceback holds the failed backward's tensors
    assert_recovered(model, reference, state, device, notes)


@pytest.mark.parametrize("grads", ["zeroed", "accumulating"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("faulty_position", [0, 6])
def test_fault_inside_a_layers_backward(device, faulty_position, grads):
    reference, model = build(device, faulty_position)
    first_backward(model, device, grads)
    state = host_state(model)
    faulty = model._modules[str(faulty_position)]
    faulty.fail_in_backward = True
    loss = model(torch.randn(5, 4, device=device)).sum()
    with pytest.raises(SimulatedOutOfMemory, match="in backward") as failed:
        loss.backward()
    del loss
    faulty.fail_in_backward = False
    added = grads == "accumulating" and faulty_position == 0
    notes = list(getattr(failed.value, "__notes__", ())) if added else None
    del failed  # its traceback holds the failed backward's tensors
    assert_recovered(model, reference, state, device, notes)


@pytest.mark.parametrize("grad", [True, False])
def test_a_failed_forward_leaves_running_statistics_as_the_plain_model_does(grad):
    """Layers before the failing one have updated their statistics, the rest have not."""
    torch.manual_seed(0)
    slices = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
              nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Faulty(), nn.BatchNorm1d(4)),
              nn.Sequential(nn.Linear(4, 1))]
    plain = nn.Sequential(*clone_model(nn.ModuleList(slices)))
    model = OffloadModel(slices, device="cpu")
    x = torch.randn(8, 4)
    for net in (plain, model):
        net.get_submodule("1.2").fail_on_calls = {1}
        with torch.set_grad_enabled(grad), pytest.raises(SimulatedOutOfMemory):
            net(x)
    for (name, b_off), b_ref in zip(model.named_buffers(), plain.buffers()):
        torch.testing.assert_close(b_off, b_ref, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
