"""A checkpoint's files at the edges: checksums that catch flipped bytes before anything loads
(Note: [Checkpoint checksums] in offload/checkpoint/checkpoint_files.py), a damaged .metadata, files
this user may not read, a full disk before and during a save, targets that are not checkpoints,
and bad arguments; each a CheckpointError (or TypeError) that says what to do, leaving the
previous checkpoint and the model untouched."""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import re
import shutil
import zlib

import pytest
import torch
from torch.distributed.checkpoint import filesystem

from offload import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

from .disk_full import PageBudget, report_free
from .test_checkpoint import assert_untouched, snapshot, trained


def changed(model, optimizer):
    """The model and optimizer after one more step: what a load must restore, or leave alone."""
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def hidden(directory):
    return sorted(e.name for e in directory.iterdir() if e.name.startswith("."))


# -- checksums -------------------------------------------------------------------------------------


def test_every_data_file_has_its_checksum_recorded(tmp_path):
    save_checkpoint(tmp_path / "c", *trained())
    info = json.loads((tmp_path / "c" / "offload.json").read_text())
    files = sorted(p.name for p in (tmp_path / "c").glob("*.distcp"))
    assert sorted(info["crc32"]) == files == ["__0_0.distcp"]
    for name in files:
        assert info["crc32"][name] == zlib.crc32((tmp_path / "c" / name).read_bytes())


@pytest.mark.parametrize("where", [0.1, 0.5, 0.99], ids=["start", "middle", "end"])
def test_a_flipped_byte_is_refused_naming_the_file_before_anything_loads(tmp_path, where):
    save_checkpoint(tmp_path / "c", *trained())
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[int(len(raw) * where)] ^= 0x10
    data.write_bytes(raw)  # the same length: DCP's own checks see nothing
    model, optimizer = changed(*trained())
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=rf"checkpoint .* is damaged: {data} has CRC-32 [0-9a-f]{{8}}, "
                                              r"[0-9a-f]{8} was recorded when it was saved.*Nothing was loaded"):
        load_checkpoint(tmp_path / "c", model, optimizer)
    assert_untouched(before, model, optimizer)


def test_a_checkpoint_saved_without_checksums_still_loads(tmp_path):
    saved = trained()
    save_checkpoint(tmp_path / "c", *saved, extra={"step": 2})
    info_file = tmp_path / "c" / "offload.json"
    info = json.loads(info_file.read_text())
    del info["crc32"]  # as saved before checksums were recorded
    info_file.write_text(json.dumps(info))
    model, optimizer = changed(*trained())
    assert load_checkpoint(tmp_path / "c", model, optimizer) == {"step": 2}
    assert_untouched(snapshot(*saved), model, optimizer)


# -- a damaged .metadata ---------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "not-metadata"])
def test_a_damaged_metadata_file_is_a_checkpoint_error(tmp_path, damage):
    save_checkpoint(tmp_path / "c", *trained())
    metadata = tmp_path / "c" / ".metadata"
    raw = metadata.read_bytes()
    metadata.write_bytes({"garbage": b"\x80\x05not a pickle at all", "truncated": raw[:len(raw) // 2], "empty": b"",
                          "not-metadata": __import__("pickle").dumps({"a": 1})}[damage])
    model, optimizer = changed(*trained())
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=r"checkpoint .* is damaged: its \.metadata (cannot be read|holds a dict)"):
        load_checkpoint(tmp_path / "c", model, optimizer)
    assert_untouched(before, model, optimizer)


# -- permissions -----------------------------------------------------------------------------------


def deny(monkeypatch, denied):
    """Take read access to ``denied`` away, as ``chmod 0`` does for any user but root (the tests run
    as root, whom permissions do not stop): opening it raises ``PermissionError``, and, for a
    directory, so does looking at anything in it."""
    def refused(file, inside_only):
        if isinstance(file, int):  # a descriptor already open
            return False
        file = os.path.abspath(os.fsdecode(file))
        return file.startswith(f"{denied}{os.sep}") or (not inside_only and file == str(denied))

    def guarded(real, inside_only=False):
        def call(file, *args, **kwargs):
            if refused(file, inside_only):
                raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(file))
            return real(file, *args, **kwargs)
        return call

    monkeypatch.setattr(builtins, "open", guarded(builtins.open))
    monkeypatch.setattr(io, "open", guarded(io.open))
    monkeypatch.setattr(os, "stat", guarded(os.stat, inside_only=True))  # the entry itself is listed


