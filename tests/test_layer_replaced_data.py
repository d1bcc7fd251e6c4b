"""A layer that casts a parameter's ``.data`` in its forward, as bitsandbytes' ``Linear4bit`` casts a
float32 bias to its compute dtype (Note: [Parameters a layer casts in forward] in
``offload/autograd/slice_graph.py``).

The parameter gets the plain model's gradient, bit for bit once cast to float32, whether its slice
keeps its graph (the last slice, ``checkpoint_activation=False``), offloads its activations or is
recomputed, with one slice and with microbatches; ``OffloadOptimizer`` then steps it. The plain
model's parameter is in the compute dtype from its first forward on, so its gradient is compared
after the cast, and only the first step.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of

from .helpers import ACTIVATIONS

EXACT = {"rtol": 0.0, "atol": 0.0}


class CastsItsBias(nn.Module):
    """A linear layer computing in bfloat16 that casts its float32 bias through ``.data`` in forward,
    as ``bitsandbytes.nn.Linear4bit.forward`` does when the bias is not in its compute dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.bias = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.bias.dtype != x.dtype:
            self.bias.data = self.bias.data.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), self.bias).float()


def _net(first: bool) -> nn.Sequential:
    """The casting layer alone in the first slice of two (``first``), or in the last."""
    torch.manual_seed(0)
    if first:
        return nn.Sequential(CastsItsBias(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), CastsItsBias(16))


def _offloaded(plain: nn.Sequential, casting: nn.Module, slice_index: int, **options) -> OffloadModel:
    model = OffloadModel(copy.deepcopy(plain), device="cpu", **options)
    casting_name = next(name for name, layer in plain.named_children() if layer is casting)
    assert casting_name in engine_of(model).slices[slice_index].names
    return model


def _inputs() -> torch.Tensor:
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(3))


def _reference_grads(plain: nn.Module, x: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """The plain model's gradients, as float32, summed over the microbatches in float32 as OffloadModel
    sums them (Note: [Gradients in the compute dtype] in ``offload/streams/gradients.py``)."""
    total: list[torch.Tensor] | None = None
    for chunk in torch.tensor_split(x, num_microbatches):
        grads = [g.float() for g in torch.autograd.grad(plain(chunk).square().sum(), list(plain.parameters()))]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    assert total is not None
    return total


def _assert_plain_grads(model: OffloadModel, plain: nn.Module, x: torch.Tensor, num_microbatches: int) -> None:
    expected = _reference_grads(plain, x, num_microbatches)
    model(x).square().sum().backward()
    for (name, p), want in zip(model.named_parameters(), expected, strict=True):
        assert p.grad is not None, f"{name}: no gradient"
        assert p.dtype == p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, want, msg=lambda m: f"{name}: {m}", **EXACT)


@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("activations", list(ACTIVATIONS))
@pytest.mark.parametrize("first", [False, True], ids=["last_slice", "first_slice"])
def test_a_parameter_cast_in_forward_gets_the_plain_gradient(first: bool, activations: str,
                                                             num_microbatches: int) -> None:
    plain = _net(first)
    casting = plain[0] if first else plain[-1]
    model = _offloaded(plain, casting, 0 if first else 1, num_slices=2, num_microbatches=num_microbatches,
                       **ACTIVATIONS[activations])
    _assert_plain_grads(model, plain, _inputs(), num_microbatches)
    assert casting.bias.dtype == torch.bfloat16  # the plain model keeps the cast


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_one_slice(num_microbatches: int) -> None:
    plain = _net(first=False)
    model = _offloaded(plain, plain[-1], 0, num_slices=1, num_microbatches=num_microbatches)
    _assert_plain_grads(model, plain, _inputs(), num_microbatches)


@pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")
@pytest.mark.parametrize("resident_slices", [0, 1])
def test_the_optimizer_steps_the_float32_master(resident_slices: int) -> None:
    plain = _net(first=False)
    model = _offloaded(plain, plain[-1], 1, num_slices=2, resident_slices=resident_slices)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1)
    # The step the plain model would take were its bias kept in float32: SGD on float32 copies
    # given its first gradients, cast.
    copies = [nn.Parameter(p.detach().clone()) for p in plain.parameters()]
    x = _inputs()
    for copy_, g in zip(copies, _reference_grads(plain, x, 1)):
        copy_.grad = g
    torch.optim.SGD(copies, lr=0.1).step()
    model(x).square().sum().backward()
    optimizer.step()
    optimizer.synchronize()
    for (name, p), want in zip(model.named_parameters(), copies, strict=True):
        assert p.dtype == torch.float32, name
        torch.testing.assert_close(p.detach(), want.detach(), msg=lambda m: f"{name}: {m}", **EXACT)


def _linear4bit(bnb, width: int) -> nn.Module:
    """A ``Linear4bit`` computing in bfloat16 with a trainable float32 bias, quantized on the CPU
    (bitsandbytes' CPU kernels take widths of 64 and more)."""
    dense = nn.Linear(width, width)
    layer = bnb.nn.Linear4bit(width, width, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type="nf4", module=layer)
    layer.bias = nn.Parameter(dense.bias.data.clone())
    return layer.to("cpu")


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_linear4bit_bias_in_the_last_slice(num_microbatches: int) -> None:
    with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
        warnings.simplefilter("ignore")
        bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), _linear4bit(bnb, 64))
    model = _offloaded(plain, plain[-1], 1, num_slices=2, num_microbatches=num_microbatches)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    trainable = [p for p in plain.parameters() if p.requires_grad]
    expected: list[torch.Tensor] | None = None
    for chunk in torch.tensor_split(x, num_microbatches):
        grads = [g.float() for g in torch.autograd.grad(plain(chunk).square().sum(), trainable)]
        expected = grads if expected is None else [t + g for t, g in zip(expected, grads)]
    assert plain[-1].bias.dtype == torch.bfloat16  # bitsandbytes' cast, kept by the plain model
    model(x).square().sum().backward()
    got = [p for p in model.parameters() if p.requires_grad]
    for p, want in zip(got, expected, strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, want, **EXACT)
