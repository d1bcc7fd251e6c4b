"""Masters on disk: ``OffloadModel(..., masters=DiskTier(path))`` keeps the float32 masters in file
mappings, gives the RAM-resident model's results bit for bit, holds a window of slices in RAM while
the optimizer steps and none between steps, and fails safely (Notes: [Masters on disk] in
offload/tiers/master_files.py, [Mapped masters] in offload/streams/mapped.py)."""

from __future__ import annotations

import copy
import errno
import os
import pickle
import threading
import time

import pytest
import torch
from torch import nn

from offload import (DiskTier, DiskTierError, HostUpdateError, OffloadModel, OffloadOptimizer, estimate_memory,
                     latest_checkpoint, load_checkpoint, load_sequential, save_checkpoint)
from offload.tiers import master_files
from offload.tiers.disk_tier import WINDOW
from offload.streams import mapped
from offload.streams.disk import page_aligned

from .helpers import DEVICES
from .test_optimizer import OPTIMIZERS, assert_same, assert_same_where_held, loss_of, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

BF16 = torch.bfloat16


def twins(cls, kwargs, tmp_path, device="cpu", num_slices=3, state_tier=False, layers=network):
    """The same model and optimizer with the masters in RAM and on disk."""
    runs = []
    for masters in (None, DiskTier(tmp_path / "masters")):
        model = OffloadModel(layers(), device=device, num_slices=num_slices, compute_dtype=BF16, masters=masters)
        tier = DiskTier(tmp_path / "state") if state_tier and masters is not None else None
        runs.append((model, OffloadOptimizer(model, cls, disk_tier=tier, **kwargs)))
    return runs


def train(runs, steps, first=0):
    for step in range(first, first + steps):
        for model, optimizer in runs:
            optimizer.zero_grad()
            loss_of(model, step).backward()
            optimizer.step()


def resident(model):
    return sum(s.storage.masters_file.resident_bytes() for s in model._engine.slices)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_tier", [False, True], ids=["state-in-ram", "state-on-disk"])
@pytest.mark.parametrize("cls, kwargs", [p for p in OPTIMIZERS if p.id in (
    "AdamW-default", "AdamW-fused", "Adam-amsgrad", "SGD-momentum")])
def test_steps_equal_the_masters_in_ram(cls, kwargs, state_tier, device, tmp_path):
    (ram_model, ram), (model, optimizer) = runs = twins(cls, kwargs, tmp_path, device, state_tier=state_tier)
    assert all(s.storage.masters_file is not None for s in model._engine.slices)
    assert all(s.storage.masters_file is None for s in ram_model._engine.slices)
    train(runs, 4)
    optimizer.synchronize()
    # Between steps no slice's masters are in RAM: only in their files.
    assert resident(model) == 0
    footprint = model.memory_footprint()
    files = sum(page_aligned(s.storage.host_nbytes) for s in model._engine.slices)
    assert footprint.host_masters == 0 and footprint.disk >= files
    # Nor their gradients (Note: [Gradients on disk]): .grad is in the slices' gradient files.
    assert footprint.host_gradients == 0 and all(
        s.storage.gradient_home.holds(j, e.tensor.grad) for s in model._engine.slices for j, e in enumerate(s.storage.params))
    assert footprint.host_total == (ram_model.memory_footprint().host_total
                                    - ram_model.memory_footprint().host_masters
                                    - ram_model.memory_footprint().host_gradients
                                    - (ram_model.memory_footprint().host_optimizer_state if state_tier else 0)
                                    + footprint.host_disk_window
                                    # the window gradients land in before they go to their files
                                    + footprint.host_pool_idle - ram_model.memory_footprint().host_pool_idle)
    assert_same(ram_model, ram, model, optimizer)  # reading the parameters reads their pages in


