"""A step the plain optimizer refuses before changing anything is refused by ``step()`` before any
slice's update, with the plain class's exception and message; nothing is updated and nothing is
latched (Note: [A step refused as a whole] in offload/optimizing/whole_step.py). What a slice's
update raises says why in the ``HostUpdateError`` itself, not only in its ``__cause__``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import HostUpdateError, OffloadModel, OffloadOptimizer, save_checkpoint
from offload.tiers.slice_update import SAID_AT_MOST

EXACT = {"rtol": 0.0, "atol": 0.0}


class ComplexLinear(nn.Module):
    """A layer with a complex64 weight, which ``fused=True`` refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.complex64) @ self.weight


def complex_layers() -> nn.Sequential:
    """A real layer (slice 0 of two), then a complex one (slice 1)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), ComplexLinear())


def complex_loss(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).abs().sum()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())


def assert_unchanged(model: nn.Module, optimizer: torch.optim.Optimizer, before) -> None:
    params, state = before
    for (name, p), old in zip(model.named_parameters(), params):
        torch.testing.assert_close(p, old, **EXACT, msg=lambda m: f"{name}: {m}")
    now = optimizer.state_dict()  # not refused: nothing is latched
    assert now["param_groups"] == state["param_groups"]
    assert now["state"].keys() == state["state"].keys()
    for k, values in state["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(now["state"][k][key], value, **EXACT)


REFUSED = [
    pytest.param(torch.optim.AdamW, {"fused": True}, id="AdamW-fused"),
    pytest.param(torch.optim.SGD, {"fused": True, "momentum": 0.9}, id="SGD-fused"),
    pytest.param(torch.optim.Adagrad, {"fused": True}, id="Adagrad-fused"),
    pytest.param(torch.optim.AdamW, {"capturable": True}, id="AdamW-capturable-on-cpu",
                 marks=pytest.mark.filterwarnings("ignore:AdamW is stepping")),  # per-tensor: about speed only
]


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["step", "in-backward"])
@pytest.mark.parametrize("cls, kwargs", REFUSED)
def test_a_step_the_plain_optimizer_refuses_is_refused_before_any_slice_changes(cls, kwargs, update_in_backward,
                                                                                 tmp_path):
    plain = complex_layers()
    plain_optimizer = cls(plain.parameters(), lr=0.1, **kwargs)
    complex_loss(plain).backward()
    with pytest.raises(Exception) as plain_raised:
        plain_optimizer.step()

    model = OffloadModel(complex_layers(), device="cpu", num_slices=2)
    optimizer = OffloadOptimizer(model, cls, lr=0.1, update_in_backward=update_in_backward, **kwargs)
    before = snapshot(model, optimizer)
    complex_loss(model).backward()
    with pytest.raises(type(plain_raised.value)) as raised:
        optimizer.step()
    assert str(raised.value) == str(plain_raised.value)
    optimizer.synchronize()  # no update ran, so none raises
    assert_unchanged(model, optimizer, before)
    save_checkpoint(tmp_path / "after-the-refusal", model, optimizer)
    # The refusal is the plain one's at every step, not the first only.
    with pytest.raises(type(plain_raised.value), match="."):
        optimizer.step()
    assert_unchanged(model, optimizer, before)


def test_a_later_groups_refusal_is_left_to_its_slice_and_says_why():
    """The plain optimizer updates the first group before it refuses the second: that refusal comes
    from the slice's update, as a HostUpdateError whose message says why."""
    def groups(model: nn.Module) -> list[dict]:
        return [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}]

    plain = complex_layers()
    plain_optimizer = torch.optim.AdamW(groups(plain), lr=0.1, fused=True)
    complex_loss(plain).backward()
    with pytest.raises(RuntimeError) as plain_raised:
        plain_optimizer.step()

    model = OffloadModel(complex_layers(), device="cpu", num_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, groups(model), lr=0.1, fused=True)
    complex_loss(model).backward()
    optimizer.step()
    with pytest.raises(HostUpdateError, match="while updating slice 1") as raised:
        optimizer.synchronize()
    assert f"(RuntimeError: {plain_raised.value})" in str(raised.value)
    for name, p in model[0].named_parameters():
        torch.testing.assert_close(p, dict(plain[0].named_parameters())[name], **EXACT)


class FailsOnTarget(torch.optim.SGD):
    """SGD that raises ``error`` before changing anything when it steps the tensor ``target``."""

    target: torch.Tensor | None = None
    error: Exception | None = None

    def step(self, closure=None):
        target = FailsOnTarget.target
        params = [p for group in self.param_groups for p in group["params"]]
        if target is not None and any(p.data_ptr() == target.data_ptr() for p in params):
            raise FailsOnTarget.error
        return super().step(closure)


LONG = "x" * (SAID_AT_MOST + 100)


@pytest.mark.parametrize("message, said", [
    pytest.param("no memory for a temporary (simulated)", "(MemoryError: no memory for a temporary (simulated))",
                 id="one-line"),
    pytest.param("the first line\nthe second line", "(MemoryError: the first line ...)", id="two-lines"),
    pytest.param(LONG, f"(MemoryError: {LONG[:SAID_AT_MOST]} ...)", id="long"),
])
@pytest.mark.parametrize("where", ["slice", "outside"])
def test_a_failed_update_says_why_in_its_own_message(where, message, said):
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), device="cpu", num_slices=2)
    head = nn.Parameter(torch.randn(4, 2))
    optimizer = OffloadOptimizer(model, FailsOnTarget, [*model.parameters(), head], lr=0.1)
    (model(torch.randn(3, 4)) @ head).sum().backward()
    FailsOnTarget.target = head if where == "outside" else model[2].weight
    FailsOnTarget.error = MemoryError(message)
    try:
        with pytest.raises(HostUpdateError) as raised:
            optimizer.step()
            optimizer.synchronize()
    finally:
        FailsOnTarget.target = FailsOnTarget.error = None
    text = str(raised.value)
    assert said in text
    assert ("the parameters outside the model" if where == "outside" else "while updating slice 1") in text
    assert "second line" not in text and LONG not in text
    assert raised.value.__cause__ is not None and str(raised.value.__cause__) == message
