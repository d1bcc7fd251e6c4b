"""Accelerate with an OffloadModel on the CPU: ``prepare``, ``accumulate``, ``backward``,
``clip_grad_norm_``, ``save_model`` and ``save_state``/``load_state``, with torch's AdamW and with
OffloadOptimizer, each run compared bit for bit with the plain model trained the same way.

``save_model`` and ``save_state`` keep one tensor per storage; every host copy has one of its own
(Note: [A storage per host copy] in ``offload/streams/host_storage.py``), so all of them are saved.
See ``docs/accelerate.md``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

from .test_save_libraries import EXACT, _scramble, assert_same_state, layers, save_peak

accelerate = pytest.importorskip("accelerate", reason='accelerate is not installed: pip install -e ".[accelerate]"')
safetensors_torch = pytest.importorskip("safetensors.torch", reason='safetensors is not installed: pip install -e ".[test]"')

BATCHES = [(torch.randn(6, 8, generator=torch.Generator().manual_seed(k)),
            torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + k))) for k in range(8)]


def accelerator(accumulation: int = 2):
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate keeps its state in process-wide singletons: each run starts from a fresh one.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)


def prepared(optimizer_kind: str, offload: bool, perturb: bool = False):
    """A fresh Accelerator and the model and optimizer it prepared."""
    model: nn.Module = layers()
    if perturb:  # what a resume must overwrite
        model.apply(_scramble)
    if offload:
        model = OffloadModel(model, device="cpu", num_slices=3)
    if optimizer_kind == "offload_optimizer":
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = accelerator()
    model, optimizer = acc.prepare(model, optimizer)
    return acc, model, optimizer


def train(acc, model: nn.Module, optimizer, batches) -> None:
    for x, y in batches:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()


OPTIMIZERS = ["torch_adamw", "offload_optimizer"]


@pytest.fixture(scope="module")
def plain_run() -> dict[str, torch.Tensor]:
    """The plain model trained through Accelerate with torch's AdamW, as OffloadModel must be."""
    acc, model, optimizer = prepared("torch_adamw", offload=False)
    train(acc, model, optimizer, BATCHES)
    return {name: value.clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("optimizer_kind", OPTIMIZERS)
def test_accelerate_trains_as_the_plain_model_and_save_model_keeps_every_tensor(optimizer_kind, plain_run, tmp_path):
    acc, model, optimizer = prepared(optimizer_kind, offload=True)
    assert isinstance(model, OffloadModel)
    assert all(p.device.type == "cpu" for p in model.parameters())
    train(acc, model, optimizer, BATCHES)
    assert_same_state(model.state_dict(), plain_run)
    acc.save_model(model, tmp_path)
    assert_same_state(safetensors_torch.load_file(tmp_path / "model.safetensors"), plain_run)


@pytest.mark.parametrize("optimizer_kind", OPTIMIZERS)
def test_accelerate_save_state_and_load_state_resume_bit_for_bit(optimizer_kind, plain_run, tmp_path):
    acc, model, optimizer = prepared(optimizer_kind, offload=True)
    train(acc, model, optimizer, BATCHES[:4])
    acc.save_state(tmp_path / "state")
    saved_optimizer = optimizer.state_dict()

    acc, model, optimizer = prepared(optimizer_kind, offload=True, perturb=True)
    acc.load_state(tmp_path / "state")
    # Every parameter and buffer came back, and the optimizer's state.
    assert_same_state(safetensors_torch.load_file(tmp_path / "state" / "model.safetensors"), model.state_dict())
    restored = optimizer.state_dict()
    assert restored["param_groups"] == saved_optimizer["param_groups"]
    for index, values in saved_optimizer["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(restored["state"][index][key], value, **EXACT)
    train(acc, model, optimizer, BATCHES[4:])
    assert_same_state(model.state_dict(), plain_run)


def test_save_model_does_not_copy_the_model():
    measured = save_peak("accelerate_save_model")
    assert measured["model_bytes"] > 100e6
    # A copy of the model would add its 100 MB; measured: 0.3 MB.
    assert measured["growth_bytes"] < 0.05 * measured["model_bytes"], measured


def test_mixed_precision_runs_the_forward_under_autocast_as_the_plain_model():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    plain = layers()
    model = acc.prepare(OffloadModel(layers(), device="cpu", num_slices=3))
    x, y = BATCHES[0]
    acc.backward(nn.functional.mse_loss(model(x), y))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(x)
    nn.functional.mse_loss(want.float(), y).backward()
    assert_same_state({n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in plain.named_parameters()})
    assert_same_state(model.state_dict(), plain.state_dict())  # BatchNorm's running statistics too