@pytest.mark.parametrize("fused", [False, True])
def test_accumulation_clipping_and_a_grad_scaler_skip(fused, tmp_path):
    # Every backward after the first of a step finds the shadows out of date: they are cast from
    # the masters read in from disk.
    runs = twins(torch.optim.AdamW, {"lr": 1e-2, "fused": fused}, tmp_path, state_tier=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in runs]
    for step in range(4):
        for (model, optimizer), scaler in zip(runs, scalers):
            for micro in range(3):
                loss = loss_of(model, 10 * step + micro) / 3
                if step == 2 and micro == 1:
                    loss = loss * float("inf")  # an overflow: the step is skipped
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=step % 2 == 0)
    (ram_model, ram), (model, optimizer) = runs
    optimizer.synchronize()
    assert resident(model) == 0
    assert_same(ram_model, ram, model, optimizer)


@pytest.mark.parametrize("convert", [lambda m: m.half().float(), lambda m: m.double()], ids=["half-float", "double"])
def test_a_dtype_conversion_puts_the_gradients_back_in_their_files(convert, tmp_path):
    # nn.Module._apply converts each .grad into a new tensor in RAM; each goes back into its slice's
    # new gradient file, the same tensor with the same values, and later backwards land there
    # (Note: [Gradients on disk]) instead of adding into .grad in RAM for the rest of the run.
    runs = twins(torch.optim.SGD, {"lr": 0.1}, tmp_path)
    (ram_model, ram), (model, optimizer) = runs

    def steps(first):
        for step in range(first, first + 2):
            for m, o in runs:
                loss_of(m, step).backward()
                o.step()
                o.zero_grad(set_to_none=False)  # the usual loop: .grad stays, zeroed

    steps(0)
    for m, _ in runs:
        loss_of(m, 2).backward()  # gradients to convert
    before = model.memory_footprint().host_gradients
    grads = [p.grad for p in model.parameters()]
    for m, _ in runs:
        convert(m)
    assert model.memory_footprint().host_gradients == before == 0
    assert all(s.storage.gradient_home.holds(j, e.tensor.grad)
               for s in model._engine.slices for j, e in enumerate(s.storage.params))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # as nn.Module._apply keeps them
    for (name, a), b in zip(ram_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    for _, o in runs:
        o.step()
        o.zero_grad(set_to_none=False)
    steps(3)
    optimizer.synchronize()
    assert model.memory_footprint().host_gradients == 0
    for (name, a), b in zip(ram_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert_same(ram_model, ram, model, optimizer)


def test_forwards_read_what_was_written_through_the_parameters(tmp_path):
    (ram_model, ram), (model, optimizer) = runs = twins(torch.optim.SGD, {"lr": 0.1}, tmp_path)
    train(runs, 2)
    for m in (ram_model, model):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.5)  # by hand, between steps: the next forward casts the shadow again
    x = torch.randn(4, 6)
    with torch.no_grad():
        assert torch.equal(ram_model(x), model(x))
        assert torch.equal(ram_model(x), model(x))  # evaluation: every forward reads the masters in
    assert resident(model) == 0
    assert model.state_dict().keys() == ram_model.state_dict().keys()
    for (name, a), b in zip(ram_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("set_to_none", [True, False])
def test_masters_are_read_in_and_written_back_around_each_update(set_to_none, tmp_path):
    _, (model, optimizer) = twins(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
    files = model._engine.master_files
    for step in range(3):
        # zero_grad(set_to_none=False) waits for the updates, which keep the shadows they wrote:
        # the next forward does not read the masters in again to cast them.
        optimizer.zero_grad(set_to_none=set_to_none)
        loss_of(model, step).backward()
        optimizer.step()
    optimizer.synchronize()
    total = sum(s.storage.masters_file.nbytes for s in model._engine.slices)
    grads = sum(s.storage.gradient_home.file.nbytes for s in model._engine.slices)
    # Building wrote the masters out; the first forward read them in to cast the shadows and
    # dropped them; each of the three steps read every slice in and wrote it back once, with its
    # gradients, which each backward also wrote once as they landed (Note: [Gradients on disk]).
    assert files.counters.read_bytes == (1 + 3) * total + 3 * grads
    assert files.counters.write_bytes == (1 + 1 + 3) * total + 3 * 2 * grads


class SlowAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        time.sleep(0.08)  # the reader, unhindered, gets well ahead of the updates
        return super().step(closure)


@pytest.mark.parametrize("window", [WINDOW, 100], ids=["window", "no-window"])
def test_ram_holds_a_window_of_slices_while_the_optimizer_steps(window, tmp_path, monkeypatch):
    # Updates slower than reads: without the window the reader would read every slice in ahead.
    monkeypatch.setattr(master_files, "WINDOW", window)
    layers = lambda: nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # noqa: E731
    model = OffloadModel(layers(), device="cpu", num_slices=8, compute_dtype=BF16,
                         masters=DiskTier(tmp_path))
    optimizer = OffloadOptimizer(model, SlowAdamW, lr=1e-3)
    live, most, lock = set(), [0], threading.Lock()
    real_read, real_write = mapped.MappedFile.read_in, mapped.MappedFile.write_back

    def read_in(self, write=True):
        real_read(self, write)
        with lock:
            if self.what == "masters":  # the gradients' files go with them: test_gradients_on_disk.py
                live.add(id(self))
            most[0] = max(most[0], len(live))

    def write_back(self):
        real_write(self)
        with lock:
            live.discard(id(self))

    monkeypatch.setattr(mapped.MappedFile, "read_in", read_in)
    monkeypatch.setattr(mapped.MappedFile, "write_back", write_back)
    for _ in range(2):
        model(torch.randn(4, 64)).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    assert not live and resident(model) == 0
    if window == WINDOW:
        assert 2 <= most[0] <= WINDOW  # reads overlap updates, within the window
    else:
        assert most[0] > WINDOW  # the check above can fail


def test_files_are_unlinked_counted_and_never_shared(tmp_path):
    a = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=tmp_path)
    b = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=DiskTier(tmp_path))
    assert os.listdir(tmp_path) == []  # unlinked as soon as mapped: a killed process leaves nothing
    pa = [s.storage.masters_file for s in a._engine.slices]
    pb = [s.storage.masters_file for s in b._engine.slices]
    assert len({f.path for f in pa + pb}) == 6
    homes = [s.storage.gradient_home.file for s in a._engine.slices]
    assert a.memory_footprint().disk == sum(f.nbytes for f in pa + homes)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()
    with torch.no_grad():
        next(a.parameters()).add_(1.0)
    assert not torch.equal(next(a.parameters()), next(b.parameters()))


def test_copies_and_pickles_keep_the_masters_on_disk(tmp_path):
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=tmp_path)
    x = torch.randn(3, 6)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(s.storage.masters_file is not None for s in twin._engine.slices)
        assert twin.memory_footprint().disk == model.memory_footprint().disk
        with torch.no_grad():
            assert torch.equal(twin(x), model(x))


