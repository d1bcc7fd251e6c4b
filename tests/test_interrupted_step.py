"""An interrupt (Ctrl-C's ``KeyboardInterrupt``) while ``step()`` hands the slices' updates over:
every update handed over still runs, is waited for like any other, and writes its state to the disk
tier; those not handed over do not run; and the optimizer refuses to save that mix of two steps
until a load, as after an update that failed part way. Training on equals the plain optimizer
stepping the same slices, bit for bit. Each interrupt is raised by a patched function at one point
of the hand-off (not by a signal), so the tests are deterministic. See Note: [An update that failed
part way], rule 6, in offload/optimizing/partial_failure.py, and Note: [Disk tier failures] in
offload/tiers/disk_tier.py."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from offload import OffloadModel, OffloadOptimizer, save_checkpoint
from offload.model import engine_of
from offload.optimizing.stepping import SliceUpdates
from offload.streams import updates as pending
from offload.tiers.master_files import MasterFiles
from offload.tiers.slice_update import SliceStep

from .test_optimizer import EXACT, loss_of, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

KWARGS = {"lr": 1e-2, "fused": True}
MIXED = r"step\(\) raised KeyboardInterrupt while it handed the updates over"


def twins(tmp_path, tier: bool, masters: bool = False, update_in_backward: bool = False, **options: Any):
    """The plain AdamW on an OffloadModel, and an OffloadOptimizer (with a disk tier, the masters
    on disk, and the update in backward, if asked) on a twin, each stepped once."""
    dtype = {"compute_dtype": torch.bfloat16} if masters else {}
    plain_model = OffloadModel(network(), device="cpu", num_slices=3, **dtype, **options)
    model = OffloadModel(network(), device="cpu", num_slices=3, **dtype, **options,
                         **({"masters": tmp_path / "masters"} if masters else {}))
    plain = torch.optim.AdamW(plain_model.parameters(), **KWARGS)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, disk_tier=tmp_path / "tier" if tier else None,
                                 update_in_backward=update_in_backward, **KWARGS)
    for m, opt in ((plain_model, plain), (model, optimizer)):
        loss_of(m, 0).backward()
        opt.step()
        opt.zero_grad()
    return plain_model, plain, model, optimizer


def interrupt_once(monkeypatch, owner: Any, name: str, hit: Callable[..., bool], after: bool = False) -> None:
    """Make ``owner.name`` raise KeyboardInterrupt the first time ``hit(*its arguments)`` holds, before
    it runs (or, ``after``, once it has)."""
    real = getattr(owner, name)
    armed = [True]

    def patched(*args: Any, **kwargs: Any) -> Any:
        now = armed[0] and hit(*args, **kwargs)
        if now and not after:
            armed[0] = False
            raise KeyboardInterrupt
        result = real(*args, **kwargs)
        if now:
            armed[0] = False
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(owner, name, patched)


def of_slice(index: int) -> Callable[..., bool]:
    """A method's call for slice ``index`` (its first argument after ``self``)."""
    return lambda self, i, *args, **kwargs: i == index


def tier_piece(optimizer: OffloadOptimizer, piece: str, index: int) -> Callable[..., bool]:
    """The disk tier's submission of slice ``index``'s ``piece`` (read, update or write)."""
    tier = optimizer._tier
    record = tier.records[index]

    def hit(worker: Any, work: Any, *args: Any, **kwargs: Any) -> bool:
        if not isinstance(work, functools.partial):
            return False
        if piece == "update":
            return getattr(work.func, "__func__", None) is type(tier)._update and work.args[0] is record
        worker_of_piece = {"read": tier._reader, "write": tier._writer}[piece]
        return worker is worker_of_piece and getattr(work.func, "__self__", None) is record

    return hit


def patch_class(owner: Any, name: str, index: int, after: bool = False) -> Callable[..., None]:
    return lambda monkeypatch, optimizer: interrupt_once(monkeypatch, owner, name, of_slice(index), after)


