"""OffloadOptimizer with optimizer classes that keep state per group, and with the optimizer's
``state_dict`` / ``load_state_dict`` hooks through ``state_dict()`` and through checkpoints.

A class that writes into its group is refused (Note: [State kept per group] in
``offload/tiers/slice_update.py``), and the built-in classes still match the plain optimizer bit
for bit; a save and a load run the hooks as ``state_dict()`` and ``load_state_dict()`` do (Note:
[State dict hooks in a checkpoint] in ``offload/checkpoint/contents.py``), and a load pre-hook gets
a copy of the caller's dict, as ``torch.optim``'s does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import (DiskTier, HostUpdateError, OffloadModel, OffloadOptimizer, load_checkpoint,
                     save_checkpoint)
from offload.tiers.slice_update import GroupStateError


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        optimizer.step()


def offloaded(optimizer_class: type[torch.optim.Optimizer], **kwargs) -> tuple[OffloadModel, OffloadOptimizer]:
    model = OffloadModel(network(), device="cpu", num_slices=3)
    return model, OffloadOptimizer(model, optimizer_class, **kwargs)


def assert_same_training(model: nn.Module, optimizer: torch.optim.Optimizer, plain_model: nn.Module,
                         plain: torch.optim.Optimizer) -> None:
    """Parameters and ``state_dict()`` bit-identical."""
    for (name, want), got in zip(plain_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(optimizer.state_dict(), plain.state_dict(), rtol=0, atol=0)


# -- classes that keep state per group ---------------------------------------------------------------


class WarmupSGD(torch.optim.SGD):
    """SGD whose learning rate ramps up over ``warmup`` steps, counted in the group (as timm's Lamb
    counts ``group["step"]``)."""

    def __init__(self, params, lr: float, warmup: int = 4) -> None:
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group.setdefault("warmup", warmup)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            scale = min(1.0, group["step"] / group["warmup"])
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)


class AdaptiveSGD(torch.optim.SGD):
    """SGD that grows a distance estimate ``d`` kept in its group (as Prodigy and D-Adaptation do),
    only from its third step on: what a check of the first steps alone would miss."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group.setdefault("d", 1.0)
            group.setdefault("k", 0)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["k"] = group["k"]  # written back unchanged: not a change
            if any(self.state[p].setdefault("n", 0) >= 2 for p in group["params"]):
                group["d"] = group["d"] * 1.5
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["n"] += 1
                    p.add_(p.grad, alpha=-group["lr"] * group["d"])


class RewritingAdam(torch.optim.Adam):
    """Adam that writes its hyperparameters back into its group at every step, new objects equal to
    what it read (of the same type): it keeps no state per group."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["lr"] = group["lr"] * 1.0
            group["betas"] = (group["betas"][0], group["betas"][1])
        return super().step(closure)


def test_a_class_that_counts_in_its_group_is_refused_naming_the_way_out():
    model, optimizer = offloaded(WarmupSGD, lr=0.1)
    with pytest.raises(HostUpdateError, match=r"WarmupSGD keeps state in its parameter groups: its step\(\) added "
                                              r"\['step'\].*model\.parameters\(\)") as caught:
        train(model, optimizer, range(2))
        optimizer.synchronize()
    assert isinstance(caught.value.__cause__, GroupStateError)
    assert "step" not in optimizer.param_groups[0]


def test_a_class_that_adapts_a_group_value_after_its_first_steps_is_refused_then():
    model, optimizer = offloaded(AdaptiveSGD, lr=0.1)
    train(model, optimizer, range(2))
    optimizer.synchronize()  # two steps leave d alone: nothing to refuse yet
    with pytest.raises(HostUpdateError, match=r"AdaptiveSGD keeps state in its parameter groups: its step\(\) "
                                              r"changed \['d'\]"):
        train(model, optimizer, range(2, 3))
        optimizer.synchronize()


def test_a_class_that_writes_back_what_it_read_is_not_refused_and_matches_the_plain_one():
    model, optimizer = offloaded(RewritingAdam, lr=1e-2)
    plain_model = network()
    plain = RewritingAdam(plain_model.parameters(), lr=1e-2)
    train(model, optimizer, range(3))
    train(plain_model, plain, range(3))
    assert_same_training(model, optimizer, plain_model, plain)


@pytest.mark.parametrize("optimizer_class, kwargs", [
    (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
    (torch.optim.Adam, {"lr": torch.tensor(1e-2), "betas": (torch.tensor(0.9), torch.tensor(0.99))}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adagrad, {"lr": 1e-2}),
    (torch.optim.NAdam, {}),
    (torch.optim.RAdam, {}),
    (torch.optim.ASGD, {}),
    (torch.optim.Rprop, {}),
    (torch.optim.Adafactor, {}),
], ids=lambda value: value.__name__ if isinstance(value, type) else None)
def test_the_built_in_classes_keep_their_groups_and_match_the_plain_optimizer(optimizer_class, kwargs):
    model, optimizer = offloaded(optimizer_class, **copy.deepcopy(kwargs))
    plain_model = network()
    plain = optimizer_class(plain_model.parameters(), **copy.deepcopy(kwargs))
    train(model, optimizer, range(3))
    train(plain_model, plain, range(3))
    assert_same_training(model, optimizer, plain_model, plain)


# -- state_dict and load_state_dict hooks --------------------------------------------------------------


def add_ema_decay(calls: list[str]):
    """PyTorch's documented pairing: a state_dict post-hook that adds a key..."""
    def hook(optimizer, state_dict):
        calls.append("state_dict post")
        state_dict["ema_decay"] = 0.999
    return hook


