"""What a checkpoint gives back and what it says when it cannot: any picklable ``extra`` round-trips
(a bare tensor too, in the layout of format 3 and in the one earlier versions wrote: Note:
[Checkpoint layout] in offload/checkpoint/contents.py); an ``offload.json`` that is valid JSON but
not what a save writes, a checkpoint with fewer parameter groups than the optimizer, and a
``latest`` that names a deleted checkpoint each raise a CheckpointError that says what to do,
leaving the model untouched."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from offload import (CheckpointError, OffloadModel, OffloadOptimizer, latest_checkpoint, load_checkpoint,
                     save_checkpoint)

from .stream_scenarios import tied_mlp
from .test_checkpoint import assert_untouched, snapshot, trained


def assert_same(loaded, saved):
    """Equal, and of the same types, dtypes, shapes and devices, all the way down."""
    assert type(loaded) is type(saved)
    if isinstance(saved, torch.Tensor):
        torch.testing.assert_close(loaded, saved, rtol=0, atol=0)
        assert loaded.shape == saved.shape and loaded.stride() == saved.stride()
    elif isinstance(saved, dict):
        assert loaded.keys() == saved.keys()
        for key in saved:
            assert_same(loaded[key], saved[key])
    elif isinstance(saved, (list, tuple)):
        assert len(loaded) == len(saved)
        for a, b in zip(loaded, saved):
            assert_same(a, b)
    else:
        assert loaded == saved


EXTRAS = {
    "bare-tensor": lambda: torch.tensor(7),
    "bare-float-matrix": lambda: torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    "tensor-in-dict": lambda: {"step": torch.tensor(3), "rows": [torch.arange(4)], "name": "run"},
    "none": lambda: None,
    "int": lambda: 5,
    "dict-with-value-key": lambda: {"value": 1},  # the wrapper's own key, as a user's value
}


# -- extra -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", EXTRAS.values(), ids=EXTRAS.keys())
def test_any_picklable_extra_comes_back_as_it_was_saved(tmp_path, make):
    save_checkpoint(tmp_path / "c", *trained(), extra=make())
    saved = FileSystemReader(tmp_path / "c").read_metadata().state_dict_metadata["extra"]
    assert isinstance(saved, BytesStorageMetadata)  # pickled, whatever it is
    assert json.loads((tmp_path / "c" / "offload.json").read_text())["format"] == 3
    assert_same(load_checkpoint(tmp_path / "c", *trained()), make())


@pytest.mark.parametrize("make, stored", [
    (EXTRAS["bare-tensor"], TensorStorageMetadata),
    (EXTRAS["bare-float-matrix"], TensorStorageMetadata),
    (EXTRAS["tensor-in-dict"], BytesStorageMetadata),
    (EXTRAS["none"], BytesStorageMetadata),
    (EXTRAS["dict-with-value-key"], BytesStorageMetadata),
], ids=["bare-tensor", "bare-float-matrix", "tensor-in-dict", "none", "dict-with-value-key"])
def test_a_checkpoint_of_format_2_with_extra_at_the_top_level_still_loads(tmp_path, monkeypatch, make, stored):
    """Written as the saver of format 2 wrote it: ``extra`` itself at the top level of DCP's state
    dict, a bare tensor as tensor data (which that version could not load back)."""
    from offload.checkpoint import contents, saver

    with monkeypatch.context() as old:
        old.setattr(contents, "FORMAT", 2)
        old.setattr(saver, "_extra_to_save", lambda extra: extra)
        save_checkpoint(tmp_path / "c", *trained(), extra=make())
    assert json.loads((tmp_path / "c" / "offload.json").read_text())["format"] == 2
    assert isinstance(FileSystemReader(tmp_path / "c").read_metadata().state_dict_metadata["extra"], stored)
    model, optimizer = trained()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # different from what was saved: the load must restore it
    assert_same(load_checkpoint(tmp_path / "c", model, optimizer), make())
    assert_untouched(snapshot(*trained()), model, optimizer)


# -- a damaged offload.json ------------------------------------------------------------------------


DAMAGED = "is damaged, or was not written by offload: its offload.json is not what a save writes"


@pytest.mark.parametrize("damage, message", [
    (lambda info: {k: v for k, v in info.items() if k != "tensors"}, r"\('tensors' is missing\)"),
    (lambda info: {k: v for k, v in info.items() if k != "groups"}, r"\('groups' is missing\)"),
    (lambda info: {}, r"\('format' is missing; 'world_size' is missing; 'tensors' is missing; .*'groups' is missing\)"),
    (lambda info: {**info, "format": None}, r"\('format' is None\)"),
    (lambda info: {**info, "format": "2"}, r"\('format' is '2'\)"),
    (lambda info: {**info, "format": 0}, r"\('format' is 0\)"),
    (lambda info: {**info, "format": True}, r"\('format' is True\)"),
    (lambda info: {**info, "tensors": ["0.weight"]}, r"\('tensors' is \['0.weight'\]\)"),
    (lambda info: {**info, "tensors": {"0.weight": {"shape": "8x8"}}},
     r"\('tensors' is \{'0.weight': \{'shape': '8x8'\}\}\)"),
    (lambda info: {**info, "groups": [0, 1]}, r"\('groups' is \[0, 1\]\)"),
    (lambda info: {**info, "world_size": "1"}, r"\('world_size' is '1'\)"),
    (lambda info: {**info, "crc32": {"__0_0.distcp": "ab"}}, r"\('crc32' is \{'__0_0.distcp': 'ab'\}\)"),
], ids=["no-tensors", "no-groups", "empty", "format-null", "format-text", "format-0", "format-true", "tensors-list",
        "tensor-shape-text", "groups-numbers", "world-size-text", "crc32-text"])
def test_an_offload_json_that_is_not_what_a_save_writes_is_refused_as_damaged(tmp_path, damage, message):
    save_checkpoint(tmp_path / "c", *trained())
    info_file = tmp_path / "c" / "offload.json"
    info_file.write_text(json.dumps(damage(json.loads(info_file.read_text()))))
    model, optimizer = trained()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=rf"{DAMAGED} {message}\. Nothing was loaded: load an earlier "
                                              r"checkpoint\.$") as raised:
        load_checkpoint(tmp_path / "c", model, optimizer)
    assert "upgrade" not in str(raised.value)  # no newer offload wrote it
    assert_untouched(before, model, optimizer)


def test_only_a_newer_format_says_upgrade(tmp_path):
    save_checkpoint(tmp_path / "c", *trained())
    info_file = tmp_path / "c" / "offload.json"
    info = json.loads(info_file.read_text())
    info_file.write_text(json.dumps({"format": 4, "layout": "whatever a newer version writes"}))
    with pytest.raises(CheckpointError, match=r"has format 4; this version reads 1, 2 and 3 \(a newer offload wrote "
                                              r"it: upgrade offload to load it\)$"):
        load_checkpoint(tmp_path / "c", *trained())
    info_file.write_text(json.dumps(info))
    load_checkpoint(tmp_path / "c", *trained())


# -- parameter groups ------------------------------------------------------------------------------


def without_the_last_layer():
    """Trained as ``trained()`` is, with the optimizer over all but the last Linear's parameters (a
    layer the resumed run starts to train); the model, the optimizer and those parameters."""
    torch.manual_seed(0)
    model = OffloadModel(tied_mlp(), device="cpu", num_slices=3)
    params = list(model.parameters())
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, params[:-2], lr=1e-2, fused=True)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, params[-2:]


def test_a_group_of_new_parameters_added_before_the_load_says_to_add_it_after_and_that_works(tmp_path):
    saved, saved_optimizer, _ = without_the_last_layer()
    save_checkpoint(tmp_path / "c", saved, saved_optimizer)
    model, _, last = without_the_last_layer()
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, list(model.parameters())[:-2], lr=1e-2, fused=True)
    optimizer.add_param_group({"params": last, "lr": 1e-3})
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=r"holds 1 parameter group\(s\), the optimizer has 2\. Build the "
                                              r"optimizer with the saved run's groups \(the same parameters in each, "
                                              r"in the same order\), load, then add the new group\(s\) with "
                                              r"add_param_group\(\)\.$"):
        load_checkpoint(tmp_path / "c", model, optimizer)
    assert_untouched(before, model, optimizer)
    # Following the advice: the saved run's group, the load, then the new group, and a step.
    model, _, last = without_the_last_layer()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, list(model.parameters())[:-2], lr=1e-2, fused=True)
    load_checkpoint(tmp_path / "c", model, optimizer)
    for p, q in zip(model.parameters(), saved.parameters()):
        assert torch.equal(p, q)
    optimizer.add_param_group({"params": last, "lr": 1e-3})
    loaded = [p.detach().clone() for p in last]
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.synchronize()
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2, 1e-3]
    assert all(not torch.equal(p, q) for p, q in zip(last, loaded))  # the new group is stepped
    assert all(int(optimizer.state[p]["step"]) == 1 for p in last)
    assert all(int(optimizer.state[p]["step"]) == 3 for p in list(model.parameters())[:-2])  # 2 loaded, then 1


def test_a_parameter_moved_into_an_added_group_is_named_and_not_advised_to_be_added_after(tmp_path):
    # add_param_group() after the load would refuse it: the saved run's group already holds it.
    save_checkpoint(tmp_path / "c", *trained())
    model, _ = trained()
    params = list(model.parameters())
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, params[:-1], lr=1e-2, fused=True)
    optimizer.add_param_group({"params": params[-1:], "lr": 1e-3})
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=r"holds 1 parameter group\(s\), the optimizer has 2, and parameters "
                                              r"changed group: 4\.bias \(group 0 there, group 1 here\)\. Build the "
                                              r"optimizer with the saved run's groups \(the same parameters in each, "
                                              r"in the same order\), load\.$") as raised:
        load_checkpoint(tmp_path / "c", model, optimizer)
    assert "add_param_group" not in str(raised.value)
    assert_untouched(before, model, optimizer)


def test_fewer_groups_than_saved_names_the_parameters_that_changed_group(tmp_path):
    model, _ = trained()
    params = list(model.parameters())
    split = OffloadOptimizer(model, torch.optim.AdamW, [{"params": params[:2]}, {"params": params[2:]}], lr=1e-2,
                             fused=True)
    save_checkpoint(tmp_path / "c", model, split)
    with pytest.raises(CheckpointError, match=r"holds 2 parameter group\(s\), the optimizer has 1, and parameters "
                                              r"changed group: 1\.bias \(group 1 there, group 0 here\); 4\.weight "
                                              r"\(group 1 there, group 0 here\); 4\.bias \(group 1 there, group 0 "
                                              r"here\)\. Build the optimizer with the saved run's groups .*, load\.$"):
        load_checkpoint(tmp_path / "c", *trained())


# -- latest names a checkpoint that is gone --------------------------------------------------------


def test_latest_naming_a_deleted_checkpoint_says_so_and_lists_the_others(tmp_path):
    directory = tmp_path / "ckpt"
    for step in (1, 2, 3):
        save_checkpoint(directory / f"step-{step}", *trained(), extra={"step": step})
    shutil.rmtree(directory / "step-3")
    (directory / "notes").mkdir()  # not a checkpoint: not listed
    model, optimizer = trained()
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=rf"no checkpoint at .*step-3: not a directory\. It is the checkpoint "
                                              rf"{directory / 'latest'} names, the last one saved there, and it is "
                                              r"gone \(deleted or moved since it was saved\)\. Load another "
                                              r"checkpoint: pass load_checkpoint\(\) one that is there \(newest "
                                              r"first: step-2, step-1\)\.$"):
        load_checkpoint(latest_checkpoint(directory), model, optimizer)
    assert_untouched(before, model, optimizer)
    assert load_checkpoint(directory / "step-2", model, optimizer) == {"step": 2}


def test_latest_naming_the_only_checkpoint_deleted_says_there_is_none_left(tmp_path):
    directory = tmp_path / "ckpt"
    save_checkpoint(directory / "step-1", *trained())
    shutil.rmtree(directory / "step-1")
    with pytest.raises(CheckpointError, match=rf"\. Load another checkpoint: {directory} holds no other checkpoint: "
                                              r"restore this one from a copy, or start afresh"):
        load_checkpoint(latest_checkpoint(directory), *trained())
