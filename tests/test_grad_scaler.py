"""offload.GradScaler (offload/grad_scaler.py): the plain scaler's results bit for bit, and correct
where the plain scaler's non-blocking copies to the host land late (a fake of such copies on the
CPU; the real race is in tests/test_cuda.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import offload
from offload import OffloadModel, OffloadOptimizer
from offload import grad_scaler as grad_scaler_module

from .helpers import CUDA

EXACT = {"rtol": 0.0, "atol": 0.0}
# The plain SGD and AdamW here step host parameters per tensor on purpose (the scaler's unfused path).
pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


class LateCopies:
    """Non-blocking copies to the host that have not landed when ``to`` returns: the new tensor
    holds what the pinned block held before (``stale``) until :meth:`land`, which then writes
    the copied value over whatever the CPU wrote into it meanwhile, as a late DMA would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stale: float = 1.0) -> None:
        self.stale = stale
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        real_to = torch.Tensor.to

        def late_to(tensor: torch.Tensor, *args, **kwargs):
            out = real_to(tensor, *args, **kwargs)
            if kwargs.get("non_blocking") and out.device.type == "cpu" and out is not tensor:
                self.pending.append((out, out.clone()))
                out.fill_(self.stale)
            return out

        monkeypatch.setattr(torch.Tensor, "to", late_to)

    def land(self) -> None:
        for out, value in self.pending:
            out.copy_(value)
        self.pending.clear()


def run(scaler_class, optimizer_of, steps, unscale, late=None):
    """Train a copy of ``network()`` offloaded on the CPU with ``scaler_class``; each entry of
    ``steps`` is True for a step whose loss overflows. Returns the parameters and scales."""
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = optimizer_of(model)
    scaler = scaler_class("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for overflow in steps:
        x = torch.randn(8, 12)
        if overflow:
            x[2, 3] = float("inf")
        optimizer.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        if unscale:
            scaler.unscale_(optimizer)
        if late is not None:
            late.land()  # the copies land before step() reads the flag: too late for the unscale
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    if isinstance(optimizer, OffloadOptimizer):
        optimizer.synchronize()
    return [p.detach().clone() for p in model.parameters()], scales


OPTIMIZERS = {
    "sgd": lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
    "adamw-fused": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
    "offload-adamw": lambda model: OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2),
    "offload-adamw-fused": lambda model: OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True),
}
STEPS = [False, True, False, False, True, False]