def test_counters_add_up_when_the_caller_and_the_workers_move_masters_at_once(tmp_path, monkeypatch):
    # A forward casts a slice that no update wrote (a frozen one) on the calling thread while the
    # reader and the writer move other slices: three threads add to one model's counters. Each
    # call here takes one second of a fake clock, and reading the clock lets another thread run.
    counters = mapped.DiskCounters()
    files = [mapped.MappedFile(tmp_path, 4096, counters) for _ in range(3)]
    clock = threading.local()

    def perf_counter():
        clock.now = getattr(clock, "now", 0.0) + 0.5
        time.sleep(0.001)
        return clock.now

    monkeypatch.setattr(mapped.time, "perf_counter", perf_counter)
    calls = 20

    def move(file):
        for _ in range(calls):
            file.read_in()
            file.write_back()

    threads = [threading.Thread(target=move, args=(file,)) for file in files]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counters.read_bytes == counters.write_bytes == 3 * calls * 4096
    assert counters.read_seconds == counters.write_seconds == 3 * calls * 0.5


def test_a_full_disk_is_a_clear_error_when_the_model_is_built(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mapped.os, "posix_fallocate", full)
    with pytest.raises(DiskTierError, match="No space left on device.*Free space there"):
        OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("added", ["parameter", "buffer"])
