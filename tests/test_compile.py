"""``torch.compile`` with OffloadModel: compiled layers, and the compiled wrapped model, give the
plain model's results; a compiled layer that writes a buffer in forward is refused by PyTorch, and
the error says why and what to do (docs/api.md, Limitations); the registration hooks OffloadModel
installs leave other compiled modules in one graph."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from offload import OffloadModel
from offload.streams.slice_entries import RegisteredTensors, collect_entries
from offload.walk.engine import COMPILED_BUFFER_NOTE

EXACT = {"rtol": 0.0, "atol": 0.0}


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _compiled_layers(model: nn.Sequential) -> nn.Sequential:
    return nn.Sequential(*[torch.compile(layer, backend="aot_eager") for layer in model])


@pytest.mark.parametrize("how", ["layers", "wrapped"])
def test_compiled_training_is_the_plain_models(how):
    torch._dynamo.reset()
    plain = network()
    inner = _compiled_layers(copy.deepcopy(plain)) if how == "layers" else copy.deepcopy(plain)
    model = OffloadModel(inner, device="cpu", num_slices=3)
    run = torch.compile(model, backend="aot_eager") if how == "wrapped" else model
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want, got = plain(x), run(x)
        # The walk is skipped as it is, nothing in it traced (Note: [Compiled around the walk]).
        assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message) for w in caught]
        torch.testing.assert_close(got, want, **EXACT)
        want.square().sum().backward()
        got.square().sum().backward()
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, **EXACT, msg=name)
        for o in (plain_opt, opt):
            o.step()
            o.zero_grad()


def test_a_compiled_layer_that_writes_a_buffer_is_refused_with_a_note():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))
    model = OffloadModel(_compiled_layers(layers), device="cpu", num_slices=2)
    assert model.partition[0] == ("0", "1", "2")  # the norm's buffers share the slot with a weight
    with pytest.raises(Exception) as raised:
        model(torch.randn(4, 8))
    assert COMPILED_BUFFER_NOTE in getattr(raised.value, "__notes__", [])


def _counting_backend(graphs: list[torch.fx.GraphModule]):
    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(gm)
        return gm.forward  # the "eager" backend, counted
    return backend


@pytest.mark.parametrize("fullgraph", [False, True])
def test_registration_hooks_leave_compiled_modules_in_one_graph(fullgraph):
    # The registration hooks are process-wide: a hook that read a count made dynamo recompile a
    # spectral-norm layer outside any OffloadModel, which assigns its buffer ``_u`` in forward, at
    # every call (``_RegistrationCounter`` in offload/streams/slice_entries.py says why).
    OffloadModel(network(), device="cpu")
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []
    torch.manual_seed(0)
    plain = spectral_norm(nn.Linear(16, 16))
    layer = torch.compile(copy.deepcopy(plain), backend=_counting_backend(graphs), fullgraph=fullgraph)
    for step in range(20):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        torch.testing.assert_close(layer(x), plain(x), **EXACT)
    assert len(graphs) == 1


def test_a_registration_in_a_compiled_forward_is_still_seen():
    OffloadModel(network(), device="cpu")
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def remember(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        y = layer(x)
        layer.register_buffer("last", y.detach().mean(0))  # a new registration in the layer
        return y

    run = torch.compile(remember, backend=_counting_backend(graphs))
    for _ in range(6):
        layer = nn.Linear(8, 8)
        registered = RegisteredTensors([layer])
        params, buffers = collect_entries([layer])
        run(layer, torch.randn(4, 8))
        # Only the hooks tell: the laid-out entries are all still in place.
        assert registered.changed(params + buffers)
    assert len(graphs) <= 2
