"""Gradients on disk: with the masters on disk, each slice's ``.grad`` lives in a file of its own,
RAM holds a window of landed slices in backward and none between steps, and every way of using
the gradients gives the RAM-resident model's results bit for bit (Note: [Gradients on disk] in
offload/streams/gradient_files.py)."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
from torch import nn

from offload import DiskTier, DiskTierError, OffloadModel, OffloadOptimizer
from offload.streams import mapped
from offload.tiers import master_files
from offload.tiers.disk_tier import WINDOW

from .helpers import DEVICES
from .test_optimizer import assert_same, assert_same_where_held, loss_of, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

BF16 = torch.bfloat16


def twins(tmp_path, layers=network, num_slices=3, device="cpu", **kwargs):
    """The same model and fused AdamW with the masters (and so the gradients) in RAM and on disk."""
    runs = []
    for masters in (None, DiskTier(tmp_path / "masters")):
        model = OffloadModel(layers(), device=device, num_slices=num_slices, compute_dtype=BF16, masters=masters)
        runs.append((model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, **kwargs)))
    return runs


def homes(model):
    return [s.storage.gradient_home for s in model._engine.slices]


def in_files(model):
    """Whether every parameter's ``.grad`` is its place in its slice's gradient file."""
    return all(s.storage.gradient_home.holds(j, e.tensor.grad)
               for s in model._engine.slices for j, e in enumerate(s.storage.params))


def resident(model):
    model._engine.master_files.wait()
    return sum(home.file.resident_bytes() for home in homes(model))


def same_grads(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_grad_lives_in_its_file_and_leaves_ram_after_each_backward(set_to_none, device, tmp_path):
    (ram_model, ram), (model, optimizer) = runs = twins(tmp_path, device=device)
    assert all(home is not None for home in homes(model))
    for step in range(3):
        for m, o in runs:
            o.zero_grad(set_to_none=set_to_none)
            loss_of(m, step).backward()
        assert in_files(model) and resident(model) == 0
        same_grads(ram_model, model)  # reading them reads their pages in again
        for _, o in runs:
            o.step()
        if not set_to_none:
            optimizer.zero_grad(set_to_none=False)
            ram.zero_grad(set_to_none=False)
            # Zeroed by discarding the files: still .grad, zeros, and not brought into RAM.
            assert in_files(model) and resident(model) == 0
            if step < 2:  # reading them brings zero pages in: not after the last step, counted below
                assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    optimizer.synchronize()
    footprint = model.memory_footprint()
    assert footprint.host_gradients == 0 and footprint.disk >= sum(home.file.nbytes for home in homes(model))
    assert_same(ram_model, ram, model, optimizer)


def test_the_model_zero_grad_discards_the_files_too(tmp_path):
    (ram_model, ram), (model, optimizer) = runs = twins(tmp_path)
    for step in range(2):
        for m, o in runs:
            m.zero_grad(set_to_none=False)
            loss_of(m, step).backward()
            o.step()
        optimizer.synchronize()
        model.zero_grad(set_to_none=False)
        assert in_files(model) and resident(model) == 0
    assert_same(ram_model, ram, model, optimizer)


def test_ram_holds_a_window_of_landed_slices_in_backward(tmp_path, monkeypatch):
    run_window_check(tmp_path, monkeypatch, bounded=True)


def test_the_window_check_fails_without_the_wait(tmp_path, monkeypatch):
    run_window_check(tmp_path, monkeypatch, bounded=False)


def run_window_check(tmp_path, monkeypatch, bounded):
    model = OffloadModel(nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)]), device="cpu", num_slices=10,
                         compute_dtype=BF16, masters=DiskTier(tmp_path))
    files = model._engine.master_files
    live, most, lock = [0], [0], threading.Lock()
    real_landed, real_write = files.landed, mapped.MappedFile.write_back

    def landed(home):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        real_landed(home)

    def write_back(self):
        if self.what == "gradients" and threading.current_thread().name == "offload masters write":
            time.sleep(0.05)  # a slow disk: landings outpace the writes
            real_write(self)
            with lock:
                live[0] -= 1
        else:
            real_write(self)

    monkeypatch.setattr(files, "landed", landed)
    monkeypatch.setattr(mapped.MappedFile, "write_back", write_back)
    if not bounded:
        monkeypatch.setattr(files, "before_landing", lambda home: None)
    for home in homes(model):
        home.paging = files  # the patched instance attributes
    model(torch.randn(4, 64)).float().sum().backward()
    files.wait()
    assert live[0] == 0 and resident(model) == 0
    if bounded:
        assert most[0] <= WINDOW
    else:
        assert most[0] > WINDOW


def test_an_update_drops_its_gradients_without_waiting_for_the_masters_write(tmp_path, monkeypatch):
    # Writes slower than updates: before, each slice's gradients stayed in RAM until the write of
    # its masters, beside those of the slices updated and read in after it (Note: [Masters on disk]).
    model = OffloadModel(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), device="cpu", num_slices=8,
                         compute_dtype=BF16, masters=DiskTier(tmp_path))
    in_ram, real_write = [], mapped.MappedFile.write_back

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            in_ram.append({home.index for home in homes(model) if home.file.resident_bytes()})
            return super().step(closure)

    def write_back(self):
        if self.what == "masters":
            time.sleep(0.05)
        real_write(self)

    monkeypatch.setattr(mapped.MappedFile, "write_back", write_back)
    optimizer = OffloadOptimizer(model, Recording, lr=1e-3)
    model(torch.randn(4, 64)).float().sum().backward()
    model._engine.master_files.wait()  # the landings' writes: backward's window, checked above
    optimizer.step()
    optimizer.synchronize()
    assert resident(model) == 0
    # The k-th update (slice order) sees its own gradients and those read in ahead, none updated.
    assert [min(indices) for indices in in_ram] == list(range(8)), in_ram


def test_a_view_kept_across_zero_grad_sends_the_next_gradients_to_ram(tmp_path):
    (ram_model, ram), (model, optimizer) = runs = twins(tmp_path)
    for m, o in runs:
        loss_of(m, 0).backward()
        o.step()
    kept = [p.grad for p in model.parameters()]
    before = [g.clone() for g in kept]
    for m, o in runs:
        o.zero_grad()
        loss_of(m, 1).backward()
    # The files still hold what the kept tensors show; the new gradients went to pooled RAM.
    assert all(torch.equal(g, b) for g, b in zip(kept, before))
    assert not any(s.storage.gradient_home.holds(0, s.storage.params[0].tensor.grad) for s in model._engine.slices)
    same_grads(ram_model, model)
    del kept
    for m, o in runs:
        o.step()
        o.zero_grad()
        loss_of(m, 2).backward()
    assert in_files(model)  # nothing refers to the files any more: they take the gradients again
    same_grads(ram_model, model)
    for _, o in runs:
        o.step()
    assert_same(ram_model, ram, model, optimizer)


def test_accumulation_over_backwards_and_update_in_backward(tmp_path):
    # Backwards after the first add into .grad through autograd (it is not zeros): in place, in the file.
    (ram_model, ram), (model, optimizer) = runs = twins(tmp_path)
    for step in range(2):
        for m, o in runs:
            o.zero_grad()
            for micro in range(3):
                loss_of(m, 10 * step + micro).backward()
        assert in_files(model)
        same_grads(ram_model, model)
        for _, o in runs:
            o.step()
    assert_same(ram_model, ram, model, optimizer)
    (ram_model, ram), (model, optimizer) = runs = twins(tmp_path / "b", update_in_backward=True) if (tmp_path / "b").mkdir() is None else None
    for step in range(3):
        for m, o in runs:
            loss_of(m, step).backward()
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)
    assert_same(ram_model, ram, model, optimizer)


def test_a_failed_write_of_landed_gradients_is_raised(tmp_path, monkeypatch):
    (ram_model, ram), (model, optimizer) = runs = twins(tmp_path)
    real = mapped.MappedFile.write_back
    failed = []

    def write_back(self):
        if not failed and self.what == "gradients":
            failed.append(self)
            raise OSError(errno.EIO, os.strerror(errno.EIO), self.path)
        real(self)

    monkeypatch.setattr(mapped.MappedFile, "write_back", write_back)
    loss_of(model, 0).backward()
    with pytest.raises(DiskTierError, match=r"gradients of 1 slice\(s\) back to disk \(slice 2: .*offload-gradients-"):
        optimizer.step()
    monkeypatch.setattr(mapped.MappedFile, "write_back", real)
    loss_of(ram_model, 0).backward()
    same_grads(ram_model, model)  # the pages that could not be written are still in RAM
    for _, o in runs:
        o.step()
    # Nothing is lost in RAM (this kernel kept the pages), but saves refuse until a load
    # (tests/test_masters_write_failure.py): the state is compared where it is held.
    with pytest.raises(RuntimeError, match=r"may mix two steps: the masters or gradients of slice\(s\) 2"):
        optimizer.state_dict()
    assert_same_where_held(ram_model, ram, model, optimizer)


def test_a_sparse_gradient_stays_in_ram_beside_dense_ones_in_the_file(tmp_path):
    def layers():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(50, 16, sparse=True), nn.Linear(16, 16), nn.Linear(16, 4))

    ram, disk = (OffloadModel(layers(), device="cpu", num_slices=1, compute_dtype=BF16, masters=masters)
                 for masters in (None, DiskTier(tmp_path)))
    tokens = torch.randint(0, 50, (3, 5))
    storage = disk._engine.slices[0].storage
    for step in range(2):
        for model in (ram, disk):
            model.zero_grad()
            model(tokens + step).float().pow(2).sum().backward()
        embedding, *dense = list(zip(ram.parameters(), disk.parameters()))
        assert embedding[1].grad.is_sparse and torch.equal(embedding[1].grad.to_dense(), embedding[0].grad.to_dense())
        assert all(torch.equal(p.grad, q.grad) for p, q in dense)
        assert all(storage.gradient_home.holds(j, e.tensor.grad) for j, e in enumerate(storage.params)
                   if not e.tensor.grad.is_sparse)
