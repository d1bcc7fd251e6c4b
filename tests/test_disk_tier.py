"""The disk tier: OffloadOptimizer's state in files gives the RAM-resident optimizer's results bit for
bit, overlaps its reads and writes with the update, holds a bounded window in RAM, and fails
safely (Notes: [Disk tier pipeline], [Disk tier failures] in offload/tiers/disk_tier.py)."""

from __future__ import annotations

import collections
import copy
import errno
import gc
import json
import os
import threading
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import (DiskTier, DiskTierError, HostUpdateError, OffloadModel, OffloadOptimizer, estimate_memory,
                     load_checkpoint, save_checkpoint)
from offload.tiers.disk_tier import WINDOW
from offload.streams import disk
from offload.streams.disk import page_aligned

from .disk_full import refuse_allocating, report_free
from .helpers import DEVICES
from .test_optimizer import OPTIMIZERS, assert_same, batch, loss_of, network

# The per-tensor warning is about the optimizers under comparison, not about the tier.
pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")


def trio(cls, kwargs, tmp_path, compute_dtype=None, num_slices=3, device="cpu", **tier):
    """The plain optimizer, OffloadOptimizer with its state in RAM, and with a disk tier, each on a
    twin of the same model."""
    models = [OffloadModel(network(), device=device, num_slices=num_slices, compute_dtype=compute_dtype)
              for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-tensor warning, about the reference itself
        plain = cls(models[0].parameters(), **kwargs)
    ram = OffloadOptimizer(models[1], cls, **kwargs)
    on_disk = OffloadOptimizer(models[2], cls, disk_tier=DiskTier(tmp_path, **tier), **kwargs)
    return list(zip(models, (plain, ram, on_disk)))


def train(runs, steps, first=0):
    for step in range(first, first + steps):
        for m, opt in runs:
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()


def state_tensors_in_ram(optimizer):
    return [key for state in optimizer.state.values() for key, v in state.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("cls, kwargs", [p for p in OPTIMIZERS if p.id in (
    "AdamW-default", "AdamW-foreach", "AdamW-fused", "Adam-amsgrad", "SGD-momentum", "SGD-nesterov")])
def test_steps_equal_the_optimizer_with_its_state_in_ram(cls, kwargs, compute_dtype, device, tmp_path):
    runs = trio(cls, kwargs, tmp_path, compute_dtype, device=device)
    train(runs, 4)
    (plain_model, plain), (ram_model, ram), (model, optimizer) = runs
    assert_same(ram_model, ram, model, optimizer)
    assert_same(plain_model, plain, model, optimizer)
    # Between steps only scalars (AdamW's step) are in optimizer.state: the rest is on disk.
    assert state_tensors_in_ram(optimizer) == []
    assert state_tensors_in_ram(ram) != []


@pytest.mark.parametrize("fused", [False, True])
def test_clipping_accumulation_groups_and_schedulers(fused, tmp_path):
    runs = trio(torch.optim.AdamW, {"lr": 1e-2, "fused": fused}, tmp_path)
    schedulers = []
    for m, opt in runs:
        last = list(m.parameters())[-4:]
        opt.param_groups[0]["params"] = [p for p in m.parameters() if all(p is not q for q in last)]
        opt.add_param_group({"params": last, "lr": 3e-3, "weight_decay": 0.0})
        schedulers.append(torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 5e-3], total_steps=8))
    for step in range(4):
        for (m, opt), scheduler in zip(runs, schedulers):
            for micro in range(3):
                (loss_of(m, 10 * step + micro) / 3).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
            opt.step()
            scheduler.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
    (_, _), (ram_model, ram), (model, optimizer) = runs
    assert_same(ram_model, ram, model, optimizer)


@pytest.mark.parametrize("fused", [False, True])
def test_grad_scaler_steps_and_skips(fused, tmp_path):
    runs = trio(torch.optim.AdamW, {"lr": 1e-2, "fused": fused}, tmp_path, compute_dtype=torch.bfloat16)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in runs]
    for step in range(4):
        for (m, opt), scaler in zip(runs, scalers):
            opt.zero_grad()
            loss = loss_of(m, step)
            if step == 2:
                loss = loss * float("inf")  # an overflow: the step is skipped
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
            scaler.step(opt)
            scaler.update()
    assert len({s.get_scale() for s in scalers}) == 1
    (_, _), (ram_model, ram), (model, optimizer) = runs
    assert_same(ram_model, ram, model, optimizer)


