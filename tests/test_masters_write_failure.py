"""A write-back of masters on disk, or of their gradients, that failed is latched, not forgotten:
the kernel may read back what the file held before, so the optimizer's ``state_dict()`` and
``save_checkpoint`` refuse (naming the slice, and the checkpoint saved before the failure) until
loads replace the state and the parameters, and ``keep_last`` never deletes the checkpoint to
reload. ``step()`` goes on. Rule 7 of Note: [An update that failed part way] in
offload/optimizing/partial_failure.py; Note: [Masters on disk] in offload/tiers/master_files.py.
The failure is injected as an ``EIO`` from the mapping's ``msync`` (``MappedFile.write_back``)."""

from __future__ import annotations

import copy
import errno
import os
import re
import threading

import pytest
import torch

from offload import DiskTier, DiskTierError, OffloadModel, OffloadOptimizer, load_checkpoint, save_checkpoint
from offload.streams import mapped

from .test_masters_on_disk import BF16, train
from .test_optimizer import assert_same, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")


def build(directory):
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=DiskTier(directory))
    return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)


def fail_once(monkeypatch, what: str) -> list[mapped.MappedFile]:
    """The next write-back of a ``what`` file (``"masters"``, ``"gradients"``) on the masters'
    writer raises ``EIO``; the list gets the file it failed on."""
    real = mapped.MappedFile.write_back
    failed: list[mapped.MappedFile] = []

    def write_back(self):
        if not failed and threading.current_thread().name == "offload masters write" and self.what == what:
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
    errors = []
    for step in range(2, 5):  # a loop that catches what is raised, goes on, and saves every step
        try:
            train([(model, optimizer)], 1, first=step)  # step() is not refused
            save_checkpoint(directory / f"step-{step + 1}", model, optimizer, keep_last=1)
        except (DiskTierError, RuntimeError) as error:
            errors.append(error)
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
