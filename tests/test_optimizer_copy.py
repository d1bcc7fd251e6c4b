"""Copying and pickling an OffloadOptimizer (Note: [Copying an OffloadOptimizer] in
``offload/optimizing/copying.py``): a deep copy or a loaded pickle steps bit for bit as a fresh
optimizer loaded with ``state_dict()``, bound to the model's copy; the original keeps stepping;
what cannot be copied says what to do, at copy time."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from offload import DiskTier, OffloadModel, OffloadOptimizer

from .test_optimizer import batch, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

EXACT = {"rtol": 0.0, "atol": 0.0}


def _saved_and_loaded(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


#: Each way of copying the model and the optimizer together: it returns (model copy, optimizer copy).
TOGETHER: dict[str, Callable[[Any, Any], tuple[Any, Any]]] = {
    "deepcopy-pair": lambda model, optimizer: copy.deepcopy((model, optimizer)),
    "deepcopy-optimizer-first": lambda model, optimizer: copy.deepcopy((optimizer, model))[::-1],
    "deepcopy-training-state": lambda model, optimizer: tuple(
        copy.deepcopy({"model": model, "optimizer": optimizer}).values()),
    "pickle-pair": lambda model, optimizer: pickle.loads(pickle.dumps((model, optimizer))),
    "torch-save-pair": lambda model, optimizer: _saved_and_loaded((model, optimizer)),
}

#: Each way of copying the optimizer alone: its copy steps a copy of the model of its own.
ALONE: dict[str, Callable[[Any], Any]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda optimizer: pickle.loads(pickle.dumps(optimizer)),
    "torch-save": _saved_and_loaded,
}


def _groups(model: OffloadModel) -> list[dict[str, Any]]:
    """Two groups with different hyperparameters, so that a copy mixing them up shows."""
    params = list(model.parameters())
    return [{"params": params[:2], "lr": 3e-2}, {"params": params[2:], "weight_decay": 0.1}]


def trained(model_options: dict[str, Any] | None = None, **options: Any) -> tuple[OffloadModel, OffloadOptimizer]:
    """A model and its optimizer two steps in, the last step's updates still pending."""
    model = OffloadModel(network(), device="cpu", num_slices=3, **(model_options or {}))
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, _groups(model), lr=1e-2, **options)
    for step in range(2):
        train_step(model, optimizer, step, synchronize=step == 0)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, synchronize: bool = True) -> None:
    model(batch(step)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if synchronize:
        optimizer.synchronize()


def reference(model: OffloadModel, optimizer: OffloadOptimizer, **options: Any) -> tuple[Any, Any]:
    """What the copy must equal: the model deep-copied, and a fresh optimizer over it loaded with the state."""
    state = copy.deepcopy(optimizer.state_dict())
    twin = copy.deepcopy(model)
    fresh = OffloadOptimizer(twin, torch.optim.AdamW, _groups(twin), lr=1e-2, **options)
    fresh.load_state_dict(state)
    return twin, fresh


def assert_same_training(*runs: tuple[nn.Module, OffloadOptimizer]) -> None:
    """Train every (model, optimizer) on the same batches: parameters and state stay equal bit for bit."""
    for step in range(2, 5):
        for model, optimizer in runs:
            train_step(model, optimizer, step)
    (first_model, first), *others = runs
    for model, optimizer in others:
        torch.testing.assert_close(dict(model.named_parameters()), dict(first_model.named_parameters()), **EXACT)
        torch.testing.assert_close(optimizer.state_dict(), first.state_dict(), **EXACT)


def _bound_to(optimizer: OffloadOptimizer, model: OffloadModel) -> None:
    assert optimizer.model is model
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]


@pytest.mark.parametrize("how", TOGETHER)
def test_copied_with_its_model_steps_the_models_copy(how: str) -> None:
    model, optimizer = trained()
    twin, fresh = reference(model, optimizer)
    model_copy, optimizer_copy = TOGETHER[how](model, optimizer)
    assert isinstance(optimizer_copy, OffloadOptimizer) and optimizer_copy is not optimizer
    _bound_to(optimizer_copy, model_copy)
    assert [g["lr"] for g in optimizer_copy.param_groups] == [3e-2, 1e-2]
    # The original trains on beside the copy: its state was copied, never shared.
    assert_same_training((twin, fresh), (model_copy, optimizer_copy), (model, optimizer))


@pytest.mark.parametrize("storage", ["resident-slice", "compute-dtype", "masters-on-disk"])
def test_a_copy_of_a_model_stored_otherwise(storage: str, tmp_path: Any) -> None:
    model_options = {"resident-slice": {"resident_slices": 1}, "compute-dtype": {"compute_dtype": torch.bfloat16},
                     "masters-on-disk": {"compute_dtype": torch.bfloat16, "masters": tmp_path}}[storage]
    model, optimizer = trained(model_options)
    twin, fresh = reference(model, optimizer)
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    _bound_to(optimizer_copy, model_copy)
    assert_same_training((twin, fresh), (model_copy, optimizer_copy), (model, optimizer))


