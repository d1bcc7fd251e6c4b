"""``.to(device)`` / ``.cuda()`` / ``.cpu()`` on an OffloadModel move its compute device; the host
copies stay on ``offload_device`` (Note: [Moving an OffloadModel] in ``offload/modeling/placement.py``)."""

import copy

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of

from .helpers import CUDA

EXACT = dict(rtol=0, atol=0)


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def test_to_the_compute_device_is_a_no_op():
    model = OffloadModel(small(), device="cpu", num_slices=2)
    engine = engine_of(model)
    params = [p.data_ptr() for p in model.parameters()]
    assert model.to("cpu") is model and model.cpu() is model and model.to(torch.device("cpu")) is model
    assert engine_of(model) is engine  # nothing rebuilt
    assert [p.data_ptr() for p in model.parameters()] == params


def test_a_move_changes_the_compute_device_and_keeps_the_host_copies():
    # A model built to compute on "meta" (no data there) moved to the CPU: the only move a machine
    # without a GPU can make. The parameters stay the same objects on the host, with their values.
    plain = small()
    model = OffloadModel(copy.deepcopy(plain), device="meta", num_slices=2)
    params = list(model.parameters())
    old_engine = engine_of(model)
    assert model.to("cpu") is model
    assert model.device == torch.device("cpu") and model.offload_device == torch.device("cpu")
    assert engine_of(model) is not old_engine and engine_of(model).device == torch.device("cpu")
    assert list(model.parameters()) == params and all(p.device.type == "cpu" for p in params)
    x = torch.randn(4, 6)
    torch.testing.assert_close(model(x), plain(x), **EXACT)
    model(x).sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=lambda m: f"{name}: {m}")


def test_a_move_with_a_dtype_converts_the_host_copies():
    plain = small().double()
    model = OffloadModel(small(), device="meta", num_slices=2)
    model.to("cpu", torch.float64)
    assert model.device == torch.device("cpu")
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in model.parameters())
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(model(x), plain(x), **EXACT)


def test_a_dtype_change_converts_the_host_copies_in_place():
    model = OffloadModel(small(), device="cpu", num_slices=2)
    engine = engine_of(model)
    model.to(torch.float64)
    assert model.device == torch.device("cpu") and engine_of(model) is engine
    assert all(p.dtype == torch.float64 for p in model.parameters())
    x = torch.randn(2, 6, dtype=torch.float64)
    torch.testing.assert_close(model(x), small().double()(x), **EXACT)


def test_a_device_that_does_not_exist_is_named():
    model = OffloadModel(small(), device="cpu", num_slices=2)
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises((RuntimeError, ValueError), match="compute device|CUDA device"):
        model.to(missing)
    assert model.device == torch.device("cpu")
    model(torch.randn(2, 6))  # still works where it was


def test_a_move_under_an_offload_optimizer_is_refused():
    model = OffloadModel(small(), device="cpu", num_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="build the optimizer after moving the model"):
        model.to("meta")
    assert model.device == torch.device("cpu")
    del optimizer


def test_a_move_to_the_host_under_an_offload_optimizer_warns_and_keeps_the_compute_device():
    # What Lightning's teardown does (.cpu()): the parameters are on the host already.
    model = OffloadModel(small(), device="meta", num_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.warns(UserWarning, match="keeps computing on meta"):
        model.cpu()
    assert model.device == torch.device("meta")
    del optimizer


@CUDA
def test_cuda_moves_the_compute_and_keeps_parameters_pinned_on_the_host():
    plain = small()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    params = list(model.parameters())
    model.cuda()
    assert model.device == torch.device("cuda", torch.cuda.current_device())
    assert list(model.parameters()) == params
    assert all(p.device.type == "cpu" and p.is_pinned() for p in params)
    x = torch.randn(4, 6)
    out = model(x.cuda())
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), plain(x), rtol=1e-5, atol=1e-6)
    model.to("cpu")
    assert model.device == torch.device("cpu")
    torch.testing.assert_close(model(x), plain(x), **EXACT)