def patch_tier(piece: str, index: int, after: bool = False) -> Callable[..., None]:
    return lambda monkeypatch, optimizer: interrupt_once(monkeypatch, optimizer._tier.copies, "submit",
                                                         tier_piece(optimizer, piece, index), after)


#: Where the interrupt lands: (the twins' options, the patch, the slices it leaves updated).
POINTS = [
    pytest.param({"tier": False}, patch_class(SliceUpdates, "_submit", 1), {0}, id="ram-between-slices"),
    pytest.param({"tier": False}, patch_class(pending.SliceUpdates, "submitted", 1, after=True), {0, 1},
                 id="ram-after-registering"),
    pytest.param({"tier": True}, patch_class(SliceUpdates, "_submit", 0), set(), id="tier-before-any"),
    pytest.param({"tier": True}, patch_class(SliceUpdates, "_submit", 1), {0}, id="tier-between-slices"),
    pytest.param({"tier": True}, patch_tier("read", 1), {0}, id="tier-before-the-read"),
    pytest.param({"tier": True}, patch_tier("update", 1), {0}, id="tier-between-read-and-update"),
    pytest.param({"tier": True}, patch_tier("write", 1), {0, 1}, id="tier-between-update-and-write"),
    pytest.param({"tier": True}, patch_tier("write", 1, after=True), {0, 1}, id="tier-in-queueing-the-write"),
    pytest.param({"tier": True}, patch_class(pending.SliceUpdates, "submitted", 1, after=True), {0, 1},
                 id="tier-after-registering"),
    pytest.param({"tier": True}, patch_tier("write", 2), {0, 1, 2}, id="tier-at-the-last-write"),
    pytest.param({"tier": True, "masters": True}, patch_class(MasterFiles, "read", 1, after=True), {0},
                 id="masters-after-their-read"),
    pytest.param({"tier": True, "masters": True}, patch_class(MasterFiles, "write", 1), {0, 1},
                 id="masters-before-their-write"),
]


def step_plain(plain_model: OffloadModel, plain: torch.optim.Optimizer, updated: set[int]) -> None:
    """The plain optimizer's step of only the slices ``updated`` (the others' gradients set aside)."""
    for index, entries in enumerate(s.storage.params for s in engine_of(plain_model).slices):
        if index not in updated:
            for entry in entries:
                entry.tensor.grad = None
    plain.step()


def assert_parameters_equal(plain_model: OffloadModel, plain: torch.optim.Optimizer, model: OffloadModel,
                            optimizer: OffloadOptimizer) -> None:
    optimizer.synchronize()
    for (name, a), b in zip(plain_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, **EXACT, msg=lambda m: f"{name}: {m}")
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert optimizer.state[b]["step"] == plain.state[a]["step"]


@pytest.mark.parametrize("options, patch, updated", POINTS)
def test_an_interrupted_step_runs_what_it_handed_over_refuses_saves_and_trains_on_exactly(
        tmp_path, monkeypatch, options, patch, updated):
    plain_model, plain, model, optimizer = twins(tmp_path, **options)
    for m in (plain_model, model):
        loss_of(m, 1).backward()
    patch(monkeypatch, optimizer)
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
    monkeypatch.undo()
    step_plain(plain_model, plain, updated)
    assert_parameters_equal(plain_model, plain, model, optimizer)

    if updated in (set(), {0, 1, 2}):  # nothing, or everything, was handed over: no mix
        assert optimizer.state_dict()["state"].keys() == plain.state_dict()["state"].keys()
    else:
        with pytest.raises(RuntimeError, match=MIXED + r": slice\(s\) " + ", ".join(map(str, sorted(updated)))):
            optimizer.state_dict()
        with pytest.raises(RuntimeError, match=MIXED):
            save_checkpoint(tmp_path / "checkpoint", model, optimizer)
        assert not (tmp_path / "checkpoint").exists()

    # Training on is not refused, and is the plain optimizer's: the state each slice's update wrote
    # (or left) is the one the next step reads.
    for step in (2, 3):
        for m, opt in ((plain_model, plain), (model, optimizer)):
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()
    assert_parameters_equal(plain_model, plain, model, optimizer)
    # Loads of both the parameters and the state replace the mix: saves work again, and hold what was loaded.
    model.load_state_dict(plain_model.state_dict())
    optimizer.load_state_dict(plain.state_dict())
    got, want = optimizer.state_dict()["state"], plain.state_dict()["state"]
    for i in want:
        for key in want[i]:
            torch.testing.assert_close(got[i][key], want[i][key], **EXACT)


