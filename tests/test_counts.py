"""How often each slice runs and loads per training step: the recompute schedule is part of the spec."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from offload import OffloadModel
from offload.streams.slot_references import SlotReferences

from .helpers import DEVICES, HostStepped, run_state_lookups


class Counted(nn.Module):
    """A linear layer that counts its forward calls, recomputes included.

    The count lives one level down, in an object the recompute does not restore (a plain ``int``
    attribute is restored for the recompute: Note: [Attribute state]).
    """

    def __init__(self, width: int = 4):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.tally = SimpleNamespace(calls=0)

    @property
    def calls(self) -> int:
        return self.tally.calls

    def forward(self, x):
        self.tally.calls += 1
        return torch.tanh(self.linear(x))


def counted_model(num_layers: int) -> nn.Sequential:
    return nn.Sequential(*[Counted() for _ in range(num_layers)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_slices", [1, 2, 4])
@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("checkpoint", [True, False])
def test_forward_runs_per_slice_per_step(device, num_slices, num_microbatches, checkpoint):
    model = OffloadModel(counted_model(4), device=device, num_slices=num_slices,
                         num_microbatches=num_microbatches, checkpoint_activation=checkpoint)
    model(torch.randn(6, 4, device=device)).sum().backward()
    last_slice = set(model.partition[-1])
    for name, layer in model.named_children():
        if not checkpoint:
            expected = num_microbatches  # graphs kept: never recomputed
        elif name in last_slice:
            # The last microbatch of the last slice is resident at the turn: not recomputed.
            expected = num_microbatches + (num_microbatches - 1)
        else:
            expected = 2 * num_microbatches
        assert layer.calls == expected, f"layer {name}"


@pytest.mark.parametrize("num_slices", [1, 2, 3, 5])
def test_loads_per_step(num_slices):
    model = OffloadModel(counted_model(5), device="cpu", num_slices=num_slices)
    slots = model._engine.slots
    model(torch.randn(2, 4)).sum().backward()
    # Forward loads every slice; backward finds the last two still in their slots (two slots).
    resident = min(2, num_slices)
    assert slots.loads == num_slices + (num_slices - resident)
    # Every forward loads every slice again: see Note: [Device copies expire at the next forward].
    before = slots.loads
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert slots.loads - before == num_slices


@pytest.mark.parametrize("checkpoint", [True, False])
def test_binding_a_slice_without_8bit_layers_looks_up_no_run_state(monkeypatch, checkpoint):
    # Every load, forward and backward binds a slice; only an 8-bit weight carries a run state
    # (Note: [Quantized weights], rule 6), and its slice's layout says where, so a float slice's
    # binding looks at none of its entries for one.
    model = OffloadModel(counted_model(4), device="cpu", num_slices=2, num_microbatches=2,
                         checkpoint_activation=checkpoint)
    assert all(s.storage.run_state_positions == [] for s in model._engine.slices)
    looked_up = run_state_lookups(monkeypatch)
    model(torch.randn(6, 4)).sum().backward()
    with torch.no_grad():
        model(torch.randn(6, 4))
    assert looked_up == []


@pytest.mark.parametrize("device", DEVICES)
def test_updates_that_do_not_bump_versions_are_seen(device):
    """Fused optimizers and writes through .data leave p._version alone; the next forward must
    still use the new values (the slots hold the last two slices from the previous backward)."""
    torch.manual_seed(0)
    reference = counted_model(4).to(device)
    model = OffloadModel(copy.deepcopy(reference), device=device, num_slices=4)
    opt_ref = HostStepped(reference, lambda params: torch.optim.AdamW(params, lr=0.05, fused=True))
    opt_off = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for _ in range(3):
        x = torch.randn(3, 4, device=device)
        for net, opt in ((reference, opt_ref), (model, opt_off)):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            opt.step()
            for p in net.parameters():
                p.data.clamp_(-0.3, 0.3)
    with torch.no_grad():
        x = torch.randn(3, 4, device=device)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_unchanged_weights_never_travel_back():
    model = OffloadModel(counted_model(4), device="cpu", num_slices=4)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    engine = model._engine
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Offloads: gradients, and the boundary activations of slices 0, 1 and 2 (the input is on the
    # compute device, so its checkpoint goes to the host too; the last slice's graph is kept).
    # No parameter bytes.
    boundary_bytes = 3 * x.numel() * x.element_size()
    assert engine.gradients.offloaded_bytes == grad_bytes
    assert engine.activations.offloaded_bytes == boundary_bytes


class _OpLog(TorchDispatchMode):
    """Records every aten op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[torch._ops.OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_unpacking_a_kept_graph_allocates_nothing(monkeypatch):
    """Resolving a slot reference is pure view arithmetic. It once allocated a device scalar per
    unpack to learn an item size (defect 4 of issue 8): on CUDA an allocation and a kernel for
    every saved tensor of every kept graph."""
    seen: list[tuple[str, list[torch._ops.OpOverload]]] = []
    original = SlotReferences._unpack

    def logged_unpack(self, packed):
        with _OpLog() as log:
            tensor = original(self, packed)
        seen.append((type(packed).__name__, log.ops))
        return tensor

    # Patched before forward: the hooks bind the method when the graph is saved.
    monkeypatch.setattr(SlotReferences, "_unpack", logged_unpack)
    model = OffloadModel(counted_model(4), device="cpu", num_slices=2, checkpoint_activation=False)
    model(torch.randn(3, 4, dtype=torch.float32)).sum().backward()
    references = [ops for kind, ops in seen if kind == "SlotReference"]
    assert references, "the kept graphs saved no slot tensor: the test no longer reaches _unpack's slot path"
    not_views = sorted({str(op) for ops in references for op in ops if not op.is_view})
    assert not_views == []