def test_a_full_disk_when_a_slice_is_laid_out_again_leaves_it_to_be_laid_out_at_the_next_forward(
        added, tmp_path, monkeypatch):
    models = [OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=masters)
              for masters in (None, tmp_path)]
    x = torch.randn(3, 6)
    extra = torch.randn(3)
    for model in models:
        with torch.no_grad():
            model(x)
        layer = model.get_submodule("7")
        if added == "parameter":
            layer.register_parameter("extra", nn.Parameter(extra.clone()))
        else:
            layer.register_buffer("extra", extra.clone())
    real = mapped.os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mapped.os, "posix_fallocate", full)
    with pytest.raises(DiskTierError, match="No space left on device"):
        with torch.no_grad():
            models[1](x)
    monkeypatch.setattr(mapped.os, "posix_fallocate", real)  # space was freed
    with torch.no_grad():
        assert torch.equal(models[0](x), models[1](x))
    storage = models[1]._engine.slices[2].storage
    assert storage.holds(models[1].get_submodule("7").extra)
    assert storage.flat.numel() == storage.host_nbytes


class FailsFirstSlice(torch.optim.SGD):
    """SGD that raises, before changing anything, when it steps the tensor whose memory starts
    at ``target``."""

    target = None

    def step(self, closure=None):
        if any(p.data_ptr() == FailsFirstSlice.target for group in self.param_groups for p in group["params"]):
            raise MemoryError("no memory for a temporary (simulated)")
        return super().step(closure)


def test_updates_skipped_after_a_failed_one_leave_no_masters_in_ram(tmp_path, monkeypatch):
    # Slice 0's update fails, so the worker skips the updates after it without waiting for their
    # reads; the write of slice 2 must still come after its read, which is slow here.
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=tmp_path)
    optimizer = OffloadOptimizer(model, FailsFirstSlice, lr=0.1, fused=True)
    # The first step of a class outside torch.optim waits for its updates (Note: [An optimizer that
    # draws random numbers]): the one watched here is the second, overlapped.
    loss_of(model, 1).backward()
    optimizer.step()
    optimizer.zero_grad()
    slow = model._engine.slices[2].storage.masters_file
    real = mapped.MappedFile.read_in

    def read_in(self, write=True):
        if self is slow and threading.current_thread().name == "offload masters read":
            time.sleep(0.3)
        real(self, write)

    monkeypatch.setattr(mapped.MappedFile, "read_in", read_in)
    loss_of(model, 0).backward()
    FailsFirstSlice.target = model._engine.slices[0].storage.params[0].tensor.data_ptr()
    optimizer.step()
    with pytest.raises(HostUpdateError, match="slice 0"):
        optimizer.synchronize()
    FailsFirstSlice.target = None
    reader = model._engine.master_files._reader
    while reader.finished < reader.submitted:
        time.sleep(0.01)
    optimizer.synchronize()
    assert resident(model) == 0


@pytest.mark.parametrize("error", [OSError(errno.EIO, os.strerror(errno.EIO)), RuntimeError("unexpected (simulated)")],
                         ids=["io-error", "unexpected"])
