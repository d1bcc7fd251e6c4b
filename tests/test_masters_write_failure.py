"""A write-back of masters on disk, or of their gradients, that failed is latched, not forgotten:
the kernel may read back what the file held before, so the optimizer's ``state_dict()`` and
``save_checkpoint`` refuse (naming the slice, and the checkpoint saved before the failure) until
loads replace the state and the parameters, and ``keep_last`` never deletes the checkpoint to
reload. ``step()`` goes on. Rule 7 of Note: [An update that failed part way] in
offload/optimizing/partial_failure.py; Note: [Masters on disk] in offload/tiers/master_files.py.
A write-back the slice's storage does itself, on the calling thread (a forward's cast of a stale
shadow, ``save_checkpoint``'s and ``load_checkpoint``'s release of the masters), is raised there at
once and latched the same way (Note: [A write-back outside the masters' writer] in
offload/streams/masters_io.py). The model's own refusal is by slice: a load that wrote every
parameter of the failed slices that trains ends it, a ``strict=False`` one of a part too; a
``load_checkpoint`` refused by its checks leaves a failure not raised yet to be raised. The failure
is injected as an ``EIO`` from the mapping's ``msync`` (``MappedFile.write_back``)."""

from __future__ import annotations

import copy
import errno
import os
import re
import threading

import pytest
import torch
from torch import nn

from offload import (CheckpointError, DiskTier, DiskTierError, OffloadModel, OffloadOptimizer, load_checkpoint,
                     save_checkpoint)
from offload.checkpoint import loader
from offload.streams import mapped

from .test_masters_on_disk import BF16, train
from .test_optimizer import assert_same, loss_of, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")


def build(directory):
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=DiskTier(directory))
    return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)


#: The thread of the write-backs a slice's storage does itself.
CALLER = threading.main_thread().name


def fail_once(monkeypatch, what: str, thread: str = "offload masters write") -> list[mapped.MappedFile]:
    """The next write-back of a ``what`` file (``"masters"``, ``"gradients"``) on ``thread`` (the
    masters' writer, or :data:`CALLER`) raises ``EIO``; the list gets the file it failed on."""
    real = mapped.MappedFile.write_back
    failed: list[mapped.MappedFile] = []

    def write_back(self):
        if not failed and threading.current_thread().name == thread and self.what == what:
            failed.append(self)
            raise OSError(errno.EIO, os.strerror(errno.EIO), self.path)
        real(self)

    monkeypatch.setattr(mapped.MappedFile, "write_back", write_back)
    return failed


def slice_of(model: OffloadModel, file: mapped.MappedFile) -> int:
    return next(s.index for s in model._engine.slices
                if file is s.storage.masters_file or file is s.storage.gradient_home.file)