@pytest.mark.parametrize("unscale", [True, False], ids=["unscale", "step-only"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_results_are_the_plain_scalers_bit_for_bit(optimizer, unscale):
    torch.manual_seed(1)
    want = run(torch.amp.GradScaler, OPTIMIZERS[optimizer], STEPS, unscale)
    torch.manual_seed(1)
    got = run(offload.GradScaler, OPTIMIZERS[optimizer], STEPS, unscale)
    for p, q in zip(got[0], want[0]):
        torch.testing.assert_close(p, q, **EXACT)
    assert got[1] == want[1]
    assert want[1][1] < want[1][0]  # the overflows did back the scale off


@pytest.mark.parametrize("unscale", [True, False], ids=["unscale", "step-only"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_late_host_copies_change_nothing_for_offload_grad_scaler(optimizer, unscale, monkeypatch):
    torch.manual_seed(1)
    want = run(torch.amp.GradScaler, OPTIMIZERS[optimizer], STEPS, unscale)
    late = LateCopies(monkeypatch)
    torch.manual_seed(1)
    got = run(offload.GradScaler, OPTIMIZERS[optimizer], STEPS, unscale, late)
    for p, q in zip(got[0], want[0]):
        torch.testing.assert_close(p, q, **EXACT)
    assert got[1] == want[1]


def test_late_host_copies_break_the_plain_scaler(monkeypatch):
    """The fake can fail: the plain scaler unscales by the stale block and loses the overflow."""
    torch.manual_seed(1)
    want = run(torch.amp.GradScaler, OPTIMIZERS["sgd"], STEPS, unscale=True)
    late = LateCopies(monkeypatch)
    torch.manual_seed(1)
    got = run(torch.amp.GradScaler, OPTIMIZERS["sgd"], STEPS, unscale=True, late=late)
    assert got[1] != want[1]  # an overflow went unnoticed: the scale never backed off
    assert any(not torch.equal(p, q) for p, q in zip(got[0], want[0]))


def frozen_body_run(scaler_class, offloaded, unscale):
    """A body frozen while its head warms up (one scaler over two fused AdamW, the body's with no
    gradients), then trained with it; the second and fifth losses overflow. Returns the body's and
    the head's parameters and the scaler's state after each step."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
    head = nn.Linear(16, 2)
    if offloaded:
        body = OffloadModel(body, device="cpu", num_slices=2)
        body_optimizer = OffloadOptimizer(body, torch.optim.AdamW, lr=1e-2, fused=True)
    else:
        body_optimizer = torch.optim.AdamW(body.parameters(), lr=1e-2, fused=True)
    head_optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2, fused=True)
    scaler = scaler_class("cpu", init_scale=2.0**8, growth_interval=2)
    inputs = torch.randn(6, 4, 8, generator=torch.Generator().manual_seed(1))
    states = []
    for step, x in enumerate(inputs):
        body.requires_grad_(step >= 3)
        loss = head(body(x)).pow(2).mean() * (float("inf") if step in (1, 4) else 1.0)
        scaler.scale(loss).backward()
        for optimizer in (body_optimizer, head_optimizer):
            if unscale:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
        scaler.update()
        body_optimizer.zero_grad()
        head_optimizer.zero_grad()
        states.append(scaler.state_dict())
    if offloaded:
        body_optimizer.synchronize()
    return [p.detach().clone() for p in [*body.parameters(), *head.parameters()]], states


@pytest.mark.parametrize("unscale", [False, True], ids=["step-only", "unscale"])
@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, offload.GradScaler], ids=["torch", "offload"])
def test_a_fused_step_with_no_gradients_is_the_plain_ones(scaler_class, unscale):
    """With no gradient checked, the scaler hands a fused optimizer ``found_inf = sum([])``, the
    int 0: the plain fused AdamW never reads it; the OffloadOptimizer's copy of it to the host raised."""
    want = frozen_body_run(torch.amp.GradScaler, offloaded=False, unscale=unscale)
    got = frozen_body_run(scaler_class, offloaded=True, unscale=unscale)
    for p, q in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(p, q, **EXACT)
    assert got[1] == want[1]
    assert want[1][1]["scale"] < want[1][0]["scale"] and want[1][4]["scale"] < want[1][3]["scale"]  # overflows seen


def test_offload_grad_scaler_hands_a_flag_when_no_gradient_was_checked():
    """Where the parent hands ``sum([])``, the int 0, an optimizer that reads the flag gets a float32 zero."""
    model = nn.Linear(4, 4)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    handed = []
    optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: handed.append(optimizer.found_inf))
    scaler = offload.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    scaler.step(optimizer)
    assert torch.is_tensor(handed[0]) and handed[0].dtype == torch.float32 and handed[0].item() == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_state_dict_moves_between_the_scalers():
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_interval=3)
    ours = offload.GradScaler("cpu")
    ours.load_state_dict(plain.state_dict())
    assert ours.state_dict() == plain.state_dict()


def plain_scaler_steps(scaler_class, monkeypatch):
    # The warning needs a scale on the device; on the CPU, say that the CPU scale is one.
    monkeypatch.setattr(grad_scaler_module, "_warned", False)
    monkeypatch.setattr(grad_scaler_module, "_scale_on_a_device", lambda scaler: True)
    grad_scaler_module.warn_about_plain_grad_scalers()
    model = OffloadModel(network(), device="cpu", num_slices=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_class("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(4, 12)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
    return [str(w.message) for w in caught if "GradScaler" in str(w.message)]


def test_a_plain_scaler_over_host_gradients_warns_once(monkeypatch):
    messages = plain_scaler_steps(torch.amp.GradScaler, monkeypatch)
    assert len(messages) == 1 and "offload.GradScaler" in messages[0]


def test_offload_grad_scaler_does_not_warn(monkeypatch):
    assert plain_scaler_steps(offload.GradScaler, monkeypatch) == []


@CUDA
@pytest.mark.parametrize("fused", [False, True])
def test_offload_grad_scaler_unscales_host_gradients_while_the_stream_is_busy(fused):
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)), device="cuda", num_slices=2)
    scaler = offload.GradScaler("cuda", init_scale=2.0**10)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=0.1, fused=fused)
    scaler.scale(model(torch.randn(8, 64, device="cuda")).sum()).backward()
    expected = [p.grad / 2.0**10 for p in model.parameters()]
    torch.cuda._sleep(100_000_000)  # tens of milliseconds of work queued ahead of the scaler's copy
    scaler.unscale_(optimizer)
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, want, **EXACT)
    # An overflow with the stream busy is still seen: the step is skipped, the scale backs off.
    before = [p.detach().clone() for p in model.parameters()]
    scaler.update()
    optimizer.zero_grad()
    x = torch.randn(8, 64, device="cuda")
    x[0, 0] = float("inf")
    scaler.scale(model(x).sum()).backward()
    torch.cuda._sleep(100_000_000)
    scaler.step(optimizer)
    scaler.update()
    optimizer.synchronize()
    assert scaler.get_scale() == 2.0**9
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)


@CUDA
def test_a_plain_scaler_with_an_offload_model_on_cuda_warns():
    model = OffloadModel(copy.deepcopy(network()), device="cuda", num_slices=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    grad_scaler_module._warned = False
    scaler.scale(model(torch.randn(4, 12, device="cuda")).sum()).backward()
    with pytest.warns(RuntimeWarning, match="offload.GradScaler"):
        scaler.step(optimizer)


def test_the_warning_hook_keeps_nothing_of_the_callers_frame_alive():
    # The hook looks for a calling scaler up the stack: reading the training loop's locals would
    # leave them on its frame, so an optimizer (or a tensor) deleted there would stay alive.
    import gc
    import weakref

    grad_scaler_module.warn_about_plain_grad_scalers()
    layer = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    alive = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert alive() is None
