"""Failures of the updates that backward starts (``update_in_backward=True``), with the disk tier.

A state write that fails during the backward that updates never loses or doubles an update, and
never leaves a mix of two steps that a save would take: each message says what is true where it
is raised, and following its advice ends where the plain optimizer ends, parameters and state, bit
for bit (Note: [Disk tier failures] in offload/tiers/disk_tier.py, rules 1-3). An update that
fails in that schedule claims no order of the slices that it cannot know (Note: [An update that
failed part way] in offload/optimizing/partial_failure.py): the refusal to save names the slices
updated, and reloading the last checkpoint trains on exactly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from collections.abc import Iterator

import pytest
import torch

from offload import (DiskTier, DiskTierError, HostUpdateError, OffloadModel, OffloadOptimizer, load_checkpoint,
                     save_checkpoint)
from offload.streams import disk

from .test_optimizer import assert_same, loss_of, network

# The per-tensor warning is about the optimizers under comparison, not about what is tested here.
pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

KWARGS = {"lr": 1e-2}
SLICE_OF_PARAMETER = [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]  # network() in three slices


def pair(tmp_path, accumulation_steps=1, hooked=False, optimizer_class=torch.optim.AdamW, tier=True):
    """The plain optimizer on an OffloadModel, and OffloadOptimizer(update_in_backward=True) with a
    disk tier on a twin. ``hooked``: slice 0's first weight has a gradient hook (an identity), so
    its update waits for ``step()`` (Note: [Update in backward])."""
    runs = []
    for offloaded in (False, True):
        model = OffloadModel(network(), device="cpu", num_slices=3)
        if hooked:
            next(model.parameters()).register_hook(lambda grad: grad)
        optimizer = (OffloadOptimizer(model, optimizer_class, disk_tier=DiskTier(tmp_path) if tier else None,
                                      update_in_backward=True, accumulation_steps=accumulation_steps, **KWARGS)
                     if offloaded else torch.optim.AdamW(model.parameters(), **KWARGS))
        runs.append((model, optimizer))
    return runs


def batches_of(step, accumulation_steps):
    return range(step * accumulation_steps, (step + 1) * accumulation_steps)


def backwards(model, step, accumulation_steps):
    for b in batches_of(step, accumulation_steps):
        loss_of(model, b).backward()


def train(runs, steps, accumulation_steps=1):
    for step in steps:
        for model, optimizer in runs:
            optimizer.zero_grad()
            backwards(model, step, accumulation_steps)
            optimizer.step()


def failing_writes(monkeypatch, name):
    """Writes of the tier's file ``name`` fail with ``ENOSPC`` while ``failing[0]`` is set (the file
    exists already: its blocks are allocated, so only the write can fail, as on a disk filled since)."""
    real = os.pwritev
    failing = [False]

    def pwritev(fd, buffers, offset):
        if failing[0] and os.readlink(f"/proc/self/fd/{fd}").endswith(name):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "pwritev", pwritev)
    return failing


def step_whose_write_fails(runs, failing, accumulation_steps=1):
    """Steps 0 and 1 (the first only checks; the second updates in backward), then step 2, whose
    backward updates the slices and the write of slice 1's state fails; returns what its
    ``step()`` raised."""
    (_, _), (model, optimizer) = runs
    train(runs, range(2), accumulation_steps)
    optimizer.synchronize()  # the writes of those steps are done
    train(runs[:1], [2], accumulation_steps)
    failing[0] = True
    optimizer.zero_grad()
    backwards(model, 2, accumulation_steps)
    assert optimizer._in_backward.started, "backward started no update: nothing is tested"
    with pytest.raises(DiskTierError, match="slice-00001.state") as raised:
        optimizer.step()
    return str(raised.value)


@pytest.mark.parametrize("hooked", [False, True], ids=["every-slice-in-backward", "a-slice-waits-for-step"])
def test_step_raises_a_write_of_the_updates_backward_ran_once_the_step_is_whole(hooked, tmp_path, monkeypatch):
    """Rule 1: ``step()`` starts what backward left (here slice 0, whose weight has a gradient
    hook) before it raises the failed write, and says the step is done: carrying on, as it
    advises, trains on exactly. Raised first, as at the start of ``step()`` without the option, it
    said "updated nothing, call step() again" (which updated backward's slices twice) and left
    slice 0 a step behind, a mix that state_dict() handed out."""
    runs = pair(tmp_path / "state", hooked=hooked)
    failing = failing_writes(monkeypatch, "slice-00001.state")
    message = step_whose_write_fails(runs, failing)
    assert set(runs[1][1]._in_backward.deferred) == ({0} if hooked else set())
    assert "The step is done: backward updated those slices" in message, message
    assert "carry on (zero_grad(), the next batch) without calling step() again for this step" in message, message
    assert "updated nothing" not in message and "call step() again:" not in message, message
    # This step, whole: every slice updated once, slice 1's state read from where it is held.
    assert_same(*runs[0], *runs[1])
    failing[0] = False  # space freed: as advised, the next batch
    train(runs, [3])
    assert_same(*runs[0], *runs[1])
    assert sorted(os.listdir(runs[1][1]._tier.directory)) == ["owner.json"] + [f"slice-{k:05d}.state" for k in range(3)]


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_backward_that_cannot_write_the_held_state_updates_nothing_and_its_advice_trains_on_exactly(
        accumulation_steps, tmp_path, monkeypatch):
    """Rule 2: still full, the backward that starts the next step's updates writes the held state
    first, fails, and raises before any update or gradient reached the model: the error says so,
    and to zero_grad() and run the batch (the accumulation) again. Before, it said to call
    ``step()`` again, which stepped nothing: the batch was lost."""
    runs = pair(tmp_path / "state", accumulation_steps=accumulation_steps)
    (plain_model, plain), (model, optimizer) = runs
    failing = failing_writes(monkeypatch, "slice-00001.state")
    step_whose_write_fails(runs, failing, accumulation_steps)
    train(runs[:1], [3], accumulation_steps)
    optimizer.zero_grad()
    *earlier, last = batches_of(3, accumulation_steps)
    for b in earlier:
        loss_of(model, b).backward()
    before = [p.detach().clone() for p in model.parameters()]
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    with pytest.raises(DiskTierError, match="slice-00001.state") as raised:
        loss_of(model, last).backward()
    message = str(raised.value)
    assert "This backward raised before any of its gradients reached the model's parameters" in message, message
    assert "no update of this step ran" in message, message
    assert "then zero_grad() and run the batch again" in message, message
    assert "call step() again" not in message and "The step is done" not in message, message
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # None of its gradients reached .grad: what the accumulation's earlier backwards added, if any.
    assert all((g is None and p.grad is None) or torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    failing[0] = False  # space freed: as advised
    train(runs[1:], [3], accumulation_steps)
    assert optimizer._in_backward.last_started == {0, 1, 2}
    assert_same(plain_model, plain, model, optimizer)
    train(runs, [4], accumulation_steps)
    assert_same(plain_model, plain, model, optimizer)


def test_a_wait_between_backward_and_step_says_to_call_step_once(tmp_path, monkeypatch):
    """Rule 3: between the backward that updated and ``step()``, the step is half done: a wait
    (here ``synchronize()``) that raises the failed write says to call ``step()`` once, as usual,
    not (as after a step) to carry on without it, which left the step's other slices unstepped."""
    runs = pair(tmp_path / "state", hooked=True)
    (plain_model, plain), (model, optimizer) = runs
    failing = failing_writes(monkeypatch, "slice-00001.state")
    train(runs, range(2))
    optimizer.synchronize()
    train(runs[:1], [2])
    failing[0] = True
    optimizer.zero_grad()
    loss_of(model, 2).backward()
    with pytest.raises(DiskTierError, match="slice-00001.state") as raised:
        optimizer.synchronize()
    message = str(raised.value)
    assert "Backward (update_in_backward) updated those slices" in message, message
    assert "call step() once, as usual: it updates the slices backward did not" in message, message
    assert "without calling step() again" not in message and "The step is done" not in message, message
    failing[0] = False
    optimizer.step()  # as advised; the failure was said once
    assert_same(plain_model, plain, model, optimizer)
    train(runs, [3])
    assert_same(plain_model, plain, model, optimizer)


class FlakyAdamW(torch.optim.AdamW):
    """AdamW that raises, before changing anything, when it steps slice 1 while ``failing``."""

    failing = False

    def step(self, closure=None):
        if FlakyAdamW.failing and [tuple(p.shape) for g in self.param_groups for p in g["params"]] == [
                (16, 16), (16,), (16,), (16,)]:
            raise ValueError("injected")
        return super().step(closure)


@contextlib.contextmanager
def slice_1_fails(monkeypatch: pytest.MonkeyPatch, failure: str) -> Iterator[None]:
    """Slice 1's update fails inside the block: its state file's read (``"the-state-read-fails"``)
    or the optimizer (``"the-optimizer-raises"``)."""
    real = os.preadv

    def preadv(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("slice-00001.state"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    if failure == "the-state-read-fails":
        monkeypatch.setattr(disk.os, "preadv", preadv)
    FlakyAdamW.failing = failure == "the-optimizer-raises"
    try:
        yield
    finally:
        FlakyAdamW.failing = False
        monkeypatch.setattr(disk.os, "preadv", real)


@pytest.mark.parametrize("failure", ["the-optimizer-raises", "the-state-read-fails"])
def test_an_update_that_fails_in_backward_claims_no_order_and_reloading_trains_on_exactly(failure, tmp_path,
                                                                                          monkeypatch):
    """Backward runs the updates as the gradients land, last slice first: the error of slice 1's
    update no longer says "slices before it are updated and slices after it were left as they were"
    (slice 2, after it, ran first) as a fact of this step, and the refusal to save names the slices
    whose parameters did change. Its advice, reload the last checkpoint, trains on exactly."""
    runs = pair(tmp_path / "state", optimizer_class=FlakyAdamW, tier=failure == "the-state-read-fails")
    (plain_model, plain), (model, optimizer) = runs
    train(runs, range(2))
    save_checkpoint(tmp_path / "ckpt", model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    with slice_1_fails(monkeypatch, failure), pytest.raises(HostUpdateError, match="slice 1") as raised:
        optimizer.zero_grad()
        loss_of(model, 2).backward()
        optimizer.step()
        optimizer.synchronize()
    message = str(raised.value)
    assert "update_in_backward runs them as their gradients land, last slice first" in message, message
    assert "state_dict() and save_checkpoint refuse any mix of two steps this leaves, naming the slices" in message
    changed = {s for s, p, b in zip(SLICE_OF_PARAMETER, model.parameters(), before) if not torch.equal(p, b)}
    assert 1 not in changed  # it raised before changing anything
    if changed:
        named = ", ".join(map(str, sorted(changed)))
        with pytest.raises(RuntimeError, match=rf"mix two steps: an update failed part way: slice\(s\) {named} "
                                               r"updated, slice\(s\) (\d, )*1 "):
            optimizer.state_dict()
    else:
        optimizer.state_dict()  # nothing changed, nothing to refuse
    load_checkpoint(tmp_path / "ckpt", model, optimizer)  # as advised
    train(runs[:1], [2])
    train(runs[1:], [2])
    assert_same(plain_model, plain, model, optimizer)
    train(runs, [3])
    assert_same(plain_model, plain, model, optimizer)


def test_a_failed_update_in_step_still_names_the_slices_before_and_after_it(tmp_path):
    """From ``step()``, which hands the updates over in slice order, the error keeps saying which
    slices are updated and which are left (and the state matches it)."""
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, FlakyAdamW, **KWARGS)
    train([(model, optimizer)], range(2))
    before = [p.detach().clone() for p in model.parameters()]
    FlakyAdamW.failing = True
    try:
        with pytest.raises(HostUpdateError) as raised:
            train([(model, optimizer)], [2])
            optimizer.synchronize()
    finally:
        FlakyAdamW.failing = False
    assert re.search(r"step\(\) runs them in slice order, so the slices before 1 are updated and the slices after it "
                     r"were left as they were", str(raised.value)), str(raised.value)
    changed = {s for s, p, b in zip(SLICE_OF_PARAMETER, model.parameters(), before) if not torch.equal(p, b)}
    assert changed == {0}


@pytest.mark.parametrize("failure", ["the-optimizer-raises", "the-state-read-fails"])
def test_a_slice_updated_before_the_failure_in_the_same_backward_is_in_the_mix(failure, tmp_path, monkeypatch):
    """A worker that keeps up finishes slice 2's update (its gradients land first) before slice 1's
    is handed over: the record of the step (rule 1 of Note: [An update that failed part way]) still
    counts slice 2 as updated, so the refusal names it, and a failed read of slice 1 (which changed
    nothing itself) still latches the mix. Rounds that ended whenever every update was done forgot
    slice 2: the refusal left it out, or, after the read, nothing refused to save the mix."""
    runs = pair(tmp_path / "state", optimizer_class=FlakyAdamW, tier=failure == "the-state-read-fails")
    model, optimizer = runs[1]
    train(runs, range(2))
    optimizer.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    handed = optimizer._updates.submit_one
    engine = model._engine

    def keeping_up(step, *args, **kwargs):
        handed(step, *args, **kwargs)
        while not engine.copies.has_completed(engine.updates.event(step.index)):
            time.sleep(0.001)  # done (or failed) before backward lands the next slice's gradients

    monkeypatch.setattr(optimizer._updates, "submit_one", keeping_up)
    with slice_1_fails(monkeypatch, failure), pytest.raises(HostUpdateError, match="slice 1"):
        optimizer.zero_grad()
        loss_of(model, 2).backward()
        optimizer.step()
        optimizer.synchronize()
    assert optimizer._in_backward.last_started == {0, 1, 2}
    changed = {s for s, p, b in zip(SLICE_OF_PARAMETER, model.parameters(), before) if not torch.equal(p, b)}
    assert changed == {2}  # slice 1 failed first, and the worker skipped slice 0's update after it
    expected = {"the-optimizer-raises": r"slice\(s\) 2 updated, slice\(s\) 1 raised in its update and may be partly "
                                        r"updated, slice\(s\) 0 left as they were",
                "the-state-read-fails": r"slice\(s\) 2 updated, slice\(s\) 0, 1 left as they were"}[failure]
    with pytest.raises(RuntimeError, match=rf"mix two steps: an update failed part way: {expected}\. state_dict"):
        optimizer.state_dict()
    with pytest.raises(RuntimeError, match=r"slice\(s\) 2 updated"):
        save_checkpoint(tmp_path / "mix", model, optimizer)
    assert not (tmp_path / "mix").exists()
