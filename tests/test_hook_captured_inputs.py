"""What a forward hook captures inside the model (a slice's input, a layer's input or output, what a
layer's own saved-tensor hooks keep), as feature extraction and activation statistics read it: the
plain model's values bit for bit under every way of keeping activations, after forward and after
backward, and usable in a second loss. An offloaded graph drops its boundary leaves' data after the
run and must still free what it frees (Note: [Offloaded graph leaves] in
``offload/autograd/records.py``)."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import offload
from offload import OffloadActivations, OffloadModel
from offload.autograd.records import KeptGraph, OffloadedGraph

from .helpers import ACTIVATIONS, assert_same_grads

# The steps after a refusal take plain torch.optim.SGD, as the promise says.
pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

EXACT = {"rtol": 0.0, "atol": 0.0}
# Slices ("0", "1"), ("2", "3"), ("4", "5"), ("6", "7") with num_slices=4.
FIRST_LAYERS = (0, 2, 4, 6)


class Broadcast(nn.Module):
    """Hands on its first row broadcast to every row: a boundary activation whose elements overlap,
    which enters the next slice as a view of its leaf (Note: [Leaves enter through a copy])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)[:1].expand(x.shape)


def network(overlapping: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [layer for _ in range(4) for layer in (nn.Linear(8, 8), nn.Tanh())]
    if overlapping:
        layers[3] = Broadcast()
    return nn.Sequential(*layers)


def inputs(requires_grad: bool = True) -> torch.Tensor:
    return torch.linspace(-2.0, 2.0, 32).reshape(4, 8).requires_grad_(requires_grad)


class Captures:
    """What hooks on every layer see in forward (a recompute's runs are the walk's, not the user's)."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        self.handles = []
        for index, layer in enumerate(model):
            self.handles.append(layer.register_forward_pre_hook(self._pre(f"pre {index}")))
            self.handles.append(layer.register_forward_hook(self._post(index)))

    def _pre(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not offload.is_recomputing():
                self.seen[name] = args[0]
        return hook

    def _post(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            if not offload.is_recomputing():
                self.seen[f"input {index}"] = args[0]
                self.seen[f"output {index}"] = output
        return hook

    def values(self) -> dict[str, torch.Tensor]:
        """Copies of what was seen, read now."""
        return {name: tensor.detach().clone() for name, tensor in self.seen.items()}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def assert_same_values(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, msg=lambda m: f"{name}: {m}", **EXACT)


def statistics_loss(model: nn.Module, seen: dict[str, torch.Tensor]) -> torch.Tensor:
    """A second loss on the captured tensors as constants (feature matching against the first step's
    activations), through a second forward of the model."""
    target = torch.stack([t.detach().mean(0) for name, t in sorted(seen.items()) if name.startswith("pre")])
    return (model(inputs().flip(0)).mean(0) - target.mean(0)).pow(2).sum()


@pytest.mark.parametrize("overlapping", [False, True], ids=["dense", "overlapping"])
@pytest.mark.parametrize("setting", sorted(ACTIVATIONS))
def test_hooks_see_the_plain_models_values_after_forward_and_backward(setting, overlapping):
    # An offloaded graph dropped the data of its boundary leaves after the run; what the hooks hold
    # must be what the plain model's hooks hold, then and after backward, and serve a second loss.
    plain = network(overlapping)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4, **ACTIVATIONS[setting])
    assert [names[0] for names in model.partition] == [str(i) for i in FIRST_LAYERS]
    results = []
    for net in (plain, model):
        captures = Captures(net)
        x = inputs()
        output = net(x)
        after_forward = captures.values()
        output.pow(2).sum().backward()
        after_backward = captures.values()
        captures.remove()
        statistics = {name: (t.mean(), t.var(), t.abs().amax(0)) for name, t in captures.seen.items()}
        statistics_loss(net, captures.seen).backward()
        results.append((after_forward, after_backward, statistics, x.grad))
    (want_forward, want_backward, want_statistics, want_x_grad), (got_forward, got_backward, got_statistics,
                                                                    got_x_grad) = results
    assert_same_values(got_forward, want_forward)
    assert_same_values(got_backward, want_backward)
    assert_same_values(got_backward, got_forward)
    for name, expected in want_statistics.items():
        torch.testing.assert_close(got_statistics[name], expected, msg=lambda m: f"{name}: {m}", **EXACT)
    torch.testing.assert_close(got_x_grad, want_x_grad, **EXACT)
    assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("setting", sorted(ACTIVATIONS))
def test_the_callers_input_is_never_emptied(setting, requires_grad):
    model = OffloadModel(network(), device="cpu", num_slices=4, **ACTIVATIONS[setting])
    x = inputs(requires_grad)
    before = x.detach().clone()
    output = model(x)
    torch.testing.assert_close(x.detach(), before, **EXACT)
    output.sum().backward()
    assert x.untyped_storage().nbytes() == before.untyped_storage().nbytes()
    torch.testing.assert_close(x.detach(), before, **EXACT)


class SavesThroughHooks(nn.Linear):
    """A layer that keeps the activations autograd saves in its forward through hooks of its own
    (user code, innermost, so they win over the model's)."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.packed: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            return torch.tanh(super().forward(x))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Its own weight is saved too: the slice's device copy, not the activations this file is about.
        if not offload.is_recomputing() and tensor.shape != self.weight.shape:
            self.packed.append(tensor)
        return tensor


@pytest.mark.parametrize("setting", sorted(ACTIVATIONS))
def test_a_layers_own_saved_tensor_hooks_keep_the_plain_models_activations(setting):
    torch.manual_seed(0)
    plain = nn.Sequential(*[SavesThroughHooks() for _ in range(4)])
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4, **ACTIVATIONS[setting])
    for net in (plain, model):
        net(inputs()).pow(2).sum().backward()
    for index, (want, got) in enumerate(zip(plain, model)):
        assert len(got.packed) == len(want.packed) == 2, f"layer {index}"  # the linear's input, tanh's output
        for k, (g, w) in enumerate(zip(got.packed, want.packed)):
            torch.testing.assert_close(g.detach(), w.detach(), msg=lambda m: f"layer {index}, tensor {k}: {m}",
                                       **EXACT)
    assert_same_grads(model, plain, **EXACT)


OFFLOADED = sorted(name for name in ACTIVATIONS if name.startswith("offload"))


@pytest.mark.parametrize("overlapping", [False, True], ids=["dense", "overlapping"])
@pytest.mark.parametrize("setting", OFFLOADED)
def test_a_captured_slice_input_in_the_loss_is_refused_saying_what_to_do(setting, overlapping):
    # An offloaded slice's leaf kept its data as a tensor of size 0, and the refusal of Note:
    # [Activations used outside the model] never came: autograd failed first adding the term's
    # gradient into it ("The size of tensor a (0) must match the size of tensor b (8)").
    plain = network(overlapping)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4, **ACTIVATIONS[setting])
    assert model.partition[2][0] == "4"  # offloaded in both settings (the last slice keeps its graph)
    captures = Captures(model)
    loss = model(inputs()).pow(2).mean() + captures.seen["pre 4"].pow(2).mean()
    captures.remove()
    with pytest.raises(RuntimeError, match=r"^OffloadModel: a backward from outside the model reached the graph "
                       r"slice 2 built in forward .*Return the activation from the model as part of its output "
                       r"instead"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())  # refused before the walk's backward added any
    # The model trains on as the plain one does, with plain torch.optim.
    del loss
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for net, opt in ((plain, plain_optimizer), (model, optimizer)):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
        assert_same_grads(model, plain, **EXACT)
        plain_optimizer.step()
        optimizer.step()
    for (name, expected), got in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, expected, msg=lambda m: f"{name}: {m}", **EXACT)


