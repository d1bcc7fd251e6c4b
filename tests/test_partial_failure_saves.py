"""After an update that failed part way, saves refuse until loads replaced both the optimizer's
state and the model's parameters: the optimizer's ``load_state_dict()`` alone leaves the
parameters mixing two steps, and the refusal says to load them; with the model's
``load_state_dict()`` too (either order), or ``load_checkpoint``, training goes on as the plain
optimizer's, bit for bit. See rule 4 of Note: [An update that failed part way] in
offload/optimizing/partial_failure.py."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from torch import nn

from offload import HostUpdateError, OffloadModel, OffloadOptimizer, latest_checkpoint, load_checkpoint, save_checkpoint

from .test_optimizer import assert_same

STATE_ONLY = (r"Its state was loaded since, but not the model's parameters, which still hold that mix: "
              r"{doing} would use them")
PARAMETERS_ONLY = r"The model's parameters were loaded since, but not the optimizer's state: {doing} would use it"
NEITHER = r"{doing} would use that mix; load the last checkpoint first"
MIX = r"mix two steps: an update failed part way: slice\(s\) 0 updated, slice\(s\) 1 raised in its update"


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])


def by_slice(model: nn.Module) -> list[dict]:
    """One parameter group per slice (three slices of two layers)."""
    return [{"params": [p for k in pair for p in getattr(model, str(k)).parameters()]}
            for pair in ((0, 1), (2, 3), (4, 5))]


def loss_at(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
    return (model(x) - y).pow(2).mean()


def train_on(runs, steps) -> None:
    for step in steps:
        for model, optimizer in runs:
            loss_at(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()


def failed_part_way(tmp_path, raised_by_save: bool = True, frozen: tuple[str, ...] = ()):
    """The plain AdamW and an OffloadOptimizer trained two steps (saved as ``step-2``, and their
    state dicts returned), then the OffloadOptimizer's third step updated slice 0 and raised in
    slice 1 (a learning rate it cannot use), leaving slice 2 as it was; the layers ``frozen`` do
    not train."""
    plain, model = layers(), OffloadModel(layers(), device="cpu", num_slices=3)
    for name in frozen:
        getattr(plain, name).requires_grad_(False)
        getattr(model, name).requires_grad_(False)
    plain_optimizer = torch.optim.AdamW(by_slice(plain), lr=1e-2, fused=True)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, by_slice(model), lr=1e-2, fused=True)
    train_on([(plain, plain_optimizer), (model, optimizer)], range(2))
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    parameters = {name: t.clone() for name, t in model.state_dict().items()}
    state = optimizer.state_dict()
    state["state"] = {k: {key: v.clone() for key, v in s.items()} for k, s in state["state"].items()}
    loss_at(model, 2).backward()
    optimizer.param_groups[1]["lr"] = "not a number"
    optimizer.step()
    optimizer.param_groups[1]["lr"] = 1e-2
    optimizer.zero_grad()
    with pytest.raises(HostUpdateError, match="while updating slice 1"):
        if raised_by_save:
            save_checkpoint(tmp_path / "step-3", model, optimizer)  # latches the mix, and refuses it after
        else:
            optimizer.synchronize()  # latches nothing yet
    return plain, plain_optimizer, model, optimizer, parameters, state


def assert_refused(tmp_path, model, optimizer, said: str) -> None:
    """``save_checkpoint`` and ``state_dict()`` refuse, saying ``said``; ``latest`` still names ``step-2``."""
    for _ in range(2):  # remembered, not said once
        with pytest.raises(RuntimeError, match=MIX + ".*" + said.format(doing=r"save_checkpoint\(\)")):
            save_checkpoint(tmp_path / "step-3", model, optimizer, keep_last=1)
        with pytest.raises(RuntimeError, match=MIX + ".*" + said.format(doing=r"state_dict\(\)")):
            optimizer.state_dict()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-2"]


def assert_trains_on(tmp_path, plain, plain_optimizer, model, optimizer) -> None:
    """Saves go through, and training on is the plain optimizer's (which never failed), bit for bit."""
    save_checkpoint(tmp_path / "reloaded", model, optimizer)
    train_on([(plain, plain_optimizer), (model, optimizer)], range(2, 5))
    assert_same(plain, plain_optimizer, model, optimizer)
    save_checkpoint(tmp_path / "step-5", model, optimizer)