def test_state_dicts_move_both_ways_slice_by_slice(tmp_path):
    runs = trio(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
    train(runs, 2)
    (_, _), (ram_model, ram), (model, optimizer) = runs
    from_ram, from_disk = copy.deepcopy(ram.state_dict()), copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(from_ram)
    ram.load_state_dict(from_disk)
    # Loading moved the state to disk at once (what the user's dict holds is theirs).
    assert state_tensors_in_ram(optimizer) == []
    assert model.memory_footprint().disk > 0
    train(runs, 2, first=2)
    assert_same(ram_model, ram, model, optimizer)
    # A fresh optimizer with a disk tier continues from a saved state as well.
    saved = copy.deepcopy(optimizer.state_dict())
    twin = OffloadModel(network(), device="cpu", num_slices=3)
    twin.load_state_dict(model.state_dict())
    resumed = OffloadOptimizer(twin, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tmp_path / "other")
    resumed.load_state_dict(saved)
    train([(model, optimizer), (twin, resumed)], 2, first=4)
    assert_same(model, optimizer, twin, resumed)


def test_parameters_joining_the_optimizer_after_steps(tmp_path):
    # The slices' parameter lists change: their state comes back from disk, and is laid out anew.
    runs = trio(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
    for m, opt in runs[1:]:
        opt.param_groups[0]["params"] = [p for p in m.parameters() if p.dim() > 1]
    train(runs[1:], 2)
    for m, opt in runs[1:]:
        opt.add_param_group({"params": [p for p in m.parameters() if p.dim() == 1], "lr": 1e-3})
    train(runs[1:], 2, first=2)
    (_, _), (ram_model, ram), (model, optimizer) = runs
    assert_same(ram_model, ram, model, optimizer)
    assert state_tensors_in_ram(optimizer) == []


def edit_state(optimizer, kind, params, key):
    """What a user does to an optimizer's state between steps, the same on any optimizer (Note:
    [State edited between steps] in offload/tiers/state_slice.py); ``key`` is a state tensor's name."""
    state = optimizer.state
    if kind == "assign":  # every other parameter's tensor anew, the other keys left as they are
        for p in params[::2]:
            state[p][key] = torch.full_like(p, 0.25)
    elif kind == "clear":
        state.clear()
    elif kind == "new dict":
        optimizer.state = collections.defaultdict(dict)
    elif kind == "del":  # the first and last slices' parameters
        del state[params[0]], state[params[-1]]
    elif kind == "replace":
        state[params[2]] = {}
    elif kind == "emptied":  # AdamW's: its step goes too
        state[params[2]].clear()


ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "fused": True}, "exp_avg")
SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum_buffer")


@pytest.mark.parametrize("cls, kwargs, key, kind", [
    pytest.param(*optim, kind, id=f"{optim[0].__name__}-{kind}")
    for kind in ("assign", "clear", "new dict", "del", "replace", "emptied") for optim in (ADAMW, SGD)
    if not (kind == "emptied" and optim is SGD)])  # an empty dict emptied: the one reset it cannot see
def test_state_assigned_or_reset_between_steps_is_the_state_as_for_the_plain_optimizer(cls, kwargs, key, kind,
                                                                                       tmp_path):
    runs = trio(cls, kwargs, tmp_path)
    train(runs, 2)
    for m, opt in runs:
        edit_state(opt, kind, list(m.parameters()), key)
    (plain_model, plain), (ram_model, ram), (model, optimizer) = runs
    # What state_dict() hands out before the next step: the assigned tensors, nothing of a reset parameter.
    assert_same(plain_model, plain, model, optimizer)
    window = model.memory_footprint().host_disk_window
    train(runs, 1, first=2)
    optimizer.synchronize()
    # The assigned and the fresh tensors were copied into the slices' places: the window did not grow.
    assert model.memory_footprint().host_disk_window == window
    train(runs, 1, first=3)
    assert_same(plain_model, plain, model, optimizer)
    assert_same(ram_model, ram, model, optimizer)
    assert state_tensors_in_ram(optimizer) == []  # the assigned and the fresh state went to the files


def test_a_checkpoint_saved_after_the_state_was_edited_holds_the_edited_state(tmp_path):
    runs = trio(*ADAMW[:2], tmp_path / "tier")
    train(runs, 2)
    for m, opt in runs:
        edit_state(opt, "assign", list(m.parameters()), "exp_avg")
        edit_state(opt, "del", list(m.parameters()), "exp_avg")
    (plain_model, plain), _, (model, optimizer) = runs
    save_checkpoint(tmp_path / "checkpoint", model, optimizer)
    twin = OffloadModel(network(), device="cpu", num_slices=3)
    resumed = OffloadOptimizer(twin, torch.optim.AdamW, disk_tier=tmp_path / "tier", **ADAMW[1])
    load_checkpoint(tmp_path / "checkpoint", twin, resumed)
    assert_same(plain_model, plain, twin, resumed)
    train([(plain_model, plain), (twin, resumed)], 2, first=2)
    assert_same(plain_model, plain, twin, resumed)


class EditsItsState(torch.optim.AdamW):
    """An optimizer that changes its state in its own step: the first moment in place, the second
    anew."""

    def step(self, closure=None):
        loss = super().step(closure)
        for p in (p for group in self.param_groups for p in group["params"] if p.grad is not None):
            self.state[p]["exp_avg"].mul_(0.5)
            self.state[p]["exp_avg_sq"] = self.state[p]["exp_avg_sq"] * 0.75
        return loss


def test_state_the_optimizer_edits_in_its_step_is_kept_in_place_or_anew(tmp_path):
    # The attached views it edits in place stay in the buffer; the tensor it makes anew is copied in.
    runs = trio(EditsItsState, {"lr": 1e-2, "fused": True}, tmp_path)
    train(runs, 4)
    (plain_model, plain), (ram_model, ram), (model, optimizer) = runs
    assert_same(plain_model, plain, model, optimizer)
    assert_same(ram_model, ram, model, optimizer)
    assert state_tensors_in_ram(optimizer) == []


