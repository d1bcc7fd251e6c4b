"""What a save may take and what it may replace: no state of a step half done (between the backward
that started ``update_in_backward``'s updates and ``step()``: Note: [Copying an OffloadOptimizer],
rule 5, in ``offload/optimizing/copying.py``), and no file that no save wrote (a save onto a
checkpoint, or ``keep_last`` removing one, that also holds a user's files: Note: [What a save
deletes] in ``offload/checkpoint/commit.py``)."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer, latest_checkpoint, load_checkpoint, save_checkpoint

from .test_checkpoint import trained
from .test_optimizer import assert_same, batch

EXACT = {"rtol": 0.0, "atol": 0.0}


# -- between the backward that started updates and step() -----------------------------------------


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))


def built(waiting: str) -> tuple[tuple[nn.Sequential, torch.optim.Optimizer], tuple[OffloadModel, OffloadOptimizer]]:
    """The plain model under ``torch.optim.AdamW``, and its twin offloaded in 3 slices under
    ``OffloadOptimizer(update_in_backward=True)``, whose slice 0 ``waiting`` makes wait for
    ``step()`` (Note: [Update in backward]): ``"none"`` lets backward update every slice."""
    plain = layers()
    if waiting == "tied":  # slice 2's Linear borrows slice 0's weight
        plain[4].weight = plain[0].weight
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3,
                         resident_slices=1 if waiting == "resident" else 0)
    if waiting == "hook":
        model[0].weight.register_hook(lambda grad: grad)
        plain[0].weight.register_hook(lambda grad: grad)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True)
    return (plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)), (model, optimizer)


def backward(module: nn.Module, step: int) -> None:
    module(batch(step)).square().sum().backward()


def train(pair: tuple[nn.Module, torch.optim.Optimizer], steps: range) -> None:
    module, optimizer = pair
    for step in steps:
        backward(module, step)
        optimizer.step()
        optimizer.zero_grad()


def files(directory: Path) -> dict[str, bytes | None]:
    """Every entry under ``directory``, a file's bytes (``None`` for a directory), by relative path."""
    return {str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes() for p in directory.rglob("*")}


WAITS = {"hook": "'weight' of a Linear in slice 0 has a gradient hook",
         "tied": "'weight' of a Linear in slice 0 is tied to another slice",
         "resident": "the slice is resident: step\\(\\) updates it on the device"}


@pytest.mark.parametrize("reading", ["state_dict", "save_checkpoint"])
@pytest.mark.parametrize("waiting", [*WAITS, "none"])
def test_a_step_half_done_is_refused_and_step_then_finishes_it_as_the_plain_optimizer(tmp_path, waiting, reading):
    (plain, plain_optimizer), (model, optimizer) = built(waiting)
    for pair in ((plain, plain_optimizer), (model, optimizer)):
        train(pair, range(2))  # the first backward starts nothing (it only checks); the second does
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    before = files(tmp_path)
    backward(plain, 2)
    backward(model, 2)
    backward_updates = optimizer._in_backward
    assert backward_updates.started == ({1, 2} if waiting in WAITS else {0, 1, 2})
    assert backward_updates.deferred.keys() == ({0} if waiting in WAITS else set())
    # What the slices updated in backward are, what slice 0 waits for, and what to do.
    updated = "slices \\[1, 2\\] are updated; slice 0 waits for step\\(\\): " + WAITS[waiting] \
        if waiting in WAITS else "slices \\[0, 1, 2\\] are updated\\)"
    advice = "call state_dict\\(\\)" if reading == "state_dict" else "save the checkpoint"
    with pytest.raises(RuntimeError, match=f"update_in_backward: backward started this step's updates \\({updated}.*"
                                           f"would mix two steps.*call step\\(\\) first, then {advice}$"):
        if reading == "state_dict":
            optimizer.state_dict()
        else:
            save_checkpoint(tmp_path / "step-3", model, optimizer)
    assert files(tmp_path) == before  # nothing written: no step-3, no hidden leftovers, latest as it was
    plain_optimizer.step()
    optimizer.step()  # finishes the step the refusal left as it was
    assert_same(plain, plain_optimizer, model, optimizer)
    save_checkpoint(tmp_path / "step-3", model, optimizer)
    _, (fresh, fresh_optimizer) = built(waiting)
    load_checkpoint(tmp_path / "step-3", fresh, fresh_optimizer)
    assert_same(plain, plain_optimizer, fresh, fresh_optimizer)


