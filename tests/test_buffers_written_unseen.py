"""Buffers a layer changes in forward without moving a version counter are written back as the
plain model keeps them, and restored for recompute (rule 1 of Note: [Buffers] in
``offload/walk/slice_walk.py``): a write through ``.data`` (EMA statistics, VQ-VAE codebooks) and
``F.batch_norm(training=True)`` on a layer's own buffers (its kernel updates them in place, unseen).

The first run of a slice in each mode (grad mode, the modules' training flags) compares the
buffers' bytes before and after it, once; the counters below prove how often.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload import OffloadModel
from offload.streams.slot_buffers import SlotBuffers

from .helpers import ACTIVATIONS, DEVICES, assert_same_grads, microbatched_reference

EXACT = {"rtol": 0.0, "atol": 0.0}


class DataEMA(nn.Module):
    """Keeps an average of its outputs, updated through ``.data`` in training, as EMA-codebook layers do."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("ema", torch.zeros(n))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.lin(h)
        if self.training:
            self.ema.data.mul_(0.9).add_(out.detach().mean(0), alpha=0.1)
        return out + self.ema


class FunctionalNorm(nn.Module):
    """A hand-written BatchNorm: running statistics in its own buffers, no ``track_running_stats``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("var", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var, self.weight, self.bias, self.training, 0.1, 1e-5)


def _layers() -> nn.Sequential:
    # Both layers in slices before the last, which backward recomputes with checkpoint_activation.
    return nn.Sequential(nn.Linear(6, 8), DataEMA(8), nn.Tanh(), nn.Linear(8, 8), FunctionalNorm(8), nn.Tanh(),
                         nn.Linear(8, 3))


def _pair(device: str, **kwargs) -> tuple[nn.Sequential, OffloadModel]:
    torch.manual_seed(0)
    plain = _layers().to(device)
    kwargs.setdefault("num_slices", 5)  # ('0',), ('1', '2'), ('3',), ('4', '5'), ('6',)
    return plain, OffloadModel(copy.deepcopy(plain).cpu(), device=device, **kwargs)


def _assert_same_buffers(model: OffloadModel, plain: nn.Module) -> None:
    for (name, got), want in zip(model.named_buffers(), plain.buffers()):
        # Bits: a sign of zero or a NaN payload counts.
        assert torch.equal(got.to(want.device).view(torch.int32), want.view(torch.int32)), name


def _train_steps(plain: nn.Sequential, model: OffloadModel, device: str, steps: int = 2) -> None:
    num_microbatches = model.num_microbatches
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, fused=True)
    opt_model = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(6, 6, generator=generator).to(device)
        want = microbatched_reference(plain, model.partition, x, num_microbatches)
        got = model(x)
        torch.testing.assert_close(got, want, **EXACT)
        want.pow(2).sum().backward()
        got.pow(2).sum().backward()
        assert_same_grads(model, plain, **EXACT)
        _assert_same_buffers(model, plain)
        opt_plain.step()
        opt_model.step()
        opt_plain.zero_grad()
        opt_model.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_buffers_written_unseen_train_as_the_plain_model(device: str, activations: str, num_microbatches: int) -> None:
    """Outputs, gradients (the recompute finds the buffers as forward did) and buffers, bit for
    bit, over steps; then eval outputs, which read the statistics."""
    plain, model = _pair(device, num_microbatches=num_microbatches, **ACTIVATIONS[activations])
    _train_steps(plain, model, device)
    plain.eval()
    model.eval()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        want = microbatched_reference(plain, model.partition, x, num_microbatches)
        torch.testing.assert_close(model(x), want, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_written_unseen_in_a_resident_slice(device: str) -> None:
    plain, model = _pair(device, resident_slices=4, checkpoint_activation=True, num_microbatches=3)
    _train_steps(plain, model, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_a_training_forward_without_autograd_writes_them_back(device: str, grad_mode: str) -> None:
    plain, model = _pair(device, num_microbatches=2)
    x = torch.randn(6, 6, generator=torch.Generator().manual_seed(1)).to(device)
    with getattr(torch, grad_mode)():
        want = microbatched_reference(plain, model.partition, x, 2)
        torch.testing.assert_close(model(x), want, **EXACT)
    _assert_same_buffers(model, plain)


@pytest.mark.parametrize("device", DEVICES)
def test_a_mode_probed_unchanged_does_not_hide_another(device: str) -> None:
    """Eval runs change nothing; the first training run after them is a mode of its own, probed
    anew; so is a layer switched alone (its module's flag is part of the mode)."""
    plain, model = _pair(device, checkpoint_activation=True)
    x = torch.randn(6, 6, generator=torch.Generator().manual_seed(1)).to(device)
    for mode in (plain, model):
        mode.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), **EXACT)
    for module in (plain, model):
        module.train()
        module[1].eval()  # the EMA alone stays in eval: only the norm updates
    _train_steps(plain, model, device, steps=1)
    for module in (plain, model):
        module[1].train()
    _train_steps(plain, model, device, steps=1)


def _count(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(SlotBuffers, name)

    def counted(self, index, *args):
        calls.append(index)
        return original(self, index, *args)

    monkeypatch.setattr(SlotBuffers, name, counted)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_the_probe_runs_once_a_slice_and_mode(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One comparison (one blocking read) per slice that holds buffers and mode, whatever the
    number of steps and microbatches; recomputes in backward run in the forward's mode."""
    plain, model = _pair(device, checkpoint_activation=True, num_microbatches=3)
    probes = _count(monkeypatch, "changed_since")
    _train_steps(plain, model, device, steps=3)
    # Slices 1 and 3 hold the EMA and the norm; the mode: grad enabled, training.
    assert sorted(probes) == [1, 3]
    for module in (plain, model):
        module.eval()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(4, 6, device=device))
    assert sorted(probes) == [1, 1, 3, 3]


class Untouched(nn.Module):
    """Holds buffers it never writes: NaN (a mask) and negative zero."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([float("nan"), 1.0, -0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nan_to_num(self.mask).sum()


class FlipsZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("zero", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.zero.data.mul_(-1.0)  # 0.0 to -0.0 and back: equal as numbers, not as bits
        return x


@pytest.mark.parametrize("device", DEVICES)
def test_the_probe_compares_bits(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN left as it was is no change (no write-back at any forward); a sign of zero flipped is one."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Sequential(nn.Linear(3, 3), Untouched()),
                          nn.Sequential(FlipsZero(), nn.Linear(3, 1))).to(device)
    model = OffloadModel(list(copy.deepcopy(plain).cpu()), device=device)
    written = _count(monkeypatch, "write_back_buffers")
    for _ in range(3):
        x = torch.randn(2, 3, device=device)
        plain(x).sum().backward()
        model(x).sum().backward()
    assert written == [1, 1, 1]
    _assert_same_buffers(model, plain)