def test_a_failed_read_leaves_that_slice_and_later_ones_untouched(error, tmp_path, monkeypatch):
    # Any error, not only an OSError: nothing waits for the reader's events on the caller's
    # thread, so it must reach the caller through the update, and the reads after it go on.
    _, (model, optimizer) = twins(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
    train([(model, optimizer)], 1)
    optimizer.synchronize()
    before = [[e.tensor.detach().clone() for e in s.storage.params] for s in model._engine.slices]
    broken = model._engine.slices[1].storage.masters_file
    real = mapped.MappedFile.read_in

    def read_in(self, write=True):
        if self is broken:
            raise error
        real(self, write)

    optimizer.zero_grad()
    loss_of(model, 1).backward()
    monkeypatch.setattr(mapped.MappedFile, "read_in", read_in)
    optimizer.step()
    why = "Input/output error" if isinstance(error, OSError) else "unexpected"
    with pytest.raises(HostUpdateError, match=f"masters or gradients of slice 1 from .*offload-masters-.*{why}.*slice 1 was left as it "
                                              "was.*the slices after it were left") as raised:
        optimizer.synchronize()
    assert raised.value.__cause__ is error
    monkeypatch.setattr(mapped.MappedFile, "read_in", real)
    for s, old in zip(model._engine.slices, before):
        for e, value in zip(s.storage.params, old):
            assert torch.equal(e.tensor, value) == (s.index >= 1), f"slice {s.index}"
    files = model._engine.master_files
    # The reads after the failed one may still be running (nothing waits for them): count from
    # when the reader is idle.
    while files._reader.finished < files._reader.submitted:
        time.sleep(0.01)
    read = files.counters.read_bytes
    optimizer.step()  # training goes on, and the reader still reads
    optimizer.synchronize()
    assert files.counters.read_bytes - read == sum(s.storage.masters_file.nbytes + s.storage.gradient_home.file.nbytes
                                                   for s in model._engine.slices)
    assert resident(model) == 0


def test_a_failed_write_is_raised_and_loses_nothing(tmp_path, monkeypatch):
    (ram_model, ram), (model, optimizer) = runs = twins(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
    train(runs, 1)
    optimizer.synchronize()
    real = mapped.MappedFile.write_back
    failed = []

    def write_back(self):  # the first write after an update fails
        if not failed and threading.current_thread().name == "offload masters write" and self.what == "masters":
            failed.append(self)
            raise OSError(errno.EIO, os.strerror(errno.EIO), self.path)
        real(self)

    monkeypatch.setattr(mapped.MappedFile, "write_back", write_back)
    train(runs, 1, first=1)
    with pytest.raises(DiskTierError, match=r"masters or gradients of 1 slice\(s\) back to disk \(slice 0: .*offload-masters-.*in RAM for now"):
        optimizer.synchronize()
    monkeypatch.setattr(mapped.MappedFile, "write_back", real)
    optimizer.synchronize()  # raised once
    train(runs, 2, first=2)
    # Nothing is lost in RAM (this kernel kept the pages), but state_dict() and saves refuse until
    # a load (tests/test_masters_write_failure.py): compare the state where it is held.
    with pytest.raises(RuntimeError, match=r"may mix two steps: the masters or gradients of slice\(s\) 0"):
        optimizer.state_dict()
    assert_same_where_held(ram_model, ram, model, optimizer)


def test_loading_a_checkpoint_slice_by_slice_puts_the_masters_on_disk(tmp_path):
    from safetensors.torch import save_file

    save_file(network().state_dict(), tmp_path / "model.safetensors")
    model = load_sequential(network, tmp_path / "model.safetensors", "cpu", num_slices=3, compute_dtype=BF16,
                            masters=DiskTier(tmp_path / "masters"))
    assert resident(model) == 0
    for a, b in zip(model.parameters(), network().parameters()):
        assert torch.equal(a, b)


def test_a_checkpoint_resumes_exactly(tmp_path):
    def build():
        model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=tmp_path / "m")
        return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tmp_path / "s")

    whole = build()
    train([whole], 4)
    first = build()
    train([first], 2)
    save_checkpoint(tmp_path / "ckpt" / "step-2", *first)
    assert resident(first[0]) == 0  # the save read every master: dropped again
    resumed = build()
    load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), *resumed)
    assert resident(resumed[0]) == 0
    train([resumed], 2, first=2)
    assert_same(*whole, *resumed)