def test_an_update_queued_before_the_interrupt_is_waited_for(tmp_path, monkeypatch):
    # Slice 1's update is held back on the worker; the interrupt comes between it and its write.
    plain_model, plain, model, optimizer = twins(tmp_path, tier=True)
    for m in (plain_model, model):
        loss_of(m, 1).backward()
    gate = threading.Event()
    real_run = SliceStep.run

    def held(self: SliceStep, *args: Any) -> None:
        if self.index == 1:
            assert gate.wait(30), "the test never let the update go"
        real_run(self, *args)

    monkeypatch.setattr(SliceStep, "run", held)
    patch_tier("write", 1)(monkeypatch, optimizer)
    try:
        with pytest.raises(KeyboardInterrupt):
            optimizer.step()
        engine = engine_of(model)
        event = engine.updates.event(1)
        assert event is not None and not engine.copies.has_completed(event)  # registered, still running
    finally:
        gate.set()
    step_plain(plain_model, plain, {0, 1})
    assert_parameters_equal(plain_model, plain, model, optimizer)


@pytest.mark.parametrize("where, updated", [("streamed", {0}), ("resident", {0})])
def test_an_interrupt_after_resident_slices_were_updated_latches_the_mix(tmp_path, monkeypatch, where, updated):
    # Resident slices are updated in step() itself, before the streamed ones are handed over.
    plain_model, plain, model, optimizer = twins(tmp_path, tier=False, resident_slices=2 if where == "resident" else 1)
    for m in (plain_model, model):
        loss_of(m, 1).backward()
    if where == "resident":  # between the two resident slices
        real = SliceUpdates._run_resident
        monkeypatch.setattr(SliceUpdates, "_run_resident", lambda self, step, *args: (
            _raise(KeyboardInterrupt()) if step.index == 1 else real(self, step, *args)))
    else:
        patch_class(SliceUpdates, "_submit", 1)(monkeypatch, optimizer)
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
    monkeypatch.undo()
    step_plain(plain_model, plain, updated)
    assert_parameters_equal(plain_model, plain, model, optimizer)
    with pytest.raises(RuntimeError, match=MIXED + r": slice\(s\) 0 updated"):
        optimizer.state_dict()


def test_an_interrupt_in_backward_after_its_update_was_queued_latches_the_mix(tmp_path, monkeypatch):
    # update_in_backward hands the last slice's update over first, as its gradients land.
    plain_model, plain, model, optimizer = twins(tmp_path, tier=True, update_in_backward=True)
    loss_of(plain_model, 1).backward()
    patch_tier("write", 2)(monkeypatch, optimizer)
    with pytest.raises(KeyboardInterrupt):
        loss_of(model, 1).backward()
    monkeypatch.undo()
    step_plain(plain_model, plain, {2})
    assert_parameters_equal(plain_model, plain, model, optimizer)
    with pytest.raises(RuntimeError, match=r"update_in_backward\) raised KeyboardInterrupt while it handed the updates "
                                           r"over: slice\(s\) 2 updated"):
        optimizer.state_dict()


def _raise(error: BaseException) -> None:
    raise error
