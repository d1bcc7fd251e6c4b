"""Outputs joined across microbatches (Note: [Joining outputs] in ``offload/walk/microbatch.py``),
boundary leaves that alias each other (Note: [Boundary leaves that alias each other] in
``offload/autograd/slice_graph.py``), and a compute dtype fixed at construction.

Each test compares with the plain model bit for bit, and where microbatches matter with the plain
layers run slice by slice on each chunk in turn (what OffloadModel computes with microbatches).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadModel

from .helpers import ACTIVATIONS, DEVICES, assert_same_grads, clone_model

EXACT = {"rtol": 0.0, "atol": 0.0}
MODES = ["recompute", "kept", "offload_last"]


def _chunked(layers: nn.Sequential, partition: Any, value: Any, count: int, cut: Any) -> list[Any]:
    """Each chunk's output: the plain layers slice by slice on each chunk in turn; ``cut`` makes
    the chunks of the input."""
    chunks = cut(value, count)
    for names in partition:
        chunks = [_through(layers, names, chunk) for chunk in chunks]
    return chunks


def _through(layers: nn.Sequential, names: Any, value: Any) -> Any:
    for name in names:
        value = layers._modules[name](value)
    return value


# -- a tensor the same in every microbatch is handed back whole (rules 3 and 4) ----------------------


class MaskedBlock(nn.Module):
    """Rows mixed within each row's sequence by a ``[seq, seq]`` mask passed on unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = inputs
        return self.linear(h) + mask @ h, mask


class MaskMadeAgain(nn.Module):
    """The last layer makes its mask anew on each call: other memory, equal values."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seq = seq

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = inputs
        return self.linear(h) + mask @ h, torch.tril(torch.ones(self.seq, self.seq, device=h.device))


def _mask_pair(device: str, last: nn.Module, mode: str) -> tuple[nn.Sequential, OffloadModel]:
    torch.manual_seed(0)
    plain = nn.Sequential(MaskedBlock(), MaskedBlock(), last).to(device)
    return plain, OffloadModel(clone_model(plain), device=device, num_slices=3, num_microbatches=2,
                               **ACTIVATIONS[mode])


def _cut_masked(value: tuple[torch.Tensor, torch.Tensor], count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    h, mask = value
    return [(chunk, mask) for chunk in h.tensor_split(count)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("last", ["passed_on", "made_again"])
def test_a_mask_the_same_in_every_microbatch_comes_back_whole(device, mode, last):
    """Passed on, the same tensor in each microbatch: whole though its dim 0 (4) equals each
    microbatch's rows (8 / 2), where it was concatenated into (8, 4). Made again in each, equal
    values with no batch dimension (6 / 2 rows): whole, where it was refused."""
    seq = 4
    plain, model = _mask_pair(device, MaskedBlock() if last == "passed_on" else MaskMadeAgain(seq), mode)
    h = torch.randn(8 if last == "passed_on" else 6, seq, 8, device=device)
    mask = torch.tril(torch.ones(seq, seq, device=device))
    want = _chunked(plain, model.partition, (h, mask), 2, _cut_masked)
    got = model((h, mask))
    assert got[1].shape == (seq, seq)
    torch.testing.assert_close(got[1], plain((h, mask))[1], **EXACT)
    torch.testing.assert_close(got[0], torch.cat([w[0] for w in want]), **EXACT)
    got[0].pow(2).sum().backward()
    sum(w[0].pow(2).sum() for w in want).backward()
    assert_same_grads(model, plain, **EXACT)
    with torch.no_grad():  # the walk without a graph joins by the same rules
        assert model((h, mask))[1].shape == (seq, seq)


def test_a_mask_with_uneven_microbatches_and_a_broadcast_batch_are_joined_as_before():
    """Rule 3: uneven microbatches tell a per-row output from a shared one by its dim 0; rows that
    lie in one memory (an ``expand`` to the batch) are the batch's rows."""

    class Broadcast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.row = nn.Parameter(torch.randn(1, 8))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, self.row.detach().expand(x.shape[0], 8)

    plain = nn.Sequential(nn.Linear(8, 8), Broadcast())
    model = OffloadModel(clone_model(plain), device="cpu", num_slices=2, num_microbatches=2)
    x = torch.randn(8, 8)
    torch.testing.assert_close(model(x)[1], plain(x)[1], **EXACT)


def test_an_output_without_the_batch_that_needs_a_gradient_is_refused():
    """Backward cuts each output's gradient along dim 0, which a whole output cannot take (a
    weight returned leaves each microbatch's run as a copy of its own)."""

    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(3, 3))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, self.table

    model = OffloadModel(nn.Sequential(nn.Linear(8, 8), Table()), device="cpu", num_slices=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"does not carry the batch dimension .* needs a gradient: .* Return it detached"):
        model(torch.randn(8, 8))


def test_a_tensor_without_the_batch_that_differs_between_microbatches_is_refused():
    class Mean(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x.detach().mean(0)

    model = OffloadModel(nn.Sequential(nn.Linear(8, 8), Mean()), device="cpu", num_slices=2, num_microbatches=2)
    with pytest.raises(ValueError, match="does not carry the batch dimension .* not the same in every microbatch"):
        model(torch.randn(6, 8))


# -- values that are not tensors, and structures (rules 1 and 2) --------------------------------------


class Head(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        y = self.linear(x)
        if self.kind == "equal":
            return y, x.shape[1], "logits", None
        if self.kind == "statistic":
            return y, float(y.detach().abs().mean()), x.shape[0]
        return list(y)  # one tensor a row


@pytest.mark.parametrize("grad", [True, False], ids=["graph", "no_grad"])
def test_values_equal_in_every_microbatch_pass_through(grad):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), Head("equal"))
    model = OffloadModel(clone_model(plain), device="cpu", num_slices=2, num_microbatches=2)
    x = torch.randn(6, 8)
    with torch.set_grad_enabled(grad):
        got, want = model(x), plain(x)
    assert got[1:] == want[1:] == (8, "logits", None)
    want_rows = torch.cat([c[0] for c in _chunked(plain, model.partition, x, 2, lambda v, n: list(v.tensor_split(n)))])
    torch.testing.assert_close(got[0], want_rows, **EXACT)