def take_ema_decay(calls: list[str]):
    """... and a load_state_dict pre-hook that reads and removes it."""
    def hook(optimizer, state_dict):
        calls.append("load pre")
        optimizer.ema_decay = state_dict.pop("ema_decay")
    return hook


def test_a_load_pre_hook_gets_a_copy_of_the_callers_dict_as_torch_optim_gives_it():
    model, optimizer = offloaded(torch.optim.AdamW, lr=1e-2)
    train(model, optimizer, range(1))
    calls: list[str] = []
    optimizer.register_state_dict_post_hook(add_ema_decay(calls))
    optimizer.register_load_state_dict_pre_hook(take_ema_decay(calls))
    state_dict = optimizer.state_dict()
    optimizer.load_state_dict(state_dict)
    assert state_dict["ema_decay"] == 0.999  # the hook popped it from its copy
    optimizer.load_state_dict(state_dict)  # and a second load finds it
    assert optimizer.ema_decay == 0.999 and calls == ["state_dict post", "load pre", "load pre"]


def test_a_load_pre_hooks_result_replaces_the_dict_even_when_empty_as_torch_optim_does():
    model, optimizer = offloaded(torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW(network().parameters(), lr=1e-2)
    for each in (plain, optimizer):
        state_dict = each.state_dict()
        each.register_load_state_dict_pre_hook(lambda opt, sd: {})
        with pytest.raises(KeyError, match="param_groups"):
            each.load_state_dict(state_dict)


@pytest.mark.parametrize("disk_tier", [False, True], ids=["ram", "disk_tier"])
def test_a_checkpoint_runs_the_state_dict_hooks_and_hands_what_they_add_to_the_load_hooks(tmp_path, disk_tier):
    tier = {"disk_tier": DiskTier(tmp_path / "tier")} if disk_tier else {}
    model, optimizer = offloaded(torch.optim.AdamW, lr=1e-2, **tier)
    calls: list[str] = []
    optimizer.register_state_dict_pre_hook(lambda opt: calls.append("state_dict pre"))
    optimizer.register_state_dict_post_hook(add_ema_decay(calls))
    train(model, optimizer, range(2))
    save_checkpoint(tmp_path / "ckpt", model, optimizer)
    assert calls == ["state_dict pre", "state_dict post"]
    plain_model = network()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    train(plain_model, plain, range(2))
    # A resumed run: a fresh model and optimizer, with the load hook, resume bit for bit.
    resumed_model, resumed = offloaded(torch.optim.AdamW, lr=1e-2)
    resumed.register_load_state_dict_pre_hook(take_ema_decay(calls))
    load_checkpoint(tmp_path / "ckpt", resumed_model, resumed)
    assert resumed.ema_decay == 0.999 and calls[2:] == ["load pre"]
    train(resumed_model, resumed, range(2, 4))
    train(plain_model, plain, range(2, 4))
    assert_same_training(resumed_model, resumed, plain_model, plain)
    optimizer.close()


def test_a_plain_optimizers_checkpoint_runs_its_hooks_too(tmp_path):
    calls: list[str] = []
    model = network()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.register_state_dict_post_hook(add_ema_decay(calls))
    optimizer.register_load_state_dict_pre_hook(take_ema_decay(calls))
    train(model, optimizer, range(2))
    save_checkpoint(tmp_path / "ckpt", model, optimizer)
    load_checkpoint(tmp_path / "ckpt", model, optimizer)
    assert optimizer.ema_decay == 0.999 and calls == ["state_dict post", "load pre"]


def test_a_post_hook_that_returns_a_copy_with_a_key_added_is_kept(tmp_path):
    model, optimizer = offloaded(torch.optim.AdamW, lr=1e-2)
    optimizer.register_state_dict_post_hook(lambda opt, sd: {**copy.deepcopy(sd), "ema_decay": 0.5})
    calls: list[str] = []
    optimizer.register_load_state_dict_pre_hook(take_ema_decay(calls))
    train(model, optimizer, range(1))
    save_checkpoint(tmp_path / "ckpt", model, optimizer)
    load_checkpoint(tmp_path / "ckpt", model, optimizer)
    assert optimizer.ema_decay == 0.5


@pytest.mark.parametrize("change", ["state", "groups"])
def test_a_post_hook_that_changes_the_state_or_the_groups_refuses_the_save_before_anything_is_written(tmp_path,
                                                                                                      change):
    model, optimizer = offloaded(torch.optim.AdamW, lr=1e-2)
    train(model, optimizer, range(1))

    def halve(opt, state_dict):
        if change == "state":
            state_dict["state"][0]["exp_avg"] = state_dict["state"][0]["exp_avg"].to(torch.bfloat16)
        else:
            state_dict["param_groups"][0].pop("amsgrad")

    optimizer.register_state_dict_post_hook(halve)
    held = optimizer.state[next(model.parameters())]["exp_avg"].clone()
    with pytest.raises(ValueError, match=r"post-hook of the optimizer changed (the state of parameter 0|parameter "
                                         r"group 0)\. save_checkpoint saves the optimizer's state and groups as the "
                                         r"optimizer holds them"):
        save_checkpoint(tmp_path / "ckpt", model, optimizer)
    assert not (tmp_path / "ckpt").exists()
    # The hook changed a copy, never the optimizer's own state.
    torch.testing.assert_close(optimizer.state[next(model.parameters())]["exp_avg"], held, rtol=0, atol=0)
    assert "amsgrad" in optimizer.param_groups[0]
