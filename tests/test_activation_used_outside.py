"""An activation made inside the model and used outside it: a forward hook (or pre-hook) on an inner
layer keeps the tensor it sees and the loss adds a term on it (deep supervision, feature matching,
a perceptual loss). In the plain model that term's gradient reaches the layers before; here it
cannot, so backward refuses with a message that names the cause and says to return the activation
from the model instead, and leaves the model to train on as the plain one does (docs/api.md,
"Gradients of activations"; Note: [Activations used outside the model] in
``offload/autograd/slice_graph.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
from offload import OffloadModel

from .helpers import ACTIVATIONS

# The steps after a refusal take plain torch.optim.SGD, as the promise says.
pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

EXACT = {"rtol": 0.0, "atol": 0.0}
SETTINGS = {
    "recompute": {**ACTIVATIONS["recompute"]},
    "kept": {**ACTIVATIONS["kept"]},
    "microbatches": {**ACTIVATIONS["recompute"], "num_microbatches": 2},
}
# What each way of keeping activations says when the captured tensor is a layer's output (rule 2).
SAID = {
    "recompute": r"^OffloadModel: a layer in slice {index} saved tensors for backward, which the slice's "
                 r"checkpointed forward does not keep",
    "kept": r"^OffloadModel: autograd reached slice {index}'s kept graph while the slice was not on the device",
    "microbatches": r"^OffloadModel: a layer in slice {index} saved tensors for backward",
}
CAUSE = (r".*\. Most likely an activation made inside the OffloadModel was used outside it: captured by a forward "
         r"hook .*return the activation from the model as part of its output instead")


def network() -> nn.Sequential:
    # Slices ("0", "1"), ("2", "3"), ("4", "5"), ("6", "7") with num_slices=4.
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(8, 8), nn.Tanh())])


def capture(model: nn.Module, index: int, kind: str) -> tuple[list[torch.Tensor], object]:
    """What layer ``index`` sees (``"input"``, a pre-hook) or makes (``"output"``), in forward only."""
    seen: list[torch.Tensor] = []
    if kind == "input":
        handle = model[index].register_forward_pre_hook(
            lambda module, args: None if offload.is_recomputing() else seen.append(args[0]))
    else:
        handle = model[index].register_forward_hook(
            lambda module, args, output: None if offload.is_recomputing() else seen.append(output))
    return seen, handle


def loss_with_captured_term(model: nn.Module, index: int, kind: str, x: torch.Tensor) -> torch.Tensor:
    seen, handle = capture(model, index, kind)
    try:
        output = model(x)
    finally:
        handle.remove()
    return output.pow(2).mean() + torch.cat(seen).pow(2).mean()


def reference(plain: nn.Sequential, setting: str) -> nn.Module:
    """What the refused model must train as from then on: the plain model, or with microbatches
    (which round otherwise) a twin that never saw the refusal."""
    if "num_microbatches" not in SETTINGS[setting]:
        return copy.deepcopy(plain)
    return OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4, **SETTINGS[setting])


def assert_trains_as(model: OffloadModel, expected_model: nn.Module, steps: int = 2) -> None:
    """``zero_grad`` and the next steps, with plain ``torch.optim``, give ``expected_model``'s bits."""
    expected_optimizer = torch.optim.SGD(expected_model.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.zero_grad()
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        expected_loss = expected_model(x).pow(2).sum()
        expected_loss.backward()
        loss = model(x).pow(2).sum()
        loss.backward()
        torch.testing.assert_close(loss, expected_loss, **EXACT)
        for (name, expected), got in zip(expected_model.named_parameters(), model.parameters()):
            torch.testing.assert_close(got.grad, expected.grad, msg=lambda m: f"{name}: {m}", **EXACT)
        expected_optimizer.step()
        optimizer.step()
        expected_optimizer.zero_grad()
        optimizer.zero_grad()
    for (name, expected), got in zip(expected_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, expected, msg=lambda m: f"{name}: {m}", **EXACT)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("layer", [2, 4, 6])
def test_a_slice_input_used_outside_the_model_is_refused(setting, layer):
    # A pre-hook on slice k's first layer sees slice k's boundary input. Before the refusal its
    # term's gradient stopped there: the layers before got wrong gradients, and nothing raised.
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4, **SETTINGS[setting])
    assert model.partition[layer // 2][0] == str(layer)
    x = torch.randn(4, 8)
    loss = loss_with_captured_term(model, layer, "input", x)
    with pytest.raises(RuntimeError, match=rf"^OffloadModel: a backward from outside the model reached the graph "
                       rf"slice {layer // 2} built in forward .*Return the activation from the model as part of "
                       r"its output instead"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())  # refused before the walk's backward added any
    assert_trains_as(model, reference(plain, setting))


@pytest.mark.parametrize("setting", ["recompute", "kept"])
def test_a_perceptual_loss_on_a_slice_input_is_refused_not_left_without_an_input_gradient(setting):
    # A frozen feature extractor, the loss on a feature a pre-hook takes, the gradient wanted for
    # the input: it used to come back None.
    plain = network().requires_grad_(False)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4, **SETTINGS[setting])
    x = torch.randn(4, 8, requires_grad=True)
    seen, handle = capture(plain, 4, "input")
    plain(x)
    seen[0].pow(2).sum().backward()
    handle.remove()
    assert x.grad is not None and x.grad.abs().max() > 0  # what the plain model gives
    x.grad = None
    seen, handle = capture(model, 4, "input")
    model(x)
    handle.remove()
    with pytest.raises(RuntimeError, match=r"^OffloadModel: a backward from outside the model reached the graph "
                       r"slice 2 built in forward"):
        seen[0].pow(2).sum().backward()
    assert x.grad is None