@pytest.mark.parametrize("what", ["masters", "gradients"])
def test_saves_are_refused_until_a_load_and_keep_last_keeps_the_checkpoint_to_reload(what, tmp_path, monkeypatch):
    model, optimizer = build(tmp_path / "m")
    directory = tmp_path / "ckpt"
    train([(model, optimizer)], 2)
    save_checkpoint(directory / "step-2", model, optimizer, keep_last=1)
    failed = fail_once(monkeypatch, what)
    errors = train_and_save_catching(model, optimizer, directory)
    index, reload = slice_of(model, failed[0]), re.escape(f"load_checkpoint({str(directory / 'step-2')!r}, model, "
                                                          "optimizer)")
    # Masters: raised by the save's wait. Gradients: by the next step(), which updated nothing.
    assert [type(error) for error in errors] == [DiskTierError, RuntimeError, RuntimeError]
    assert re.search(rf"slice {index}: {re.escape(failed[0].path)}\): Input/output error \(errno 5\).*refuse until a "
                     rf"load: fix the disk, then reload the last checkpoint saved before this error \({reload}\) "
                     "before training on$", str(errors[0]))
    for error in errors[1:]:
        assert re.search(rf"parameters and state may mix two steps: the masters or gradients of slice\(s\) {index} "
                         rf"could not be written back to disk \(slice {index}: {re.escape(failed[0].path)}: "
                         r"Input/output error.*save_checkpoint\(\) would use that mix; load the last checkpoint "
                         rf"first \({reload}, or", str(error))
    assert sorted(os.listdir(directory)) == ["latest", "step-2"]  # nothing saved, nothing deleted
    with pytest.raises(RuntimeError, match=r"may mix two steps.*state_dict\(\) would use that mix"):
        optimizer.state_dict()

    monkeypatch.undo()  # the disk fixed
    load_checkpoint(directory / "step-2", model, optimizer)
    resumed = build(tmp_path / "resumed")
    load_checkpoint(directory / "step-2", *resumed)
    train([(model, optimizer), resumed], 2, first=2)
    save_checkpoint(directory / "step-4", model, optimizer, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-4"]
    assert_same(*resumed, model, optimizer)


def test_a_failure_is_raised_though_a_later_write_of_its_slice_succeeded(tmp_path, monkeypatch):
    # The next backward writes the slice's gradients back before step() waits: that write succeeds,
    # and says nothing of the masters, whose pages the kernel may have read back from the file.
    model, optimizer = build(tmp_path / "m")
    train([(model, optimizer)], 1)
    optimizer.synchronize()  # step 0's writes done
    failed = fail_once(monkeypatch, "masters")
    train([(model, optimizer)], 1, first=1)  # its update's write fails (on the writer, in order: before the next)
    with pytest.raises(DiskTierError) as raised:
        train([(model, optimizer)], 1, first=2)
    assert f"(slice {slice_of(model, failed[0])}: {failed[0].path}): Input/output error" in str(raised.value)
    with pytest.raises(RuntimeError, match=r"may mix two steps.*save_checkpoint\(\) would use that mix"):
        save_checkpoint(tmp_path / "ckpt" / "step-3", model, optimizer)


def test_loading_the_state_alone_keeps_refusing_and_the_parameters_too_clear_it(tmp_path, monkeypatch):
    model, optimizer = build(tmp_path / "m")
    train([(model, optimizer)], 2)
    parameters = {name: t.clone() for name, t in model.state_dict().items()}
    state = copy.deepcopy(optimizer.state_dict())
    fail_once(monkeypatch, "masters")
    train([(model, optimizer)], 1, first=2)
    # No save in this process: the error names no checkpoint, but what latest names.
    with pytest.raises(DiskTierError, match=r"reload the last checkpoint saved before this error \(load_checkpoint\("
                                            r"latest_checkpoint\(directory\), model, optimizer\)\)"):
        optimizer.synchronize()
    monkeypatch.undo()
    optimizer.synchronize()  # raised once; remembered by the refusals
    optimizer.load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"may mix two steps.*Its state was loaded since, but not the model's "
                                           r"parameters"):
        optimizer.state_dict()
    model.load_state_dict(parameters)
    optimizer.state_dict()


def raised_at_once(file: mapped.MappedFile) -> str:
    """What a failed write-back of the masters on the calling thread raises at once: the file, why,
    and the advice the refusals give."""
    return (rf"^could not write the masters of a slice back to disk \({re.escape(file.path)}\): Input/output error "
            r"\(errno 5\)\. .*so save_checkpoint\(\) of this model and its OffloadOptimizer's state_dict\(\) refuse "
            "until a load: fix the disk, then reload the last checkpoint saved before this error before training on$")


def refused(model: OffloadModel, file: mapped.MappedFile, reload: str, doing: str = r"save_checkpoint\(\)") -> str:
    """What the refusals after it say: the slice, its file and why, and the checkpoint to reload."""
    index = slice_of(model, file)
    return (rf"parameters and state may mix two steps: the masters of slice\(s\) {index} could not be written back "
            rf"to disk \(slice {index}: {re.escape(file.path)}: Input/output error \(errno 5\)\), and what RAM holds "
            rf"of them may revert.* {doing} would use that mix; load the last checkpoint first \({re.escape(reload)}, or")


def train_and_save_catching(model, optimizer, directory) -> list[Exception]:
    """Steps 3 to 5 as a loop that catches what is raised, goes on and saves every step (step() is
    not refused); what it caught."""
    errors = []
    for step in range(2, 5):
        try:
            train([(model, optimizer)], 1, first=step)
            save_checkpoint(directory / f"step-{step + 1}", model, optimizer, keep_last=1)
        except (DiskTierError, RuntimeError) as error:
            errors.append(error)
    return errors