@pytest.mark.parametrize("raised_by_save", [True, False], ids=["refused-before", "latched-by-the-load"])
def test_the_optimizers_load_alone_keeps_refusing_until_the_models_parameters_are_loaded(tmp_path, raised_by_save):
    """The reproducer's case: ``optimizer.load_state_dict()`` of the state before the step leaves
    the parameters mixing two steps, so saves refuse, saying what is still missing (also when no
    save had latched the mix before the load); the model's ``load_state_dict()`` of the parameters
    before it ends the refusal, and training on is the plain optimizer's, bit for bit."""
    plain, plain_optimizer, model, optimizer, parameters, state = failed_part_way(tmp_path, raised_by_save)
    optimizer.load_state_dict(state)
    assert_refused(tmp_path, model, optimizer, STATE_ONLY)
    model.load_state_dict(parameters)
    assert_trains_on(tmp_path, plain, plain_optimizer, model, optimizer)


def test_the_models_load_first_refuses_until_the_optimizers(tmp_path):
    """Loaded the other way round, the model's parameters first: saves refuse, saying the state is
    missing, until the optimizer's ``load_state_dict()``; then training on is bit for bit."""
    plain, plain_optimizer, model, optimizer, parameters, state = failed_part_way(tmp_path)
    model.load_state_dict(parameters)
    assert_refused(tmp_path, model, optimizer, PARAMETERS_ONLY)
    optimizer.load_state_dict(state)
    assert_trains_on(tmp_path, plain, plain_optimizer, model, optimizer)


def test_load_checkpoint_after_the_optimizers_load_ends_the_refusal(tmp_path):
    """``load_checkpoint`` replaces both, also after the optimizer's load alone: training on is bit for bit."""
    plain, plain_optimizer, model, optimizer, _, state = failed_part_way(tmp_path)
    optimizer.load_state_dict(state)
    assert_refused(tmp_path, model, optimizer, STATE_ONLY)
    load_checkpoint(latest_checkpoint(tmp_path), model, optimizer)
    assert_trains_on(tmp_path, plain, plain_optimizer, model, optimizer)


def test_a_load_of_the_parameters_that_train_is_enough(tmp_path):
    """Frozen parameters get no gradient, and no update changes them: a model load of the others
    alone (``strict=False``, as an adapter's) replaces the mix."""
    plain, plain_optimizer, model, optimizer, parameters, state = failed_part_way(tmp_path, frozen=("1", "4"))
    optimizer.load_state_dict(state)
    model.load_state_dict({k: v for k, v in parameters.items() if not k.startswith(("1.", "4."))}, strict=False)
    assert_trains_on(tmp_path, plain, plain_optimizer, model, optimizer)


def test_a_load_of_part_of_the_parameters_or_a_step_between_the_loads_replaces_nothing(tmp_path):
    """A model load that leaves a parameter out (``strict=False``) did not replace the mix; neither
    did loads with a ``step()`` between them, which updates each from the other's mix (not
    refused: training on is the caller's choice)."""
    _, _, model, optimizer, parameters, state = failed_part_way(tmp_path)
    optimizer.load_state_dict(state)
    model.load_state_dict({k: v for k, v in parameters.items() if k != "4.0.bias"}, strict=False)
    assert_refused(tmp_path, model, optimizer, STATE_ONLY)
    loss_at(model, 2).backward()
    optimizer.step()
    optimizer.zero_grad()
    model.load_state_dict(parameters)
    assert_refused(tmp_path, model, optimizer, PARAMETERS_ONLY)


def test_a_watched_layer_still_pickles_and_its_copy_tells_nothing(tmp_path):
    """The load hooks on the layers: a pickled layer's watch nothing, and a load into a deep copy
    of the model's layers is not a load into the model."""
    _, _, model, optimizer, parameters, state = failed_part_way(tmp_path)
    pickle.loads(pickle.dumps(getattr(model, "0"))).load_state_dict(getattr(model, "0").state_dict())
    optimizer.load_state_dict(state)
    copied = torch.nn.Sequential(*[getattr(model, str(k)) for k in range(6)])
    copy.deepcopy(copied).load_state_dict(parameters)
    assert_refused(tmp_path, model, optimizer, STATE_ONLY)