@pytest.mark.parametrize("grad", [True, False], ids=["graph", "no_grad"])
@pytest.mark.parametrize("kind, message", [
    ("statistic", "output leaf 1 is a float that differs between microbatches .* num_microbatches=1"),
    ("rows", r"differs in structure between microbatches \(3 leaves in the first microbatch, 2 in microbatch 1\)"),
])
def test_values_or_structures_that_differ_between_microbatches_are_refused(grad, kind, message):
    """A float read from each microbatch (the plain model reads it from the whole batch), a list
    of rows (uneven microbatches give lists of other lengths)."""
    model = OffloadModel(nn.Sequential(nn.Linear(8, 8), Head(kind)), device="cpu", num_slices=2, num_microbatches=2)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=message):
        model(torch.randn(5, 8))


# -- boundary leaves that alias each other (Note: [Boundary leaves that alias each other]) ---------


class ResidualBlock(nn.Module):
    """Hands the next block its hidden states and residual stream as one tensor, or the residual
    as a view of the hidden states."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)
        self.view = view

    def forward(self, t: Any) -> tuple[torch.Tensor, torch.Tensor]:
        h, res = t if isinstance(t, tuple) else (t, t)
        if res.shape != h.shape:
            res = torch.cat([res, h[:, res.shape[1]:]], dim=1)
        res = res + self.attn(h).tanh() * res
        h = self.mlp(res) + h
        return (h, h[:, :6]) if self.view else (h, h)


class Product(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, res = t
        return self.linear(h * torch.cat([res, h[:, res.shape[1]:]], dim=1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("view", [False, True], ids=["same", "view"])
def test_a_boundary_holding_one_tensor_twice_gives_the_plain_gradients(device, mode, view):
    """Bit for bit, but for a view of another leaf under recompute: a recompute loads that view on
    its own (Note: [Boundary leaves that alias each other]), so its gradient is summed in another
    order, to rounding."""
    grads = {"rtol": 1e-5, "atol": 1e-6} if view and mode == "recompute" else EXACT
    torch.manual_seed(0)
    plain = nn.Sequential(ResidualBlock(view), ResidualBlock(view), ResidualBlock(view), Product()).to(device)
    model = OffloadModel(clone_model(plain), device=device, num_slices=4, **ACTIVATIONS[mode])
    x = torch.randn(5, 8, device=device)
    x_plain, x_model = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = model(x_model), plain(x_plain)
    torch.testing.assert_close(got, want, **EXACT)
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    assert_same_grads(model, plain, **grads)
    torch.testing.assert_close(x_model.grad, x_plain.grad, **grads)


class Mixing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, y, bias = t["x"], t["y"], t["bias"]
        return {"x": self.linear(x) * y.sigmoid() + bias, "y": y * 1.5 + x, "bias": bias}


class Sum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(t["x"] + t["y"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_model_input_holding_one_tensor_twice_gives_the_plain_gradients(mode, num_microbatches):
    """``{"x": x, "y": x}``: one tensor, its gradients summed as autograd sums them. With two
    microbatches, against the plain layers on each chunk in turn."""
    torch.manual_seed(0)
    plain = nn.Sequential(Mixing(), Mixing(), Mixing(), Sum())
    model = OffloadModel(clone_model(plain), device="cpu", num_slices=4, num_microbatches=num_microbatches,
                         **ACTIVATIONS[mode])
    generator = torch.Generator().manual_seed(1)
    x, bias = torch.randn(6, 8, generator=generator), torch.randn(8, generator=generator)
    x_plain, x_model = x.clone().requires_grad_(), x.clone().requires_grad_()
    b_plain, b_model = bias.clone().requires_grad_(), bias.clone().requires_grad_()
    model({"x": x_model, "y": x_model, "bias": b_model}).pow(2).sum().backward()
    chunks = [{"x": c, "y": c, "bias": b_plain} for c in x_plain.tensor_split(num_microbatches)]
    want = _chunked(plain, model.partition, chunks, num_microbatches, lambda v, n: v)
    sum(w.pow(2).sum() for w in want).backward()
    assert_same_grads(model, plain, **EXACT)
    torch.testing.assert_close(x_model.grad, x_plain.grad, **EXACT)
    if num_microbatches == 1:  # a leaf not cut sums its microbatches' gradients in another order
        torch.testing.assert_close(b_model.grad, b_plain.grad, **EXACT)


# -- compute_dtype is fixed at construction ----------------------------------------------------------


def test_compute_dtype_is_read_only():
    """Set afterwards, it cast the inputs but not the device copies."""
    model = OffloadModel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), device="cpu", num_slices=2)
    with pytest.raises(AttributeError, match=r"fixed when the model is built .* compute_dtype=torch.bfloat16"):
        model.compute_dtype = torch.bfloat16
    assert model.compute_dtype is None
    assert model(torch.randn(3, 8)).dtype == torch.float32
    half = OffloadModel(nn.Sequential(nn.Linear(8, 4)), device="cpu", num_slices=1, compute_dtype=torch.bfloat16)
    assert half.compute_dtype is torch.bfloat16 and half(torch.randn(3, 8)).dtype == torch.bfloat16