def saved_at_step_two(tmp_path):
    """A model with masters on disk and its optimizer, saved after two steps into ``ckpt/step-2``
    and trained one step more; the checkpoints' directory."""
    model, optimizer = build(tmp_path / "m")
    directory = tmp_path / "ckpt"
    train([(model, optimizer)], 2)
    save_checkpoint(directory / "step-2", model, optimizer, keep_last=1)
    train([(model, optimizer)], 1, first=2)
    return model, optimizer, directory


def resume(checkpoint, model, optimizer, tmp_path) -> None:
    """Load ``checkpoint`` (``step-2``) into the model and a new one, train both on and save with
    ``keep_last=1``: the save goes through, deletes the checkpoint, and the two agree."""
    load_checkpoint(checkpoint, model, optimizer)
    resumed = build(tmp_path / "resumed")
    load_checkpoint(checkpoint, *resumed)
    train([(model, optimizer), resumed], 2, first=2)
    save_checkpoint(checkpoint.parent / "step-4", model, optimizer, keep_last=1)
    assert sorted(os.listdir(checkpoint.parent)) == ["latest", "step-4"]
    assert_same(*resumed, model, optimizer)


def test_a_failed_write_back_in_a_forwards_cast_is_raised_there_and_latched(tmp_path, monkeypatch):
    # The forward after a save casts each slice's shadow again (the save read the parameters),
    # reading its masters in and writing them back on the calling thread.
    model, optimizer = build(tmp_path / "m")
    directory = tmp_path / "ckpt"
    train([(model, optimizer)], 2)
    save_checkpoint(directory / "step-2", model, optimizer, keep_last=1)
    failed = fail_once(monkeypatch, "masters", CALLER)
    errors = train_and_save_catching(model, optimizer, directory)
    # The forward raised it; the next step()s went on (they raise it no second time); the saves refused.
    assert [type(error) for error in errors] == [DiskTierError, RuntimeError, RuntimeError]
    assert re.search(raised_at_once(failed[0]), str(errors[0]))
    reload = f"load_checkpoint({str(directory / 'step-2')!r}, model, optimizer)"
    for error in errors[1:]:
        assert re.search(refused(model, failed[0], reload), str(error))
    assert sorted(os.listdir(directory)) == ["latest", "step-2"]  # nothing saved, nothing deleted
    with pytest.raises(RuntimeError, match=refused(model, failed[0], reload, r"state_dict\(\)")):
        optimizer.state_dict()
    monkeypatch.undo()  # the disk fixed
    resume(directory / "step-2", model, optimizer, tmp_path)


