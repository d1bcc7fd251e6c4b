"""Lightning Fabric trains an OffloadModel as it trains the plain model, bit for bit.

Every comparison runs the same Fabric loop twice: over the plain layers with ``torch.optim.AdamW``
and over an OffloadModel of the same layers (same seed, same data) with an OffloadOptimizer, and
compares losses and weights with ``torch.equal``. The loop is Fabric's: ``fabric.setup``,
``fabric.backward``, ``fabric.clip_gradients``, accumulation under ``fabric.no_backward_sync``,
``fabric.save`` / ``fabric.load``. The rest checks what offload does when given the objects
``fabric.setup`` returns (a ``_FabricModule``, a ``_FabricOptimizer``): the optimizer's state read
through Fabric's wrapper, ``offload.save_checkpoint`` / ``load_checkpoint`` of them, and an
OffloadOptimizer built from ``fabric.setup_module``'s result. One process, on the CPU; no DDP (a
two-process gloo run matched the plain model by hand: docs/lightning.md, "Lightning Fabric").
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import offload
from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of

pytest.importorskip("lightning", reason='lightning is not installed: pip install -e ".[lightning]"')
from lightning.fabric import Fabric  # noqa: E402  (needs lightning)

from .test_lightning import llama  # noqa: E402  (needs lightning)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def mse_batches(n: int = 6) -> list[Any]:
    g = torch.Generator().manual_seed(2)
    return [(lambda m, x=torch.randn(4, 8, generator=g), y=torch.randn(4, 4, generator=g):
             nn.functional.mse_loss(m(x), y)) for _ in range(n)]


def token_batches(n: int = 4) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 97, (4, 10), generator=g) for _ in range(n)]
    return [(lambda m, i=i: m(input_ids=i, labels=i).loss) for i in ids]


def fabric_of(precision: str = "32-true") -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    fabric.seed_everything(123, verbose=False)
    return fabric


def build(kind: str, offloaded: bool) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """The plain model (what is compared), the model to train, and its optimizer: an OffloadOptimizer over
    an OffloadModel (an OffloadedCausalLM for ``kind="llama"``), else AdamW over the plain model."""
    plain = mlp() if kind == "mlp" else llama()
    if not offloaded:
        return plain, plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    if kind == "mlp":
        net = OffloadModel(plain, device="cpu", num_slices=3)
    else:
        from offload.integrations.causal_lm import OffloadedCausalLM
        net = OffloadedCausalLM(plain, device="cpu", num_slices=3)
    return plain, net, OffloadOptimizer(net, torch.optim.AdamW, lr=1e-2, fused=True)


def train(fabric: Fabric, model: Any, optimizer: Any, batches: list[Any], clip: float | None, accumulation: int,
          scheduler: Any = None) -> list[torch.Tensor]:
    losses = []
    for i, loss_of in enumerate(batches):
        last = (i + 1) % accumulation == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = loss_of(model)
            fabric.backward(loss / accumulation)
        losses.append(loss.detach())
        if last:
            if clip is not None:
                fabric.clip_gradients(model, optimizer, max_norm=clip)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return losses


def run(kind: str, offloaded: bool, precision: str = "32-true", clip: float | None = 1.0,
        accumulation: int = 2) -> tuple[nn.Module, list[torch.Tensor]]:
    fabric = fabric_of(precision)
    plain, net, optimizer = build(kind, offloaded)
    model, optimizer = fabric.setup(net, optimizer)
    losses = train(fabric, model, optimizer, mse_batches() if kind == "mlp" else token_batches(), clip, accumulation)
    if offloaded:
        optimizer.synchronize()  # the plain layers are read below (docs/lightning.md)
    return plain, losses


def assert_equal_states(got: nn.Module, expected: nn.Module) -> None:
    got_state, expected_state = got.state_dict(), expected.state_dict()
    assert list(got_state) == list(expected_state)
    for name, tensor in expected_state.items():
        assert torch.equal(got_state[name], tensor), name


def assert_same_run(got: tuple[nn.Module, list[torch.Tensor]], expected: tuple[nn.Module, list[torch.Tensor]]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
    assert_equal_states(got[0], expected[0])


@pytest.mark.parametrize(("clip", "accumulation"), [(None, 1), (1.0, 2)])
def test_a_fabric_loop_is_the_plain_models(clip: float | None, accumulation: int) -> None:
    assert_same_run(run("mlp", True, clip=clip, accumulation=accumulation),
                    run("mlp", False, clip=clip, accumulation=accumulation))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_fabric_precisions_are_the_plain_models(precision: str) -> None:
    assert_same_run(run("mlp", True, precision), run("mlp", False, precision))


def test_an_offloaded_causal_lm_under_fabric_is_the_plain_models() -> None:
    assert_same_run(run("llama", True), run("llama", False))


def resumable(offloaded: bool, path: Path, resume: bool) -> nn.Module:
    """Eight steps of the MLP with a scheduler, saved with ``fabric.save`` after four (``resume=False``),
    or the last four after ``fabric.load`` of ``path``."""
    fabric = fabric_of()
    plain, net, optimizer = build("mlp", offloaded)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer = fabric.setup(net, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    batches = mse_batches(8)
    if resume:
        fabric.load(path, state)
        assert state["step"] == 4
    else:
        train(fabric, model, optimizer, batches[:4], 1.0, 1, scheduler)
        fabric.save(path, {**state, "step": 4})
    fabric.seed_everything(999, verbose=False)  # the same generators after the save point in every run
    train(fabric, model, optimizer, batches[4:], 1.0, 1, scheduler)
    if offloaded:
        optimizer.synchronize()
    return plain


def test_fabric_save_and_load_resume_bit_for_bit(tmp_path: Path) -> None:
    expected = resumable(False, tmp_path / "plain.ckpt", resume=False)
    assert_equal_states(resumable(True, tmp_path / "offload.ckpt", resume=False), expected)
    # Either checkpoint resumes either run.
    for saved in ("offload.ckpt", "plain.ckpt"):
        for offloaded in (True, False):
            assert_equal_states(resumable(offloaded, tmp_path / saved, resume=True), expected)


def stepped(optimizer_class: Any = torch.optim.AdamW, **kwargs: Any) -> tuple[OffloadModel, Any, Any, Any]:
    """An OffloadModel, its OffloadOptimizer, and what ``fabric.setup`` returns for them, after two steps."""
    fabric = fabric_of()
    net = OffloadModel(mlp(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(net, optimizer_class, lr=1e-2, **kwargs)
    model, wrapped = fabric.setup(net, optimizer)
    train(fabric, model, wrapped, mse_batches(2), None, 1)
    return net, optimizer, model, wrapped


def test_the_state_reads_through_fabrics_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    net, optimizer, _, wrapped = stepped()
    assert type(wrapped).__name__ == "FabricOffloadOptimizer"  # Fabric's wrapper, with no copy of __dict__
    waits = []
    finish_all = engine_of(net).updates.finish_all
    monkeypatch.setattr(engine_of(net).updates, "finish_all", lambda: (waits.append(1), finish_all())[1])
    state = wrapped.state  # raised KeyError: '_held_state'
    assert waits, "reading the state waits for the pending updates, as on the optimizer itself"
    assert state is optimizer.state and len(state) == 8
    wrapped.load_state_dict(wrapped.state_dict())  # plans anew at the next read by slice
    by_slice = dict(wrapped.state_by_slice())
    assert {index: list(states) for index, states in by_slice.items()} == {
        index: list(states) for index, states in optimizer.state_by_slice()}
    consolidated, own = wrapped.consolidated_state_dict(), optimizer.consolidated_state_dict()
    assert consolidated["param_groups"] == own["param_groups"]
    assert all(torch.equal(consolidated["state"][i]["exp_avg"], own["state"][i]["exp_avg"]) for i in own["state"])
    # The plan and the hooks stay the optimizer's: none is copied onto the wrapper, to go stale there.
    assert not {"_held_state", "_plan_key", "_steps", "_optimizer_state_dict_post_hooks"} & set(vars(wrapped))
    replaced = collections.defaultdict(dict, state)
    wrapped.state = replaced  # set into the box the updates hold, not onto the wrapper
    assert optimizer.state is replaced and wrapped.state is replaced


def test_a_disk_tier_and_a_class_override_through_fabrics_optimizer(tmp_path: Path) -> None:
    class Tagging(torch.optim.AdamW):
        def add_param_group(self, param_group: dict[str, Any]) -> None:
            super().add_param_group({**param_group, "tagged": True})

    _, optimizer, _, wrapped = stepped(Tagging, disk_tier=tmp_path / "tier")
    assert wrapped._tier is optimizer._tier is not None
    wrapped.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})  # the class's own normalisation
    assert optimizer.param_groups[-1]["tagged"] is True
    optimizer.close()


def saved_with(kind: str, path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Save a stepped model and optimizer with ``offload.save_checkpoint``: Fabric's objects (``fabric``),
    the OffloadModel and OffloadOptimizer (``offload``) or the plain ones (``plain``); return what the
    checkpoint holds, as plain objects."""
    fabric = fabric_of()
    plain, net, optimizer = build("mlp", kind != "plain")
    model, wrapped = fabric.setup(net, optimizer)
    train(fabric, model, wrapped, mse_batches(2), None, 1)
    offload.save_checkpoint(path, *((model, wrapped) if kind == "fabric" else (net, optimizer)))
    if kind != "plain":
        optimizer.synchronize()
    return plain, optimizer