def test_an_offloaded_graph_keeps_no_slice_input_after_forward():
    # What the records hold of an offloaded run's boundary leaves is one element each, and the
    # slices' inputs are freed with their boundaries; a captured input is held by its hook alone.
    model = OffloadModel(network(), device="cpu", num_slices=4,
                         offload_activations=OffloadActivations(last=4, min_bytes=0))
    boundaries: list[StorageWeakRef] = []  # the memory slices 1, 2 and 3 start from
    for index in (1, 3, 5):
        model[index].register_forward_hook(
            lambda module, args, out: boundaries.append(StorageWeakRef(out.untyped_storage())))
    captured: list[torch.Tensor] = []
    model[4].register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    output = model(inputs())
    records = output.grad_fn.run.records
    assert [type(row[0]) for row in records.grid] == [OffloadedGraph] * 3 + [KeptGraph]
    for i, (record,) in enumerate(records.grid[:3]):
        for leaf in record.inputs:
            assert leaf.untyped_storage().nbytes() <= leaf.element_size(), f"slice {i} keeps its input's data"
    gc.collect()
    # Slices 1 and 2 are offloaded; the last keeps its graph, and its input with it.
    assert [ref.expired() for ref in boundaries] == [True, True, False]
    seen = StorageWeakRef(captured[0].untyped_storage())
    assert captured[0].shape == (4, 8)
    captured.clear()
    gc.collect()
    assert seen.expired()
    output.sum().backward()


@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_a_weight_a_hook_keeps_is_the_plain_weight_when_cloned(checkpoint_activation):
    # docs/api.md, "Hooks": inside its slice's run a layer's weight is the device copy, in a slot
    # that later slices load into; the clone a hook keeps holds the layer's own values.
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4,
                         checkpoint_activation=checkpoint_activation)
    kept: dict[int, torch.Tensor] = {}
    parameters = {index: model[index].weight for index in FIRST_LAYERS}

    def keep(index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            kept.setdefault(index, module.weight.detach().clone())
        return hook
    for index in FIRST_LAYERS:
        model[index].register_forward_hook(keep(index))
    model(inputs()).sum().backward()
    for index in FIRST_LAYERS:
        assert torch.equal(kept[index], plain[index].weight)
        assert model[index].weight is parameters[index]  # the parameter again after the call