@pytest.mark.parametrize("how", ALONE)
def test_copied_alone_steps_a_copy_of_the_model(how: str) -> None:
    model, optimizer = trained()
    twin, fresh = reference(model, optimizer)
    optimizer_copy = ALONE[how](optimizer)
    assert optimizer_copy.model is not model
    _bound_to(optimizer_copy, optimizer_copy.model)
    assert_same_training((twin, fresh), (optimizer_copy.model, optimizer_copy), (model, optimizer))


def test_a_parameter_outside_the_model_is_copied_with_the_same_deepcopy() -> None:
    model = OffloadModel(network(), device="cpu", num_slices=3)
    extra = nn.Parameter(torch.randn(4))
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, [{"params": model.parameters()}, {"params": [extra]}],
                                 lr=1e-2)
    model(batch(0)).pow(2).mean().backward()
    extra.grad = torch.ones(4)
    optimizer.step()
    optimizer.zero_grad()
    model_copy, extra_copy, optimizer_copy = copy.deepcopy((model, extra, optimizer))
    assert optimizer_copy.param_groups[1]["params"][0] is extra_copy
    assert optimizer_copy.state[extra_copy].keys() == optimizer.state[extra].keys()
    for m, e, o in ((model, extra, optimizer), (model_copy, extra_copy, optimizer_copy)):
        m(batch(1)).pow(2).mean().backward()
        e.grad = torch.full((4,), 0.5)
        o.step()
    torch.testing.assert_close(extra_copy, extra, **EXACT)
    torch.testing.assert_close(dict(model_copy.named_parameters()), dict(model.named_parameters()), **EXACT)


def test_the_copy_keeps_the_settings() -> None:
    model, optimizer = trained(num_threads=1, norms_in_backward=True, accumulation_steps=2)
    _, optimizer_copy = copy.deepcopy((model, optimizer))
    assert optimizer_copy.num_threads == 1
    assert optimizer_copy._norms is not None and optimizer_copy._norms.accumulation_steps == 2
    assert optimizer_copy._in_backward is None and optimizer_copy._scaling is None
    assert optimizer_copy.optimizer_kwargs == {"lr": 1e-2}


def test_update_in_backward_copies_after_step_and_refuses_before(tmp_path: Any) -> None:
    model, optimizer = trained(update_in_backward=True)
    twin, fresh = reference(model, optimizer, update_in_backward=True)
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    assert optimizer_copy._in_backward is not None
    assert_same_training((twin, fresh), (model_copy, optimizer_copy), (model, optimizer))
    # Backward has started this step's updates: a copy would update those slices twice.
    model(batch(9)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="call step\\(\\) first, then copy"):
        copy.deepcopy((model, optimizer))
    optimizer.step()  # the original, untouched by the refusal, finishes its step
    optimizer.synchronize()


def test_a_disk_tier_copy_has_files_of_its_own(tmp_path: Any) -> None:
    model, optimizer = trained(disk_tier=DiskTier(tmp_path, direct=False))
    twin, fresh = reference(model, optimizer, disk_tier=DiskTier(tmp_path, direct=False))
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    assert optimizer_copy._tier is not None and optimizer._tier is not None
    assert optimizer_copy._tier.directory != optimizer._tier.directory
    assert optimizer_copy._tier.directory.parent == optimizer._tier.directory.parent
    assert_same_training((twin, fresh), (model_copy, optimizer_copy), (model, optimizer))
    for closing in (optimizer, optimizer_copy, fresh):
        closing.close()


def test_a_shallow_copy_is_refused() -> None:
    model, optimizer = trained()
    with pytest.raises(TypeError, match=r"copy.deepcopy\(\(model, optimizer\)\).*load_state_dict"):
        copy.copy(optimizer)
    train_step(model, optimizer, 2)  # still the model's optimizer


def test_a_sharded_optimizer_is_refused() -> None:
    # A real sharded update needs several ranks (tests/test_distributed.py); the refusal reads only this.
    model, optimizer = trained()
    optimizer._sharding, sharding = object(), optimizer._sharding
    try:
        for copying in (copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="consolidated_state_dict"):
                copying(optimizer)
    finally:
        optimizer._sharding = sharding
    train_step(model, optimizer, 2)


def test_the_model_alone_still_copies() -> None:
    # The model side (offload/modeling/copying.py): its copy trains as the original does.
    model, optimizer = trained()
    model_copy = copy.deepcopy(model)
    optimizer_copy = OffloadOptimizer(model_copy, torch.optim.AdamW, _groups(model_copy), lr=1e-2)
    optimizer_copy.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert_same_training((model, optimizer), (model_copy, optimizer_copy))