@pytest.mark.parametrize("denied", ["", "offload.json", ".metadata", "__0_0.distcp"],
                         ids=["directory", "offload.json", ".metadata", "data"])
def test_a_checkpoint_this_user_may_not_read_says_so_naming_the_file(tmp_path, monkeypatch, denied):
    """Not a raw PermissionError, nor "damaged: load an earlier checkpoint", which would be as unreadable."""
    save_checkpoint(tmp_path / "c", *trained())
    model, optimizer = changed(*trained())
    before = snapshot(model, optimizer)
    unreadable = tmp_path / "c" / denied if denied else tmp_path / "c"
    deny(monkeypatch, unreadable)
    with pytest.raises(CheckpointError, match=rf"^cannot read {re.escape(str(unreadable))}: permission denied\. "
                                              rf"Nothing was loaded: give this user read access to "
                                              rf"{re.escape(str(tmp_path))}/c \(as its owner: chmod -R u\+rX"):
        load_checkpoint(tmp_path / "c", model, optimizer)
    monkeypatch.undo()
    assert_untouched(before, model, optimizer)
    load_checkpoint(tmp_path / "c", model, optimizer)  # readable again, it loads


def test_a_latest_this_user_may_not_read_says_so(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "c", *trained())
    deny(monkeypatch, tmp_path / "latest")
    with pytest.raises(CheckpointError, match=rf"^cannot read {re.escape(str(tmp_path))}/latest: permission denied\. "
                                              rf"Nothing was loaded: give this user read access to "
                                              rf"{re.escape(str(tmp_path))} "):
        latest_checkpoint(tmp_path)


# -- a full disk -----------------------------------------------------------------------------------


def writes_fail_after(monkeypatch, budget):
    """Data files take ``budget`` bytes, then the disk is full (``ENOSPC``), as on a real full
    disk; torch's archive writer reports that as ``unexpected pos``."""
    real = filesystem.FileSystem.create_stream
    left = [budget]

    class Full:
        def __init__(self, raw):
            self.raw = raw

        def write(self, data):
            n = memoryview(data).nbytes
            if n > left[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            left[0] -= n
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield Full(stream) if mode == "wb" and str(path).endswith(".distcp") else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)


def test_a_disk_that_fills_up_during_a_save_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "a", model, optimizer, extra={"step": 2})
    before = snapshot(model, optimizer)
    changed(model, optimizer)
    writes_fail_after(monkeypatch, 4000)
    with pytest.raises(CheckpointError, match=r"could not save checkpoint .*b: the disk filled up while writing it \(the "
                                              r"filesystem of .* has .* free once the partial save was removed; the save "
                                              r"needs more than that: at least .*\)\. Nothing of it was kept and the "
                                              r"previous checkpoint, .*a, is intact"):
        save_checkpoint(tmp_path / "b", model, optimizer)
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]  # no partial directory
    assert latest_checkpoint(tmp_path) == tmp_path / "a"
    # Replacing a checkpoint of the same name: it stays as it was.
    with pytest.raises(CheckpointError, match=r"the disk filled up .* checkpoint .*a is intact \(it was not replaced\)"):
        save_checkpoint(tmp_path / "a", model, optimizer)
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]
    fresh, fresh_optimizer = changed(*trained())
    assert load_checkpoint(tmp_path / "a", fresh, fresh_optimizer) == {"step": 2}
    assert_untouched(before, fresh, fresh_optimizer)


def test_a_disk_without_room_for_a_save_is_refused_before_writing(tmp_path, monkeypatch):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "a", model, optimizer)
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())  # the parameters and AdamW's two moments
    report_free(monkeypatch, state_bytes)  # the tensors fit, not with their headers
    with pytest.raises(CheckpointError, match=r"not enough room to save checkpoint .*b: it needs at least .*, the "
                                              rf"filesystem of {tmp_path} has .* free\. Nothing was written; the "
                                              "previous checkpoint is intact"):
        save_checkpoint(tmp_path / "b", model, optimizer)
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]
    report_free(monkeypatch, 10 * 2**20)
    save_checkpoint(tmp_path / "b", model, optimizer)