def test_a_failed_write_back_in_save_checkpoints_release_of_the_masters_is_latched(tmp_path, monkeypatch):
    # DCP read every slice's masters in; the save writes each back once it is done with it.
    model, optimizer, directory = saved_at_step_two(tmp_path)
    failed = fail_once(monkeypatch, "masters", CALLER)
    with pytest.raises(CheckpointError, match="could not save checkpoint .*could not write the masters of a slice"):
        save_checkpoint(directory / "step-3", model, optimizer, keep_last=1)
    assert failed
    reload = f"load_checkpoint({str(directory / 'step-2')!r}, model, optimizer)"
    for step in (3, 4):  # trained on and saved: refused each time
        train([(model, optimizer)], 1, first=step)
        with pytest.raises(RuntimeError, match=refused(model, failed[0], reload)):
            save_checkpoint(directory / f"step-{step + 1}", model, optimizer, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-2"]
    monkeypatch.undo()
    resume(directory / "step-2", model, optimizer, tmp_path)


def test_a_failed_write_back_at_the_end_of_load_checkpoint_outlasts_that_load(tmp_path, monkeypatch):
    # The load replaced the state and the parameters, which would end a latch set before it; its
    # last act writes the masters it loaded back, and that failure is after it.
    model, optimizer, directory = saved_at_step_two(tmp_path)
    release, armed = loader._release_masters, []

    def failing_release(model):
        armed.append(fail_once(monkeypatch, "masters", CALLER))
        release(model)

    monkeypatch.setattr(loader, "_release_masters", failing_release)
    with pytest.raises(DiskTierError) as raised:
        load_checkpoint(directory / "step-2", model, optimizer)
    failed = armed[0]  # the file it failed on
    assert re.search(raised_at_once(failed[0]), str(raised.value))
    monkeypatch.undo()
    # The load forgot the checkpoint saved before it: latest_checkpoint names it.
    reload = "load_checkpoint(latest_checkpoint(directory), model, optimizer)"
    with pytest.raises(RuntimeError, match=refused(model, failed[0], reload)):
        save_checkpoint(directory / "step-3", model, optimizer, keep_last=1)
    train([(model, optimizer)], 1, first=2)  # step() is not refused
    with pytest.raises(RuntimeError, match=refused(model, failed[0], reload)):
        save_checkpoint(directory / "step-3", model, optimizer, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-2"]
    resume(directory / "step-2", model, optimizer, tmp_path)


def test_a_failure_before_a_load_of_the_state_alone_keeps_refusing_and_the_parameters_too_end_it(tmp_path,
                                                                                                 monkeypatch):
    # Latched only after the optimizer's load (nothing looked in between): the loads after the
    # failure count, as for a failure latched before them.
    model, optimizer = build(tmp_path / "m")
    train([(model, optimizer)], 2)
    parameters = {name: t.clone() for name, t in model.state_dict().items()}
    state = copy.deepcopy(optimizer.state_dict())
    failed = fail_once(monkeypatch, "masters", CALLER)
    with pytest.raises(DiskTierError):
        train([(model, optimizer)], 1, first=2)  # the forward's cast (reading the parameters made the shadows stale)
    monkeypatch.undo()
    optimizer.load_state_dict(state)
    with pytest.raises(RuntimeError, match=rf"slice\(s\) {slice_of(model, failed[0])} could not be written back.*Its "
                                           "state was loaded since, but not the model's parameters"):
        optimizer.state_dict()
    model.load_state_dict(parameters)
    optimizer.state_dict()


def test_a_failure_on_the_writer_after_a_load_outlasts_that_load(tmp_path, monkeypatch):
    # The backward after a load lands gradients whose write fails; the wait in state_dict() raises
    # and latches it, and the load before it does not end it.
    model, optimizer = build(tmp_path / "m")
    train([(model, optimizer)], 2)
    save_checkpoint(tmp_path / "ckpt" / "step-2", model, optimizer)
    load_checkpoint(tmp_path / "ckpt" / "step-2", model, optimizer)
    failed = fail_once(monkeypatch, "gradients")
    loss_of(model, 2).backward()
    model.memory_footprint()  # waits for the landings' writes: the one that fails ran before the disk is fixed
    monkeypatch.undo()
    with pytest.raises(DiskTierError):
        optimizer.state_dict()
    with pytest.raises(RuntimeError, match=rf"may mix two steps: the masters or gradients of slice\(s\) "
                                           rf"{slice_of(model, failed[0])} could not be written back"):
        optimizer.state_dict()


def fail_a_step_unraised(model, optimizer, monkeypatch, step: int = 2) -> list[mapped.MappedFile]:
    """Step ``step``'s write-back of the masters fails on the writer; nothing raised it yet, the
    writes are done (``memory_footprint()`` waits for them) and the disk is fixed."""
    failed = fail_once(monkeypatch, "masters")
    train([(model, optimizer)], 1, first=step)
    model.memory_footprint()
    monkeypatch.undo()
    assert failed
    return failed


def test_a_model_only_save_after_a_failure_is_refused_and_keep_last_deletes_nothing(tmp_path, monkeypatch):
    # A loop that saves the weights alone (for evaluation, export) besides the full checkpoints.
    model, optimizer = build(tmp_path / "m")
    directory = tmp_path / "ckpt"
    train([(model, optimizer)], 2)
    save_checkpoint(directory / "step-2", model, optimizer, keep_last=1)
    failed = fail_a_step_unraised(model, optimizer, monkeypatch)
    index, reload = slice_of(model, failed[0]), f"load_checkpoint({str(directory / 'step-2')!r}, model)"
    for _ in range(2):  # refused, and again: nothing forgets it
        with pytest.raises(RuntimeError, match=rf"may not be the ones it trained: the masters or gradients of slice\(s\) "
                                               rf"{index} could not be written back.*save_checkpoint\(\) would save "
                                               rf"them; .*before this error \({re.escape(reload)}\)"):
            save_checkpoint(directory / "step-3", model, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-2"]  # nothing saved, nothing deleted
    with pytest.raises(DiskTierError):  # the optimizer raises it still, once
        optimizer.synchronize()
    parameters = {name: t.clone() for name, t in model.state_dict().items()}
    model.load_state_dict(parameters)  # a load of every parameter ends the model's latch
    save_checkpoint(directory / "step-3", model, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-3"]


def test_an_optimizer_built_after_a_failure_inherits_it_and_names_the_checkpoint_saved_before(tmp_path, monkeypatch):
    model, optimizer = build(tmp_path / "m")
    directory = tmp_path / "ckpt"
    train([(model, optimizer)], 2)
    save_checkpoint(directory / "step-2", model, optimizer, keep_last=1)
    failed = fail_a_step_unraised(model, optimizer, monkeypatch)
    reload = f"load_checkpoint({str(directory / 'step-2')!r}, model, optimizer)"
    with pytest.raises(DiskTierError, match=re.escape(f"reload the last checkpoint saved before this error ({reload})")):
        optimizer.synchronize()
    fresh = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in (3, 4):  # refused before and after a step of its own
        with pytest.raises(RuntimeError, match=refused(model, failed[0], reload).replace("the masters of",
                                                                                          "the masters or gradients of")):
            save_checkpoint(directory / f"step-{step}", model, fresh, keep_last=1)
        train([(model, fresh)], 1, first=step)
    with pytest.raises(RuntimeError, match=r"may mix two steps.*state_dict\(\) would use that mix"):
        fresh.state_dict()
    assert sorted(os.listdir(directory)) == ["latest", "step-2"]
    resume(directory / "step-2", model, fresh, tmp_path)  # the load ends it


def test_a_load_with_a_failure_pending_succeeds_ends_the_latch_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    # The pending error's advice is this very load: the load replaces what the failed write may
    # revert, so it latches and drops the error instead of raising it.
    model, optimizer = build(tmp_path / "m")
    directory = tmp_path / "ckpt"
    train([(model, optimizer)], 2)
    save_checkpoint(directory / "step-2", model, optimizer, keep_last=1)
    fail_a_step_unraised(model, optimizer, monkeypatch)
    resume(directory / "step-2", model, optimizer, tmp_path)  # the first load goes through; saves after it too
    optimizer.synchronize()  # nothing left to raise
    optimizer.state_dict()


def build_frozen_weights(directory):
    """:func:`build` with every ``nn.Linear``'s weight frozen: what trains is the biases and the
    norm's, as an adapter's weights beside a frozen base."""
    layers = network()
    for layer in layers:
        if isinstance(layer, nn.Linear):
            layer.weight.requires_grad_(False)
    model = OffloadModel(layers, device="cpu", num_slices=3, compute_dtype=BF16, masters=DiskTier(directory))
    return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)


def keys_of(model: OffloadModel, index: int, trained: bool | None = None) -> list[str]:
    """The ``state_dict()`` keys of slice ``index``'s parameters (``trained``: only those that train,
    or only those that do not)."""
    names = model._engine.slices[index].names
    return [key for key, p in model.named_parameters() if key.split(".")[0] in names
            and (trained is None or p.requires_grad == trained)]


def model_refused(model: OffloadModel, file: mapped.MappedFile) -> str:
    """What a save of the model alone says while the failure is latched: the slice and its file."""
    index = slice_of(model, file)
    return (rf"may not be the ones it trained: the masters or gradients of slice\(s\) {index} could not be written "
            rf"back to disk \(slice {index}: {re.escape(file.path)}: .*save_checkpoint\(\) would save them")


@pytest.mark.parametrize("make", [build, build_frozen_weights], ids=["all-train", "weights-frozen"])
def test_a_load_of_the_failed_slices_trained_parameters_alone_ends_the_models_refusal(make, tmp_path, monkeypatch):
    # The refusal is about the slices whose write-back failed: a load_state_dict(strict=False) that
    # writes every parameter of those that trains ends it, whatever else it leaves out; one that
    # leaves any of them out keeps it (Note: [Masters on disk], "Errors").
    model, optimizer = make(tmp_path / "m")
    directory = tmp_path / "ckpt"
    train([(model, optimizer)], 2)
    save_checkpoint(directory / "step-2", model, optimizer, keep_last=1)
    failed = fail_a_step_unraised(model, optimizer, monkeypatch)
    with pytest.raises(DiskTierError):
        optimizer.synchronize()
    index = slice_of(model, failed[0])
    saved = {name: t.clone() for name, t in model.state_dict().items()}
    others = [key for s in model._engine.slices if s.index != index for key in keys_of(model, s.index)]
    trained = keys_of(model, index, trained=True)
    for part in (others, [key for key in keys_of(model, index) if key != trained[-1]]):  # all but one that trains
        model.load_state_dict({key: saved[key] for key in part}, strict=False)
        with pytest.raises(RuntimeError, match=model_refused(model, failed[0])):
            save_checkpoint(directory / "step-3", model, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-2"]

    model.load_state_dict({key: saved[key] for key in trained}, strict=False)
    save_checkpoint(directory / "step-3", model, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-3"]
    # The optimizer's own latch wants its state loaded too (rule 4 of Note: [An update that failed
    # part way]); one built now inherits nothing.
    with pytest.raises(RuntimeError, match=r"may mix two steps: the masters or gradients of slice"):
        optimizer.state_dict()
    fresh = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    save_checkpoint(directory / "step-3", model, fresh, keep_last=1)


def test_a_load_state_dict_whose_shapes_do_not_fit_the_failed_slice_leaves_the_failure_pending(tmp_path,
                                                                                                monkeypatch):
    # The failed slice's parameters with shapes that do not fit are not written (the load raises
    # after writing the others): the failure not raised yet stays pending, and the refusal stays.
    model, optimizer = build(tmp_path / "m")
    directory = tmp_path / "ckpt"
    train([(model, optimizer)], 2)
    save_checkpoint(directory / "step-2", model, optimizer, keep_last=1)
    failed = fail_a_step_unraised(model, optimizer, monkeypatch)
    index = slice_of(model, failed[0])
    saved = {name: t.clone() for name, t in model.state_dict().items()}
    wrong = {key: torch.zeros(2, 2) if key in keys_of(model, index) else value for key, value in saved.items()}
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict(wrong)
    with pytest.raises(DiskTierError, match=re.escape(failed[0].path)):  # still pending: raised once
        optimizer.synchronize()
    with pytest.raises(RuntimeError, match=model_refused(model, failed[0])):
        save_checkpoint(directory / "step-3", model, keep_last=1)
    resume(directory / "step-2", model, optimizer, tmp_path)


def another_model(path) -> None:
    """A checkpoint at ``path`` of a model of other shapes (four outputs, not three)."""
    other = network()
    other[-1] = nn.Linear(16, 4)
    save_checkpoint(path, other)


@pytest.mark.parametrize("refused", ["no-checkpoint", "another-model"])
def test_a_refused_load_checkpoint_leaves_a_pending_failure_to_be_raised_and_the_saves_refusing(refused, tmp_path,
                                                                                               monkeypatch):
    # The load drops a failure not raised yet (it replaces what the write may revert) only once its
    # checks pass: a load refused before it loads anything replaces nothing.
    model, optimizer = build(tmp_path / "m")
    directory = tmp_path / "ckpt"
    train([(model, optimizer)], 2)
    save_checkpoint(directory / "step-2", model, optimizer, keep_last=1)
    if refused == "another-model":
        another_model(tmp_path / "other")
    failed = fail_a_step_unraised(model, optimizer, monkeypatch)
    with pytest.raises(CheckpointError, match="no checkpoint" if refused == "no-checkpoint" else "another model"):
        load_checkpoint(tmp_path / ("missing" if refused == "no-checkpoint" else "other"), model, optimizer)
    reload = f"load_checkpoint({str(directory / 'step-2')!r}, model, optimizer)"
    with pytest.raises(DiskTierError, match=rf"\(slice {slice_of(model, failed[0])}: {re.escape(failed[0].path)}\).*"
                                            rf"before this error \({re.escape(reload)}\)"):
        optimizer.synchronize()
    optimizer.synchronize()  # raised once
    with pytest.raises(RuntimeError, match=r"may mix two steps.*save_checkpoint\(\) would use that mix"):
        save_checkpoint(directory / "step-3", model, optimizer, keep_last=1)
    with pytest.raises(RuntimeError, match=model_refused(model, failed[0])):
        save_checkpoint(directory / "step-3", model, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-2"]
    resume(directory / "step-2", model, optimizer, tmp_path)  # a load that goes through ends it