def test_a_backward_that_started_nothing_refuses_nothing(tmp_path):
    """The first backward of an optimizer only checks (Note: [Update in backward]): between it and
    ``step()`` the state is the plain optimizer's, and a save holds it."""
    (plain, plain_optimizer), (model, optimizer) = built("none")
    backward(plain, 0)
    backward(model, 0)
    assert not optimizer._in_backward.started
    assert optimizer.state_dict() == plain_optimizer.state_dict() == {
        "state": {}, "param_groups": plain_optimizer.state_dict()["param_groups"]}
    save_checkpoint(tmp_path / "step-0", model, optimizer)
    plain_optimizer.step()
    optimizer.step()
    assert_same(plain, plain_optimizer, model, optimizer)


# -- a target that also holds what no save wrote ---------------------------------------------------


def users_file(checkpoint: Path) -> None:
    (checkpoint / "NOTES.txt").write_text("lr 1e-2 diverged at step 900")


def users_export(checkpoint: Path) -> None:
    (checkpoint / "hf").mkdir()  # save_pretrained(f"{checkpoint}/hf")
    (checkpoint / "hf" / "config.json").write_text("{}")
    (checkpoint / "hf" / "model.safetensors").write_bytes(b"\0" * 64)


def half_copied(checkpoint: Path) -> None:
    """Only the offload.json of a checkpoint copied by hand, beside the user's README."""
    for entry in checkpoint.iterdir():
        if entry.name != "offload.json":
            entry.unlink()
    (checkpoint / "README").write_text("copied from the cluster")


@pytest.mark.parametrize(("put", "named"), [(users_file, "NOTES\\.txt"), (users_export, "hf/"),
                                            (half_copied, "README")], ids=["file", "export", "half_copied"])
def test_a_save_onto_a_checkpoint_that_also_holds_a_users_files_is_refused(tmp_path, put, named):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "step-1", model, optimizer)
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    put(tmp_path / "step-1")
    before = files(tmp_path)
    with pytest.raises(FileExistsError, match=f"cannot save a checkpoint at .*step-1: it holds a checkpoint's files, "
                                              f"and also {named}, which save_checkpoint did not write; a save "
                                              "replaces the whole directory.*Move those out of"):
        save_checkpoint(tmp_path / "step-1", model, optimizer)
    assert files(tmp_path) == before  # the user's files, the checkpoints and latest: all as they were


@pytest.mark.parametrize("left", ["whole", "offload_json_only", "empty"])
def test_a_save_onto_a_checkpoint_of_only_its_own_files_replaces_it(tmp_path, left):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    if left == "offload_json_only":  # damaged, but nothing in it is the user's
        for entry in (tmp_path / "step-2").iterdir():
            if entry.name != "offload.json":
                entry.unlink()
    elif left == "empty":
        shutil.rmtree(tmp_path / "step-2")
        (tmp_path / "step-2").mkdir()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()  # the saved run moves on: the save must hold the new state, not the old
    optimizer.zero_grad()
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    assert sorted(os.listdir(tmp_path / "step-2")) == [".metadata", "__0_0.distcp", "offload.json"]
    fresh, fresh_optimizer = trained()
    load_checkpoint(tmp_path / "step-2", fresh, fresh_optimizer)
    assert_same(model, optimizer, fresh, fresh_optimizer)


def test_a_directory_of_dcp_files_without_offload_json_is_not_a_checkpoint(tmp_path):
    """Another program's DCP checkpoint holds the names a save writes, but no offload.json: not ours to replace."""
    model, optimizer = trained()
    save_checkpoint(tmp_path / "theirs", model, optimizer)
    (tmp_path / "theirs" / "offload.json").unlink()
    before = files(tmp_path)
    with pytest.raises(FileExistsError, match=r"it is a directory that holds files but no offload\.json "
                                              r"\(\.metadata, __0_0\.distcp\), so it is not a checkpoint"):
        save_checkpoint(tmp_path / "theirs", model, optimizer)
    assert files(tmp_path) == before


def test_keep_last_leaves_a_checkpoint_that_holds_a_users_files_and_warns(tmp_path):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "step-1", model, optimizer)
    users_export(tmp_path / "step-1")
    exported = files(tmp_path / "step-1")
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    with pytest.warns(UserWarning, match=r"checkpoint .*step-3 is saved and .*latest names it, but keep_last=1 left "
                                         r".*step-1 where it is: it also holds hf/, which save_checkpoint did not "
                                         r"write and does not delete\. Move those out of it"):
        save_checkpoint(tmp_path / "step-3", model, optimizer, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-1", "step-3"]  # step-2 went, as keep_last=1 says
    assert files(tmp_path / "step-1") == exported
    shutil.move(tmp_path / "step-1" / "hf", tmp_path / "step-1-hf")  # the export moved beside it
    save_checkpoint(tmp_path / "step-4", model, optimizer, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-1-hf", "step-4"]