def loaded_into(kind: str, path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    fabric = fabric_of()
    plain, net, optimizer = build("mlp", kind != "plain")
    model, wrapped = fabric.setup(net, optimizer)
    offload.load_checkpoint(path, *((model, wrapped) if kind == "fabric" else (net, optimizer)))
    return plain, optimizer


@pytest.mark.parametrize(("save_kind", "load_kind"), [("fabric", "plain"), ("fabric", "offload"),
                                                      ("plain", "fabric"), ("offload", "fabric")])
def test_offload_checkpoints_of_fabrics_objects_load_into_the_plain_ones(tmp_path: Path, save_kind: str,
                                                                          load_kind: str) -> None:
    saved_model, saved_optimizer = saved_with(save_kind, tmp_path / "ckpt")
    model, optimizer = loaded_into(load_kind, tmp_path / "ckpt")
    assert_equal_states(model, saved_model)
    got, expected = optimizer.state_dict(), saved_optimizer.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    for index, values in expected["state"].items():
        assert all(torch.equal(got["state"][index][key], value) for key, value in values.items())


def test_an_offload_optimizer_of_fabrics_module_steps_its_offload_model() -> None:
    def setup_separately(offloaded: bool) -> nn.Module:
        # Fabric's documented order: the module first, the optimizer built from what setup_module returns.
        fabric = fabric_of()
        plain = mlp()
        net = OffloadModel(plain, device="cpu", num_slices=3) if offloaded else plain
        model = fabric.setup_module(net)
        if offloaded:
            optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)  # raised "wrap the model first"
            assert optimizer.model is net
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer = fabric.setup_optimizers(optimizer)
        train(fabric, model, optimizer, mse_batches(4), 1.0, 2)
        if offloaded:
            optimizer.synchronize()
        return plain

    assert_equal_states(setup_separately(True), setup_separately(False))