def test_state_dict_post_hooks_see_the_state_on_disk_and_may_replace_it(tmp_path):
    runs = trio(*ADAMW[:2], tmp_path)
    train(runs, 2)
    seen = collections.defaultdict(list)

    def compact(opt, packed):  # a smaller checkpoint: the moments in bfloat16, in a dict of its own
        return {**packed, "state": {i: {k: v if k == "step" else v.to(torch.bfloat16) for k, v in s.items()}
                                    for i, s in packed["state"].items()}}

    for _, opt in runs:
        opt.register_state_dict_pre_hook(lambda opt: seen[opt].append("pre-hook"))
        opt.register_state_dict_post_hook(lambda opt, packed: seen[opt].append(sorted(packed["state"][0])))
        opt.register_state_dict_post_hook(compact)
    (plain_model, plain), (ram_model, ram), (model, optimizer) = runs
    want = plain.state_dict()
    assert {v.dtype for s in want["state"].values() for k, v in s.items() if k != "step"} == {torch.bfloat16}
    for opt in (ram, optimizer):
        got = opt.state_dict()
        assert seen[opt] == seen[plain] == ["pre-hook", ["exp_avg", "exp_avg_sq", "step"]]
        assert got["param_groups"] == want["param_groups"] and got["state"].keys() == want["state"].keys()
        for i, s in want["state"].items():
            assert got["state"][i].keys() == s.keys()
            for k, v in s.items():
                torch.testing.assert_close(got["state"][i][k], v, rtol=0, atol=0)
    # The hooks changed what state_dict() handed out, not the state: training goes on exactly.
    train(runs, 2, first=2)
    assert_same(plain_model, plain, model, optimizer)
    assert_same(ram_model, ram, model, optimizer)


def test_ram_holds_a_window_of_three_slices(tmp_path):
    # Six slices of equal size: the window is half of the state.
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    model = OffloadModel(layers, device="cpu", num_slices=6)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True, disk_tier=tmp_path)
    assert model.memory_footprint().disk == model.memory_footprint().host_disk_window == 0
    for step in range(3):
        model(torch.randn(4, 32)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    per_slice = page_aligned(2 * 4 * (32 * 32 + 64))  # exp_avg and exp_avg_sq of a weight and a bias
    footprint = model.memory_footprint()
    assert footprint.disk == 6 * per_slice
    assert footprint.host_disk_window == WINDOW * per_slice == 3 * per_slice
    files = sorted(os.listdir(optimizer._tier.directory))
    assert files == ["owner.json"] + [f"slice-{k:05d}.state" for k in range(6)]  # owner: tests/test_disk_tier_leftovers.py
    files = files[1:]
    assert all(os.path.getsize(optimizer._tier.directory / f) == per_slice for f in files)
    counters = optimizer._tier.counters
    assert counters.read_bytes == 2 * 6 * per_slice  # every step after the first reads every slice
    assert counters.write_bytes == 3 * 6 * per_slice


def test_the_first_step_makes_the_state_in_place_of_a_window_buffer(tmp_path, monkeypatch):
    # AdamW's first step makes each slice's state in RAM before the tier copies it into a window
    # buffer: before, each slot kept its own buffer from three slices back, and RAM held three
    # slices' buffers besides the state being made (four slices' state where later steps hold three).
    alive, real_init = [], disk.AlignedBuffer.__init__

    def init(self, nbytes):
        real_init(self, nbytes)
        alive.append(weakref.ref(self))

    in_ram = []

    class Counting(torch.optim.AdamW):
        def step(self, closure=None):
            threading.Event().wait(0.2)  # updates slower than the writes (of a few KiB each)
            in_ram.append(sum(ref() is not None for ref in alive))
            return super().step(closure)

    monkeypatch.setattr(disk.AlignedBuffer, "__init__", init)
    model = OffloadModel(nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]), device="cpu", num_slices=6)
    optimizer = OffloadOptimizer(model, Counting, lr=1e-3, disk_tier=tmp_path)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    optimizer.synchronize()
    assert len(in_ram) == 6
    assert max(in_ram) <= WINDOW - 1, in_ram  # the buffers of the two slices before, at most


def slow_writes(monkeypatch, seconds: float) -> None:
    """Every write of the tier's files waits ``seconds`` first."""
    real = os.pwritev

    def slow(fd, buffers, offset):
        threading.Event().wait(seconds)
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "pwritev", slow)