def test_the_estimate_counts_the_masters_on_disk(tmp_path):
    layers = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    plan = estimate_memory(copy.deepcopy(layers), num_slices=4, compute_dtype=BF16, optimizer="adamw",
                           optimizer_state="disk", masters="disk", device="cpu")
    model = OffloadModel(layers, device="cpu", num_slices=4, compute_dtype=BF16, masters=tmp_path / "m")
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True, disk_tier=tmp_path / "s")
    for _ in range(2):
        model(torch.randn(4, 128)).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    measured = model.memory_footprint()
    assert measured.host_masters == plan.host_masters == 0
    assert measured.host_shadows == plan.host_shadows
    assert abs(measured.disk - plan.disk) <= 0.05 * plan.disk
    assert measured.host_gradients == plan.host_gradients == 0  # Note: [Gradients on disk]
    # Both windows count three slices' state, masters and gradients, in RAM while the optimizer
    # steps, though between steps the masters' and gradients' pages are dropped.
    per_slice_masters = 2 * 4 * (128 * 128 + 128)
    assert measured.host_disk_window >= WINDOW * 2 * per_slice_masters
    assert abs(plan.host_disk_window - measured.host_disk_window) <= 0.01 * measured.host_disk_window
    assert abs(plan.host_total - measured.host_total) <= 0.01 * measured.host_total


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="need a compute_dtype"):
        OffloadModel(network(), device="cpu", masters=tmp_path)
    with pytest.raises(ValueError, match="keep=True.*Save a checkpoint"):
        OffloadModel(network(), device="cpu", compute_dtype=BF16, masters=DiskTier(tmp_path, keep=True))
    with pytest.raises(TypeError, match="masters must be None, a DiskTier or a directory path, got int"):
        OffloadModel(network(), device="cpu", compute_dtype=BF16, masters=3)
    with pytest.raises(ValueError, match="masters='disk' needs a compute_dtype"):
        estimate_memory([100] * 4, masters="disk")
    # A mistyped directory is not created (with its parents) wherever it points.
    missing = tmp_path / "no" / "such"
    with pytest.raises(ValueError, match=rf"masters directory {missing}: its parent directory {missing.parent} does "
                                         "not exist; create it first"):
        OffloadModel(network(), device="cpu", compute_dtype=BF16, masters=missing)
    assert not missing.parent.exists()


def test_an_unexpected_error_in_the_writer_is_raised_and_the_writes_go_on(tmp_path, monkeypatch):
    _, (model, optimizer) = twins(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
    train([(model, optimizer)], 1)
    optimizer.synchronize()
    real = mapped.MappedFile.write_back
    failed = []

    def write_back(self):
        if not failed and threading.current_thread().name == "offload masters write" and self.what == "masters":
            failed.append(self)
            raise RuntimeError("not an OSError")
        real(self)

    monkeypatch.setattr(mapped.MappedFile, "write_back", write_back)
    train([(model, optimizer)], 1, first=1)
    with pytest.raises(DiskTierError, match=r"slice 0: .*RuntimeError: not an OSError.*reload the last checkpoint"):
        optimizer.synchronize()
    # The writes after it were not skipped: only the failed slice's pages are still in RAM.
    files = [s.storage.masters_file for s in model._engine.slices]
    assert files[0] is failed[0] and all(f.resident_bytes() == 0 for f in files[1:])
    monkeypatch.setattr(mapped.MappedFile, "write_back", real)
    train([(model, optimizer)], 1, first=2)
    optimizer.synchronize()
    assert resident(model) == 0


def test_the_footprint_waits_for_the_write_backs_and_the_repr_names_the_directory(tmp_path, monkeypatch):
    _, (model, optimizer) = twins(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
    real = mapped.MappedFile.write_back

    def slow_write_back(self):
        time.sleep(0.1)
        real(self)

    monkeypatch.setattr(mapped.MappedFile, "write_back", slow_write_back)
    train([(model, optimizer)], 2)
    # No synchronize(): the footprint waits for the updates and then for their write-backs.
    assert model.memory_footprint().host_masters == 0
    assert f"masters on disk in {tmp_path / 'masters'}" in repr(model)


@pytest.mark.parametrize("state_tier", [False, True], ids=["state-in-ram", "state-on-disk"])
def test_a_save_holds_about_one_slice_of_masters_in_ram(state_tier, tmp_path, monkeypatch):
    # DCP reads each model tensor through its slice's mapping; the planner drops a slice's pages
    # once DCP asks for the next slice's first tensor.
    from offload.checkpoint.slice_save_planner import SliceReadingSavePlanner

    layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    model = OffloadModel(layers, device="cpu", num_slices=8, compute_dtype=BF16, masters=tmp_path / "m")
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True,
                                 disk_tier=tmp_path / "s" if state_tier else None)
    model(torch.randn(2, 64)).float().sum().backward()
    optimizer.step()
    optimizer.synchronize()
    most = [0]
    real = SliceReadingSavePlanner.resolve_data

    def resolve_data(self, item):
        most[0] = max(most[0], resident(model))
        return real(self, item)

    monkeypatch.setattr(SliceReadingSavePlanner, "resolve_data", resolve_data)
    save_checkpoint(tmp_path / "ckpt", model, optimizer)
    per_slice = model._engine.slices[0].storage.masters_file.nbytes
    assert 0 < most[0] <= per_slice  # the slice being written; 8 slices' without the planner
    assert resident(model) == 0


@pytest.mark.parametrize("state_tier", [False, True], ids=["state-in-ram", "state-on-disk"])
def test_a_load_holds_about_one_slice_of_masters_in_ram(state_tier, tmp_path, monkeypatch):
    # DCP loads each model tensor into its slice's mapping; once a slice's last one is in, the
    # planner writes its pages back and drops them.
    from offload.checkpoint.slice_load_planner import SliceWritingLoadPlanner

    def build():
        layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
        model = OffloadModel(layers, device="cpu", num_slices=8, compute_dtype=BF16, masters=tmp_path / "m")
        return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True,
                                       disk_tier=tmp_path / "s" if state_tier else None)

    model, optimizer = build()
    model(torch.randn(2, 64)).float().sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path / "ckpt", model, optimizer)
    twin, twin_optimizer = build()
    most = [0]
    real = SliceWritingLoadPlanner.commit_tensor

    def commit_tensor(self, item, tensor):
        most[0] = max(most[0], resident(twin))
        return real(self, item, tensor)

    monkeypatch.setattr(SliceWritingLoadPlanner, "commit_tensor", commit_tensor)
    load_checkpoint(tmp_path / "ckpt", twin, twin_optimizer)
    per_slice = twin._engine.slices[0].storage.masters_file.nbytes
    assert 0 < most[0] <= per_slice  # the slice being loaded; 8 slices' without the planner
    assert resident(twin) == 0
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