@pytest.mark.parametrize("target", ["step-3", "step-2"], ids=["new", "replacing"])
def test_a_save_a_page_short_or_more_leaves_nothing_new_and_latest_as_it_was(tmp_path, monkeypatch, target):
    """The last page a save takes is the last thing it writes: it fails there as it fails at the
    first, with nothing new visible (Note: [Atomic save] in offload/checkpoint/commit.py)."""
    model, optimizer = trained()
    probe, directory = tmp_path / "probe", tmp_path / "ckpt"
    for where in (probe, directory):
        for step in (1, 2):
            save_checkpoint(where / f"step-{step}", model, optimizer, extra={"step": step}, keep_last=1)
    before = snapshot(model, optimizer)
    changed(model, optimizer)
    measured = PageBudget(monkeypatch, probe)
    save_checkpoint(probe / target, model, optimizer, extra={"step": 3}, keep_last=1)
    for pages in range(measured.used):  # from no room at all to one page short
        PageBudget(monkeypatch, directory, pages)
        with pytest.raises(CheckpointError) as refused:
            save_checkpoint(directory / target, model, optimizer, extra={"step": 3}, keep_last=1)
        assert sorted(os.listdir(directory)) == ["latest", "step-2"], f"{pages} pages: {refused.value}"
        assert latest_checkpoint(directory) == directory / "step-2"
    assert re.search(r"could not save checkpoint .*: the disk filled up while writing it .* Nothing of it was kept and "
                     r"(the previous checkpoint, .*step-2, is intact|checkpoint .*step-2 is intact \(it was not "
                     r"replaced\))", str(refused.value)), refused.value
    fresh, fresh_optimizer = changed(*trained())
    assert load_checkpoint(directory / "step-2", fresh, fresh_optimizer) == {"step": 2}
    assert_untouched(before, fresh, fresh_optimizer)
    PageBudget(monkeypatch, directory, measured.used)  # room enough: the same save succeeds
    save_checkpoint(directory / target, model, optimizer, extra={"step": 3}, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", target]
    assert latest_checkpoint(directory) == directory / target
    assert load_checkpoint(directory / target, fresh, fresh_optimizer) == {"step": 3}


def test_a_checkpoint_keep_last_cannot_remove_leaves_the_save_done_and_warns(tmp_path, monkeypatch):
    model, optimizer = trained()
    for step in (1, 2):
        save_checkpoint(tmp_path / f"step-{step}", model, optimizer)
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if os.path.basename(path) == ".step-1.removed":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.warns(UserWarning, match=r"checkpoint .*step-3 is saved and .*latest names it, but keep_last=1 could "
                                         r"not remove .*step-1 \(.*Permission denied.*\); the next save there tries "
                                         "again") as warned:
        assert save_checkpoint(tmp_path / "step-3", model, optimizer, keep_last=1) == tmp_path / "step-3"
    ours = [w for w in warned if "is saved" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # at the caller's line
    assert sorted(os.listdir(tmp_path)) == [".step-1.removed", "latest", "step-3"]  # step-2 is removed
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"
    load_checkpoint(tmp_path / "step-3", model, optimizer)
    monkeypatch.setattr(shutil, "rmtree", real)
    save_checkpoint(tmp_path / "step-4", model, optimizer, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-4"]


def test_a_rename_of_the_commit_that_fails_is_undone(tmp_path, monkeypatch):
    """A rename cannot run out of room, but it can fail (an I/O error): those made before it are
    undone, so that the save fails with nothing new visible and the replaced checkpoint back."""
    model, optimizer = trained()
    save_checkpoint(tmp_path / "a", model, optimizer, extra={"step": 1})
    before = snapshot(model, optimizer)
    changed(model, optimizer)
    real = os.replace

    def replace(source, target):
        if os.path.basename(target) == "latest":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(source, target)

    monkeypatch.setattr(os, "replace", replace)
    for name in ("b", "a"):  # a new checkpoint, and one that replaces another
        with pytest.raises(CheckpointError, match=rf"could not save checkpoint .*{name}: OSError: .*Input/output error\. "
                                                  "Nothing of it was kept"):
            save_checkpoint(tmp_path / name, model, optimizer, extra={"step": 2})
        assert sorted(os.listdir(tmp_path)) == ["a", "latest"]
        assert latest_checkpoint(tmp_path) == tmp_path / "a"
    fresh, fresh_optimizer = changed(*trained())
    assert load_checkpoint(tmp_path / "a", fresh, fresh_optimizer) == {"step": 1}
    assert_untouched(before, fresh, fresh_optimizer)


def test_an_interrupt_that_lands_in_latests_rename_leaves_the_checkpoint_committed(tmp_path, monkeypatch):
    """Python raises a Ctrl-C when the call it landed in returns: one in the rename of ``latest``
    comes after it, with the new checkpoint committed. It stays so (undone, ``latest`` would name
    a checkpoint deleted), the interrupt is raised, and the next save there works."""
    model, optimizer = trained()
    save_checkpoint(tmp_path / "a", model, optimizer, extra={"step": 1})
    changed(model, optimizer)
    after = snapshot(model, optimizer)
    real = os.replace

    def replace(source, target):
        real(source, target)
        if os.path.basename(target) == "latest":
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "b", model, optimizer, extra={"step": 2})
    monkeypatch.setattr(os, "replace", real)
    assert latest_checkpoint(tmp_path) == tmp_path / "b"
    fresh, fresh_optimizer = trained()
    assert load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_optimizer) == {"step": 2}
    assert_untouched(after, fresh, fresh_optimizer)
    save_checkpoint(tmp_path / "c", model, optimizer, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["c", "latest"]


def test_a_commit_that_cannot_be_undone_says_what_is_where(tmp_path, monkeypatch):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "a", model, optimizer)
    real = os.replace

    def replace(source, target):
        if os.path.basename(target) in ("latest", ".a.partial"):  # latest's rename, and the first undo
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(source, target)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointError, match=r"could not save checkpoint .*a: its commit failed \(OSError: .*Input/"
                                              r"output error\) and undoing its renames failed too \(.*\): .*a is at "
                                              r".*\.a\.replaced; .*\.a\.partial is at .*a\. latest still names the "
                                              "previous checkpoint"):
        save_checkpoint(tmp_path / "a", model, optimizer)