def test_the_window_holds_three_consecutive_slices_not_three_of_the_largest(tmp_path, monkeypatch):
    # A language model's shape: small slices, then a large last one (the head). Seven slices a step
    # turn the head through all three turns of the window; one buffer per turn grew to three heads.
    # Slow writes: every turn is handed out before the reads that wait for them run.
    slow_writes(monkeypatch, 0.02)

    def layers():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)], nn.Linear(32, 4096))

    plan = estimate_memory(layers(), num_slices=7, optimizer="adamw", optimizer_state="disk", device="cpu")
    models = [OffloadModel(layers(), device="cpu", num_slices=7) for _ in range(2)]
    ram = OffloadOptimizer(models[0], torch.optim.AdamW, lr=1e-3, fused=True)
    on_disk = OffloadOptimizer(models[1], torch.optim.AdamW, lr=1e-3, fused=True, disk_tier=tmp_path)
    for step in range(4):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        for model, optimizer in zip(models, (ram, on_disk)):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_same(models[0], ram, models[1], on_disk)
    assert state_tensors_in_ram(on_disk) == []
    small = page_aligned(2 * 4 * (32 * 32 + 32))  # exp_avg and exp_avg_sq of a weight and a bias
    head = page_aligned(2 * 4 * (32 * 4096 + 4096))
    footprint = models[1].memory_footprint()
    assert footprint.disk == 6 * small + head
    assert footprint.host_disk_window == head + 2 * small < 3 * head / 2
    assert plan.host_disk_window == footprint.host_disk_window


def test_a_window_buffer_is_read_into_only_after_its_write(tmp_path, monkeypatch):
    # Slow writes, six slices in a window of three: slice 3's read must wait for slice 0's write
    # from the same buffer, or slice 0's file would get slice 3's state.
    slow_writes(monkeypatch, 0.05)
    runs = trio(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, tmp_path, num_slices=6)
    train(runs[1:], 3)
    (_, _), (ram_model, ram), (model, optimizer) = runs
    assert_same(ram_model, ram, model, optimizer)


class Held(torch.optim.SGD):
    """SGD whose update of one slice waits until the disk tier has read the next slice's state and
    written the previous one's: possible only if reads and writes run beside the update."""

    gate: threading.Event | None = None
    target: int | None = None
    timed_out = False

    def step(self, closure=None):
        if any(p.data_ptr() == Held.target for group in self.param_groups for p in group["params"]):
            assert Held.gate is not None
            Held.timed_out = not Held.gate.wait(timeout=10)
        return super().step(closure)