class NoPopulate:
    """libc as on Linux before 5.14: ``madvise(MADV_POPULATE_*)`` fails with ``EINVAL``; every
    other call goes to the real libc."""

    def __init__(self, libc) -> None:
        self.libc = libc
        self.refused = 0

    def madvise(self, address, length, advice):
        if advice in (mapped.MADV_POPULATE_READ, mapped.MADV_POPULATE_WRITE):
            self.refused += 1
            import ctypes
            ctypes.set_errno(errno.EINVAL)
            return -1
        return self.libc.madvise(address, length, advice)

    def __getattr__(self, name):
        return getattr(self.libc, name)


def test_without_madv_populate_the_masters_are_read_through_the_file(tmp_path, monkeypatch):
    fake = NoPopulate(mapped._libc)
    monkeypatch.setattr(mapped, "_libc", fake)
    monkeypatch.setattr(mapped, "_populate_works", None)
    monkeypatch.setattr(mapped, "READ_THROUGH_CHUNK", 3 * 4096)  # several reads a file, the last one short
    counters = mapped.DiskCounters()
    file = mapped.MappedFile(tmp_path, 10 * 4096, counters)
    file.tensor.copy_(torch.arange(file.nbytes, dtype=torch.int64).to(torch.uint8))
    file.write_back()
    assert file.resident_bytes() == 0
    file.read_in()
    assert file.resident_bytes() == file.nbytes and counters.read_bytes == file.nbytes
    assert torch.equal(file.tensor, torch.arange(file.nbytes, dtype=torch.int64).to(torch.uint8))
    file.read_in(write=False)
    assert fake.refused == 1  # asked once; the fallback is remembered

    # Training with the masters on disk works as on a newer kernel.
    monkeypatch.setattr(mapped, "_populate_works", None)
    (ram_model, ram), (model, optimizer) = runs = twins(torch.optim.SGD, {"lr": 0.1}, tmp_path)
    train(runs, 2)
    optimizer.synchronize()
    assert resident(model) == 0
    for a, b in zip(ram_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert fake.refused == 2  # once more after the reset above, then remembered for every file


def test_a_read_error_in_the_read_through_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped, "_libc", NoPopulate(mapped._libc))
    monkeypatch.setattr(mapped, "_populate_works", None)

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    file = mapped.MappedFile(tmp_path, 4096, mapped.DiskCounters())
    monkeypatch.setattr(mapped.os, "preadv", failing)
    with pytest.raises(OSError, match="reading the masters in") as raised:
        file.read_in()
    assert raised.value.errno == errno.EIO and raised.value.filename == file.path