# -- what is at the path ---------------------------------------------------------------------------


def test_a_save_onto_a_file_is_refused_before_anything_is_touched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"cannot save a checkpoint at .*notes\.txt: it is a file"):
        save_checkpoint(tmp_path / "notes.txt", *trained())
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_save_onto_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}")
    with pytest.raises(FileExistsError, match=r"cannot save a checkpoint at .*data: it is a directory that holds files "
                                              r"but no offload\.json"):
        save_checkpoint(tmp_path / "data", *trained())
    assert sorted(os.listdir(tmp_path)) == ["data"] and os.listdir(tmp_path / "data") == ["train.jsonl"]
    (tmp_path / "empty").mkdir()
    save_checkpoint(tmp_path / "empty", *trained())  # an empty directory holds nothing to lose
    assert latest_checkpoint(tmp_path) == tmp_path / "empty"


# -- arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize("function", [save_checkpoint, load_checkpoint], ids=["save", "load"])
def test_a_model_or_optimizer_of_the_wrong_type_is_a_type_error(tmp_path, function):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "c", model, optimizer)
    name = function.__name__
    for bad in (None, "model"):
        with pytest.raises(TypeError, match=rf"{name}\(\) takes the model \(an nn.Module: the OffloadModel\) after the "
                                            rf"path, got {type(bad).__name__}"):
            function(tmp_path / "c", bad, optimizer)
    with pytest.raises(TypeError, match=rf"{name}\(\): optimizer must be a torch.optim.Optimizer .* or None, got str"):
        function(tmp_path / "c", model, "adamw")


def test_an_unpicklable_extra_is_refused_before_anything_is_written(tmp_path):
    import threading

    with pytest.raises(TypeError, match=r"extra must be picklable .*cannot pickle '_thread.lock' object\. Pass "
                                        r"state_dict\(\)s"):
        save_checkpoint(tmp_path / "c", *trained(), extra={"lock": threading.Lock()})
    assert os.listdir(tmp_path) == []


def test_an_interrupt_while_extra_is_measured_stays_an_interrupt(tmp_path, monkeypatch):
    """Ctrl-C while save_checkpoint measures ``extra`` (torch.save into a counting sink): torch.save's
    zip writer replaces the interrupt by a RuntimeError as it closes, which the save used to report
    as "extra must be picklable". It stays a KeyboardInterrupt, and nothing is written."""
    from offload.checkpoint import checkpoint_files

    model, _ = trained()
    write = checkpoint_files._CountingSink.write
    calls = []

    def interrupted_write(self, data):
        calls.append(1)
        if len(calls) == 2:  # inside the zip file, after its first record began
            raise KeyboardInterrupt
        return write(self, data)

    monkeypatch.setattr(checkpoint_files._CountingSink, "write", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "step-1", model, extra={"step": 1})
    assert len(calls) == 2
    assert not (tmp_path / "step-1").exists()