def test_a_first_layer_output_reaching_a_parameter_leaf_is_refused_with_the_same_message():
    # Slice 0 keeps its graph and its input needs no gradient: the branch reaches the run's weight
    # leaf without unpacking a slot tensor. PyTorch's "backward through the graph a second time"
    # came from the walk's backward afterwards.
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4, **SETTINGS["kept"])
    loss = loss_with_captured_term(model, 1, "output", torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=r"^OffloadModel: a backward from outside the model reached the graph "
                       r"slice 0 built in forward \(at its input or at a parameter of its layers\)"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert_trains_as(model, reference(plain, "kept"))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("layer", [3, 5])
def test_a_layer_output_used_outside_the_model_names_that_cause_first(setting, layer):
    # The layer's output reaches what its slice's forward saved: discarded by a checkpointed run,
    # slot references to a slice not on the device for a kept graph (rule 2).
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4, **SETTINGS[setting])
    loss = loss_with_captured_term(model, layer, "output", torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=SAID[setting].format(index=layer // 2) + CAUSE):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert_trains_as(model, reference(plain, setting))


@pytest.mark.parametrize("setting", ["recompute", "kept"])
def test_an_activation_returned_from_the_model_gets_the_plain_gradients(setting):
    # What the messages say to do: the feature leaves the model as part of its output.
    class WithFeature(nn.Module):
        def forward(self, x):
            return x, x

    class Head(nn.Module):
        def __init__(self, body):
            super().__init__()
            self.body = body

        def forward(self, inputs):
            h, feature = inputs
            return self.body(h), feature

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), WithFeature(), Head(nn.Linear(8, 8)))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2, **SETTINGS[setting])
    x = torch.randn(4, 8)
    for m in (plain, model):
        y, feature = m(x)
        (y.pow(2).sum() + feature.pow(2).sum()).backward()
    for (name, expected), got in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, msg=lambda m: f"{name}: {m}", **EXACT)


def test_a_layer_output_used_outside_a_slice_that_offloads_its_activations_names_that_cause():
    """Rule 2 for a slice that offloads its saved tensors (offload_activations): the message that said
    "internal error" names the outside use first."""
    model = OffloadModel(network(), device="cpu", num_slices=4, checkpoint_activation=True,
                         offload_activations=offload.OffloadActivations(last=4, min_bytes=0))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loss = loss_with_captured_term(model, 2, "output", x)
    with pytest.raises(RuntimeError, match=r"^OffloadModel: autograd reached a saved tensor of a slice that "
                                           r"offloads them" + CAUSE):
        loss.backward()
