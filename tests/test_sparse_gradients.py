"""Sparse gradients (``nn.Embedding(sparse=True)``) reach ``.grad`` as autograd gives them.

The plain model's embedding gradient is a sparse COO tensor, uncoalesced, and autograd
accumulates a second backward's by concatenating entries. OffloadModel hands autograd the same
tensor (indices, values and the coalesced flag), so ``torch.optim.SparseAdam`` and SGD or
Adagrad with sparse gradients train exactly as on the plain model, stepped by the plain optimizer
or by :class:`~offload.OffloadOptimizer`.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

EXACT = {"rtol": 0.0, "atol": 0.0}


def lookup_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(12, 6, sparse=True), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 3))


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, 12, (4, 5), generator=torch.Generator().manual_seed(step))


def assert_same_grad(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.layout == want.layout, name
    if want.is_sparse:
        assert got.is_coalesced() == want.is_coalesced(), name
        torch.testing.assert_close(got._indices(), want._indices(), **EXACT, msg=name)
        torch.testing.assert_close(got._values(), want._values(), **EXACT, msg=name)
    else:
        torch.testing.assert_close(got, want, **EXACT, msg=name)


def backward_both(plain: nn.Module, model: OffloadModel, step: int, num_microbatches: int) -> None:
    x = ids(step)
    if num_microbatches == 1:
        plain(x).square().sum().backward()
    else:  # each slice runs the rows in halves, summing their gradients: so does the reference
        for rows in x.tensor_split(num_microbatches):
            plain(rows).square().sum().backward()
    model(x).square().sum().backward()


@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("num_slices", [1, 3])
def test_sparse_gradients_accumulate_as_in_the_plain_model(num_slices, num_microbatches):
    plain = lookup_model()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=num_slices, num_microbatches=num_microbatches)
    for step in range(2):  # the second backward adds into the first's .grad
        backward_both(plain, model, step, num_microbatches)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            # Microbatches are summed before autograd adds their total to .grad: for a dense
            # gradient that is another order of additions; sparse ones concatenate either way.
            if p.grad.is_sparse or step == 0 or num_microbatches == 1:
                assert_same_grad(p.grad, q.grad, name)
    assert model.get_parameter("0.weight").grad.is_sparse


OPTIMIZERS = [
    pytest.param(torch.optim.SparseAdam, {"lr": 0.1}, id="SparseAdam"),
    pytest.param(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, id="SGD-momentum"),
    pytest.param(torch.optim.Adagrad, {"lr": 0.1}, id="Adagrad"),
]


def _sparse_params(model: nn.Module, optimizer_class: type) -> list[nn.Parameter]:
    """SparseAdam takes sparse gradients only: the embedding; the others take every parameter."""
    if optimizer_class is torch.optim.SparseAdam:
        return [p for name, p in model.named_parameters() if name.startswith("0.")]
    return list(model.parameters())


@pytest.mark.parametrize("offload_optimizer", [False, True], ids=["torch.optim", "OffloadOptimizer"])
@pytest.mark.parametrize(("optimizer_class", "kwargs"), OPTIMIZERS)
def test_sparse_optimizers_train_exactly(optimizer_class, kwargs, offload_optimizer):
    plain = lookup_model()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2, num_microbatches=2)
    reference = optimizer_class(_sparse_params(plain, optimizer_class), **kwargs)
    if offload_optimizer:
        optimizer = OffloadOptimizer(model, optimizer_class, _sparse_params(model, optimizer_class), **kwargs)
    else:
        optimizer = optimizer_class(_sparse_params(model, optimizer_class), **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "SGD is stepping|Adagrad is stepping")
        for step in range(3):
            backward_both(plain, model, step, 2)
            reference.step()
            optimizer.step()
            reference.zero_grad()
            optimizer.zero_grad()
    if offload_optimizer:
        optimizer.synchronize()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=name)


def test_data_parallelism_refuses_sparse_gradients_with_advice(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = OffloadModel(lookup_model(), device="cpu", num_slices=2, process_group=dist.group.WORLD)
        with pytest.raises(RuntimeError, match=r"Embedding\.weight in slice 0 received a sparse one: build the "
                                               r"layer with sparse=False"):
            model(ids(0)).sum().backward()
    finally:
        dist.destroy_process_group()