def test_reads_and_writes_overlap_the_update(tmp_path, monkeypatch):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, Held, lr=0.1, momentum=0.9, disk_tier=tmp_path)
    Held.target, Held.gate = None, None
    for step in range(2):  # the state is on disk after these
        loss_of(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    files = {optimizer._tier.records[k].file.fd: k for k in range(3)}
    seen: list[tuple[str, int]] = []
    gate = threading.Event()
    real_read, real_write = os.preadv, os.pwritev

    def read(fd, buffers, offset):
        moved = real_read(fd, buffers, offset)
        seen.append(("read", files[fd]))
        if ("read", 2) in seen and ("write", 0) in seen:
            gate.set()
        return moved

    def write(fd, buffers, offset):
        moved = real_write(fd, buffers, offset)
        seen.append(("write", files[fd]))
        if ("read", 2) in seen and ("write", 0) in seen:
            gate.set()
        return moved

    monkeypatch.setattr(disk.os, "preadv", read)
    monkeypatch.setattr(disk.os, "pwritev", write)
    Held.target, Held.gate, Held.timed_out = model._engine.slices[1].storage.params[0].tensor.data_ptr(), gate, False
    loss_of(model, 2).backward()
    optimizer.step()
    optimizer.synchronize()
    assert not Held.timed_out, f"slice 1's update waited for I/O that never ran beside it: {seen}"
    assert seen.index(("read", 0)) < seen.index(("write", 0)) < seen.index(("write", 1))
    assert seen.index(("read", 2)) < seen.index(("write", 1))


def test_a_full_disk_is_a_clear_error_and_the_next_step_works(tmp_path, monkeypatch):
    runs = trio(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
    (_, _), (ram_model, ram), (model, optimizer) = runs
    refusing = refuse_allocating(monkeypatch, "slice-00002.state")
    train(runs[1:], 1)  # slice 2's file cannot be allocated
    with pytest.raises(DiskTierError) as raised:
        optimizer.synchronize()
    message = str(raised.value)
    assert "slice-00002.state" in message and "slice(s) 2 " in message and "No space left" in message
    assert "KiB needed" in message and "are updated" in message and "held in RAM" in message
    # The parameters and the state are this step's (slice 2's state is read from where it is held).
    assert_same(ram_model, ram, model, optimizer)
    # Still full: step() raises again, updating nothing.
    optimizer.zero_grad()
    loss_of(model, 1).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DiskTierError, match="This call to step\\(\\) updated nothing"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # Space freed: the next step writes the held state first and trains on, exactly.
    refusing.clear()
    optimizer.step()
    ram.zero_grad()
    loss_of(ram_model, 1).backward()
    ram.step()
    train(runs[1:], 1, first=2)
    assert_same(ram_model, ram, model, optimizer)
    assert state_tensors_in_ram(optimizer) == []
    assert sorted(os.listdir(optimizer._tier.directory)) == ["owner.json"] + [f"slice-{k:05d}.state" for k in range(3)]


def test_a_failed_write_raised_by_step_leaves_every_slice_updated(tmp_path, monkeypatch):
    # Five slices: slice 3 is read into the window buffer slice 0 was written from, which must
    # not overwrite slice 0's held state.
    runs = trio(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, tmp_path, num_slices=5)
    (_, _), (ram_model, ram), (model, optimizer) = runs
    train(runs[1:], 2)
    optimizer.synchronize()  # the writes of those steps are done
    real = os.pwritev
    failing = [True]

    def pwritev(fd, buffers, offset):
        if failing[0] and os.readlink(f"/proc/self/fd/{fd}").endswith("slice-00000.state"):
            failing[0] = False  # once
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "pwritev", pwritev)
    train(runs[1:], 1, first=2)  # slice 0's write fails: raised at the next step()
    optimizer.zero_grad()
    loss_of(model, 3).backward()
    with pytest.raises(DiskTierError, match="slice-00000.state") as raised:
        optimizer.step()
    assert "Input/output error" in str(raised.value) and "updated nothing" in str(raised.value)
    optimizer.step()  # the same gradients: writes slice 0's held state, then steps
    ram.zero_grad()
    loss_of(ram_model, 3).backward()
    ram.step()
    assert_same(ram_model, ram, model, optimizer)


def test_a_failed_write_raised_by_a_wait_says_the_step_is_done_and_its_advice_trains_on_exactly(tmp_path,
                                                                                                   monkeypatch):
    """A wait (``synchronize()``) raises a failed write after the step that made it: that step is
    done, and ``step()`` again with the same gradients would apply them twice, so the message says
    to carry on; the one ``step()`` raises (it updated nothing) says to call it again. Following
    each, training ends where the plain optimizer's does, bit for bit."""
    runs = trio(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
    (plain_model, plain), _, (model, optimizer) = runs
    runs = [runs[0], runs[2]]
    train(runs, 2)
    optimizer.synchronize()  # the writes of those steps are done
    real = os.pwritev
    failing = [True]

    def pwritev(fd, buffers, offset):
        if failing[0] and os.readlink(f"/proc/self/fd/{fd}").endswith("slice-00001.state"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "pwritev", pwritev)
    train(runs, 1, first=2)
    with pytest.raises(DiskTierError, match="slice-00001.state") as raised:
        optimizer.synchronize()
    message = str(raised.value)
    assert "The step is done: those slices are updated" in message, message
    assert "carry on (zero_grad(), the next batch) without calling step() again for this step" in message, message
    assert "call step() again:" not in message and "updated nothing" not in message, message
    # As advised: the next batch. Still failing, its step() writes the held state first and raises.
    train(runs[:1], 1, first=3)
    optimizer.zero_grad()
    loss_of(model, 3).backward()
    with pytest.raises(DiskTierError, match="slice-00001.state") as raised:
        optimizer.step()
    message = str(raised.value)
    assert "This call to step() updated nothing" in message and "call step() again: it writes" in message, message
    assert "The step is done" not in message, message
    failing[0] = False  # space freed
    optimizer.step()  # as advised: the same gradients, once
    train(runs, 1, first=4)
    assert_same(plain_model, plain, model, optimizer)


def test_a_failed_read_leaves_that_slice_and_later_ones_untouched(tmp_path, monkeypatch):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tmp_path)
    train([(model, optimizer)], 2)
    optimizer.synchronize()
    before_params = [[e.tensor.detach().clone() for e in s.storage.params] for s in model._engine.slices]
    before_state = copy.deepcopy(optimizer.state_dict())
    real = os.preadv

    def preadv(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("slice-00001.state"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "preadv", preadv)
    optimizer.zero_grad()
    loss_of(model, 2).backward()
    optimizer.step()
    with pytest.raises(HostUpdateError, match="slice-00001.state.*slice 1 was left as it was.*slice order, so the "
                                              "slices before 1 are updated and the slices after it were left"):
        optimizer.synchronize()
    monkeypatch.setattr(disk.os, "preadv", real)
    for s, old in zip(model._engine.slices, before_params):
        for e, value in zip(s.storage.params, old):
            assert torch.equal(e.tensor, value) == (s.index >= 1), f"slice {s.index}"
    # Slice 0 is updated, slices 1 and 2 are not: the state mixes two steps, which the optimizer
    # refuses to hand out (Note: [An update that failed part way]).
    with pytest.raises(RuntimeError, match=r"mix two steps: an update failed part way: slice\(s\) 0 updated, "
                                           r"slice\(s\) 1, 2 left as they were\. state_dict\(\) would use"):
        optimizer.state_dict()
    # Looked at past the refusal (slice 0's state may still be held in RAM, its write owed): the same.
    model.load_state_dict(model.state_dict())  # the parameters as they are count as loaded (rule 4)
    optimizer._updates.failure.forget()
    after_state = optimizer.state_dict()
    first_of_slice_1 = len(model._engine.slices[0].storage.params)
    for i, values in after_state["state"].items():
        for key, value in values.items():
            assert torch.equal(value, before_state["state"][i][key]) == (i >= first_of_slice_1), (i, key)
    optimizer.load_state_dict(before_state)  # the state as it was: training goes on
    optimizer.step()
    optimizer.synchronize()


def test_files_are_unique_and_removed(tmp_path):
    made = []
    for _ in range(2):  # two models in one process, one directory
        model = OffloadModel(network(), device="cpu", num_slices=3)
        made.append((model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path)))
    train(made, 2)
    directories = [opt._tier.directory for _, opt in made]
    assert directories[0] != directories[1] and all(d.parent == tmp_path for d in directories)
    # Both trained exactly as one alone would.
    alone = OffloadModel(network(), device="cpu", num_slices=3)
    alone_optimizer = OffloadOptimizer(alone, torch.optim.AdamW, lr=1e-2)
    train([(alone, alone_optimizer)], 2)
    for pair_ in made:
        assert_same(alone, alone_optimizer, *pair_)
    del pair_
    # close() removes the files; the context manager does; so does garbage collection.
    made[0][1].close()
    assert not directories[0].exists() and directories[1].exists()
    footprint = made[0][0].memory_footprint()
    assert footprint.disk == footprint.host_disk_window == 0
    made[0][1].close()  # again: nothing to do
    with pytest.raises(RuntimeError, match="was closed"):
        made[0][1].step()
    with pytest.raises(RuntimeError, match="was closed"):
        made[0][1].state_dict()  # the state went with the files
    model, optimizer = made.pop()
    del optimizer
    gc.collect()
    assert not directories[1].exists()
    with OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, disk_tier=tmp_path) as optimizer:
        train([(model, optimizer)], 2)
        directory = optimizer._tier.directory
        assert len(os.listdir(directory)) == 3 + 1  # and owner.json
    assert not directory.exists()
    assert os.listdir(tmp_path) == []


