"""``torch.compile`` with OffloadModel: compiled layers, and the compiled wrapped model, give the
plain model's results; a compiled layer that writes a buffer in forward is refused by PyTorch, and
the error says why and what to do (docs/api.md, Limitations)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from offload import OffloadModel
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