def test_kept_files_and_their_manifest(tmp_path):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=DiskTier(tmp_path, keep=True))
    train([(model, optimizer)], 2)
    state = optimizer.state_dict()["state"]
    directory = optimizer._tier.directory
    optimizer.close()
    manifest = json.loads((directory / "manifest.json").read_text())
    assert len(manifest["slices"]) == 3
    for entry in manifest["slices"]:
        raw = (directory / entry["file"]).read_bytes()
        for f in entry["fields"]:
            value = torch.frombuffer(bytearray(raw[f["offset"]:f["offset"] + f["nbytes"]]), dtype=torch.float32)
            assert torch.equal(value.view(f["shape"]), state[f["param"]][f["key"]])


def test_buffered_io_where_direct_io_is_refused(tmp_path, monkeypatch):
    real = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(path, flags, *args)

    monkeypatch.setattr(disk.os, "open", refusing)
    monkeypatch.setattr(disk, "_warned", set())
    with pytest.warns(UserWarning, match="does not take direct I/O") as caught:
        runs = trio(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path)
        model = OffloadModel(network(), device="cpu", num_slices=3)
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path / "x").close()
    assert sum("direct I/O" in str(w.message) for w in caught) == 1  # once per filesystem
    assert not runs[2][1]._tier.direct
    train(runs[1:], 3)
    (_, _), (ram_model, ram), (model, optimizer) = runs
    assert_same(ram_model, ram, model, optimizer)


def test_bad_arguments(tmp_path):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    with pytest.raises(TypeError, match="disk_tier must be a DiskTier or a directory path"):
        OffloadOptimizer(model, torch.optim.AdamW, disk_tier=3)


def test_state_moved_to_disk_is_given_back_to_the_system(tmp_path, monkeypatch):
    # AdamW's first step creates the state in RAM; once the tier has moved it to its files, the C
    # heap is asked to return the freed pages (they would stay resident otherwise).
    from offload.tiers import disk_tier

    calls = []
    monkeypatch.setattr(disk_tier, "give_back_freed_memory", lambda: calls.append(1))
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tmp_path)
    train([(model, optimizer)], 1)
    optimizer.synchronize()
    assert calls == [1]
    train([(model, optimizer)], 2, first=1)
    optimizer.synchronize()
    assert calls == [1]  # later steps update the state where it is read: nothing to give back
    optimizer.load_state_dict(optimizer.state_dict())
    assert calls == [1, 1]


def slow_writes(monkeypatch, seconds=0.05):
    """Each state file write takes ``seconds`` longer, so that writes are still queued when the
    caller goes on; returns the list of the files whose write completed, in order."""
    import time

    real = disk.StateFile.write
    done = []

    def write(self, buffer, nbytes):
        time.sleep(seconds)
        real(self, buffer, nbytes)
        done.append(self.path.name)

    monkeypatch.setattr(disk.StateFile, "write", write)
    return done


def open_files_in(directory):
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def test_close_waits_for_the_queued_writes_and_leaves_no_file_or_descriptor(tmp_path, monkeypatch):
    written = slow_writes(monkeypatch)
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path)
    directory = optimizer._tier.directory
    with optimizer:
        train([(model, optimizer)], 1)  # the first step's writes make the files, slowly
    # Every write queued was done before the files were closed and removed, none after.
    assert written == ["slice-00000.state", "slice-00001.state", "slice-00002.state"]
    assert not directory.exists()
    assert os.listdir(tmp_path) == []
    assert open_files_in(directory) == []


@pytest.mark.parametrize("steps", [1, 3])
def test_kept_files_hold_the_last_steps_state_when_closed_straight_after_it(tmp_path, monkeypatch, steps):
    slow_writes(monkeypatch)
    runs = trio(torch.optim.AdamW, {"lr": 1e-2}, tmp_path, keep=True)[1:]
    train(runs, steps)
    (_, ram), (_, optimizer) = runs
    directory = optimizer._tier.directory
    optimizer.close()  # no synchronize() or state_dict() before: the writes are still queued
    ram.synchronize()
    want = ram.state_dict()["state"]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert len(manifest["slices"]) == 3
    for entry in manifest["slices"]:
        assert entry["place"] == "on disk"
        raw = (directory / entry["file"]).read_bytes()
        for f in entry["fields"]:
            value = torch.frombuffer(bytearray(raw[f["offset"]:f["offset"] + f["nbytes"]]), dtype=torch.float32)
            torch.testing.assert_close(value.view(f["shape"]), want[f["param"]][f["key"]], rtol=0, atol=0)
    assert open_files_in(directory) == []


def test_a_disk_without_room_for_the_state_is_refused_before_any_step(tmp_path, monkeypatch):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    n = sum(p.numel() for p in model.parameters())
    report_free(monkeypatch, 8 * n - 1)  # AdamW keeps 8 bytes per float32 parameter
    with pytest.raises(DiskTierError, match=rf"needs about .* in {tmp_path} for the optimizer's state \(AdamW over "
                                            rf"{n:,} parameters that train\), and its filesystem has .* free"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path)
    assert os.listdir(tmp_path) == []
    with pytest.raises(DiskTierError, match="needs about"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path / "new")
    assert os.listdir(tmp_path) == []  # not even the directory it would have made
    report_free(monkeypatch, 8 * n + 2 * 4096)
    OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path).close()
    # SGD without momentum keeps nothing per element: only the test page is needed.
    report_free(monkeypatch, 4096)
    OffloadOptimizer(model, torch.optim.SGD, lr=1e-2, disk_tier=tmp_path).close()


@pytest.mark.parametrize("kept_elsewhere", ["frozen", "resident"])
def test_the_room_asked_for_counts_only_the_state_the_tier_will_keep(tmp_path, monkeypatch, kept_elsewhere):
    # A frozen parameter gets no gradient and so no state, and a resident slice's state stays on
    # the device: a LoRA run's tier needs room for the adapters' state, not the base model's.
    layers = network()
    if kept_elsewhere == "frozen":
        layers[0].requires_grad_(False)
        model = OffloadModel(layers, device="cpu", num_slices=3)
        kept = sum(p.numel() for p in model.parameters() if p.requires_grad)
    else:
        model = OffloadModel(layers, device="cpu", num_slices=3, resident_slices=1)
        named = dict(model.named_children())
        kept = sum(p.numel() for names in model.partition[1:] for name in names for p in named[name].parameters())
    assert kept < sum(p.numel() for p in model.parameters())
    report_free(monkeypatch, 8 * kept - 1)
    with pytest.raises(DiskTierError, match=rf"\(AdamW over {kept:,} parameters that train\)"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path)
    report_free(monkeypatch, 8 * kept + 2 * 4096)
    OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path).close()


def test_a_full_disk_at_construction_names_the_directory_and_leaves_nothing(tmp_path, monkeypatch):
    real = os.pwritev

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk.os, "pwritev", full)
    model = OffloadModel(network(), device="cpu", num_slices=3)
    with pytest.raises(DiskTierError, match=rf"could not write a test page in {tmp_path}/new/offload-state-\w+ "
                                            r"\(.*\.direct-io-probe\): No space left on device \(errno 28\); "
                                            r"the filesystem of .* free and the state needs about"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path / "new")
    assert os.listdir(tmp_path) == []  # neither the probe nor the tier's directories
    monkeypatch.setattr(disk.os, "pwritev", real)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"path": 3}, TypeError, "DiskTier path must be a directory path"),
    ({"path": ""}, TypeError, "DiskTier path must be a directory path"),
    ({"keep": "no"}, TypeError, "DiskTier keep must be True or False, got 'no'"),
    ({"direct": 1}, TypeError, "DiskTier direct must be True or False, got 1"),
], ids=["path-int", "path-empty", "keep-str", "direct-int"])
def test_disk_tier_fields_are_checked(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        DiskTier(**{"path": tmp_path, **kwargs})


def test_a_tier_directory_is_made_only_under_an_existing_writable_parent(tmp_path, monkeypatch):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(ValueError, match=rf"DiskTier path {missing}: its parent directory {missing.parent} does not "
                                         "exist; create it first"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=missing)
    assert os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path / "file")
    # One level is made where the parent exists.
    OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path / "new").close()
    assert (tmp_path / "new").is_dir()
    # Permissions, as an unprivileged user sees them (tests may run as root, who may write anywhere).
    monkeypatch.setattr(disk.os, "access", lambda path, mode: str(path) != str(tmp_path / "locked"))
    (tmp_path / "locked").mkdir()
    with pytest.raises(ValueError, match=rf"DiskTier path {tmp_path / 'locked'} is not writable by this process"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path / "locked")
    with pytest.raises(ValueError, match=rf"cannot create it, {tmp_path / 'locked'} is not writable"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path / "locked" / "x")


@pytest.mark.parametrize("below", [("tier",), ("a", "tier")], ids=["parent", "grandparent"])
def test_a_parent_that_is_a_file_is_named_as_one(tmp_path, below):
    # "Create the parent first" cannot be followed where a file stands in its place: say so, as
    # save_checkpoint() does for a checkpoint path under a file.
    (tmp_path / "file").write_text("x")
    target = tmp_path.joinpath("file", *below)
    said = rf": {tmp_path / 'file'} is a file, not a directory. Choose another path, or move {tmp_path / 'file'} away"
    model = OffloadModel(network(), device="cpu", num_slices=3)
    with pytest.raises(ValueError, match=rf"^DiskTier path {target}{said}"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=DiskTier(target))
    with pytest.raises(ValueError, match=rf"^masters directory {target}{said}"):
        OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16, masters=target)
    assert os.listdir(tmp_path) == ["file"] and (tmp_path / "file").read_text() == "x"


def test_a_directory_another_rank_makes_meanwhile_is_taken_as_it_is(tmp_path, monkeypatch):
    # The ranks of one job name the same directory: one may create it between another's look and
    # its own mkdir. That is not an error, and the directory is not the second rank's to remove.
    from pathlib import Path

    from offload.streams.disk import make_directory

    target = tmp_path / "tier"
    original = Path.mkdir

    def another_rank_first(self, *args, **kwargs):
        if self == target:
            os.mkdir(self)  # the other rank's mkdir lands first
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", another_rank_first)
    assert make_directory(target, "DiskTier path") is False
    assert target.is_dir()


def kept_state(directory) -> dict[int, dict[str, torch.Tensor]]:
    """What a kept tier's files hold, read through its manifest: per parameter, its state tensors."""
    manifest = json.loads((directory / "manifest.json").read_text())
    state: dict[int, dict[str, torch.Tensor]] = {}
    for entry in manifest["slices"]:
        raw = (directory / entry["file"]).read_bytes()
        for f in entry["fields"]:
            value = torch.frombuffer(bytearray(raw[f["offset"]:f["offset"] + f["nbytes"]]), dtype=torch.float32)
            state.setdefault(f["param"], {})[f["key"]] = value.view(f["shape"])
    return state


def test_close_writes_state_held_after_a_failed_write_into_the_kept_files(tmp_path, monkeypatch):
    # A write that failed (a full disk) holds its slice's state in RAM, which close() would let go.
    runs = trio(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, tmp_path, keep=True)[1:]
    (_, ram), (_, optimizer) = runs
    refusing = refuse_allocating(monkeypatch, "slice-00001.state")
    train(runs, 1)
    with pytest.raises(DiskTierError, match="slice-00001.state"):
        optimizer.synchronize()
    refusing.clear()  # space freed
    directory = optimizer._tier.directory
    optimizer.close()
    ram.synchronize()
    want, got = ram.state_dict()["state"], kept_state(directory)
    assert [e["place"] for e in json.loads((directory / "manifest.json").read_text())["slices"]] == ["on disk"] * 3
    assert got.keys() == want.keys()
    for i in want:
        for key, value in got[i].items():
            torch.testing.assert_close(value, want[i][key], rtol=0, atol=0)


def test_close_says_which_held_state_it_could_not_keep(tmp_path, monkeypatch):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=DiskTier(tmp_path, keep=True))
    refuse_allocating(monkeypatch, "slice-00001.state")  # still full at close()
    train([(model, optimizer)], 1)
    with pytest.raises(DiskTierError):
        optimizer.synchronize()
    directory = optimizer._tier.directory
    with pytest.raises(DiskTierError, match=r"close\(\) could not write the optimizer state of slice\(s\) 1 to .*"
                                            r"No space left.*gone with the optimizer"):
        optimizer.close()
    places = [e["place"] for e in json.loads((directory / "manifest.json").read_text())["slices"]]
    assert places == ["on disk", "held in RAM", "on disk"]
    optimizer.close()  # closed: nothing more to say


def test_close_says_the_kept_directory_was_removed_under_it(tmp_path):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=DiskTier(tmp_path, keep=True))
    train([(model, optimizer)], 2)
    optimizer.synchronize()
    directory = optimizer._tier.directory
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    with pytest.raises(DiskTierError, match=rf"directory {directory} was removed while the optimizer used it: the "
                                            r"state files went with it and nothing was kept"):
        optimizer.close()
    assert os.listdir(tmp_path) == []


def test_a_relative_path_is_the_directory_it_named_when_made(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    assert DiskTier("tier").path == str(tmp_path / "a" / "tier")
    assert DiskTier(Path("tier")).path == tmp_path / "a" / "tier"
    runs = trio(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, Path("tier"))
    # Masters on disk too: a slice laid out anew (a buffer added) makes a new file after the chdir.
    masters = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16, masters="masters")
    monkeypatch.chdir(tmp_path / "b")
    train(runs, 3)  # the files are made at the first step, after the chdir
    (plain_model, plain), _, (model, optimizer) = runs
    assert_same(plain_model, plain, model, optimizer)
    masters.get_submodule("4").register_buffer("extra", torch.zeros(3))
    with torch.no_grad():
        masters(batch(0))
    optimizer.close()
    assert os.listdir(tmp_path / "b") == []
    assert os.listdir(tmp_path / "a" / "tier") == [] and (tmp_path / "a" / "masters").is_dir()
