"""Ctrl-C around the hand-off of one update, past the worker's queue: from the moment the worker
queued it to the moment it is registered with the waits (Note: [A worker under interrupts and
forks] in offload/streams/workers.py; Note: [An update that failed part way], rule 6, in
offload/optimizing/partial_failure.py).

Each test sweeps a window of the hand-off point by point, as ``tests/test_worker_interrupts_and_fork.py``
does (``tests/interrupt_points.py``'s ``SignalChecks`` raises KeyboardInterrupt at the N-th place
where CPython checks for signals):

1. ``register``: from slice 1's ``_hand_update`` to its registration, which ``step()`` (or backward,
   ``update_in_backward``) did after ``_hand_update`` had returned;
2. ``tier``: the disk tier's pipeline (``StateTier.submit``), whose write must follow the update;
3. ``claim``: a clip's scaling owed on the slice (``scale_in_update``), which the update claims;
4. ``outside``: the update of the parameters outside the model (``_hand_outside``).

Wherever the interrupt lands, an update that ran was waited for and is named as updated, one
that did not is named as left, a clip's scaling is applied once, and training on is the plain
optimizer's stepping the same gradients, bit for bit. A fork child with a disk tier is refused
at its first step. Every run is a subprocess with a time limit.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
from torch import nn

import offload
from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of
from offload.optimizing.deferred_scaling import OwedSlice
from offload.optimizing.partial_failure import PartialFailure
from offload.optimizing import stepping
from offload.optimizing.stepping import SliceUpdates
from offload.optimizing.tier_plumbing import TierPlumbing
from offload.streams import updates as pending
from offload.streams.copies import CopyStreams
from offload.streams.workers import HostWorker
from offload.tiers.disk_tier import StateTier
from offload.tiers.slice_update import SliceStep

from .interrupt_points import SignalChecks, print_sweep, run_python, run_sweep, traced
from .test_interrupted_step import KWARGS, MIXED, assert_parameters_equal, step_plain, twins
from .test_optimizer import EXACT, batch, loss_of, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

TIMEOUT = 120  # seconds for one subprocess: a worker left waiting hangs it
MAX_NORM = 0.05  # the clip of the ``claim`` window: small enough to scale every step

#: The frames of a hand-off, traced at each place CPython checks for signals.
HAND_OFF: list[CodeType] = [
    SliceUpdates.submit.__code__, SliceUpdates.submit_one.__code__, SliceUpdates._submit_update.__code__,
    SliceUpdates._hand_update.__code__, stepping._hand_off_raised.__code__, SliceUpdates._register.__code__,
    SliceUpdates._submit.__code__, SliceUpdates._write_masters.__code__, TierPlumbing.submit.__code__,
    PartialFailure.handing.__code__, pending.SliceUpdates.claim.__code__, pending.SliceUpdates.event.__code__,
    pending.SliceUpdates.submitted.__code__, pending.SliceUpdates._submit_owed.__code__,
    CopyStreams.submit.__code__, HostWorker.submit.__code__]
#: The hand-off's outer frames (``step()``'s or backward's): a window closes as the one it opened in returns.
OUTER = {SliceUpdates.submit.__code__, SliceUpdates.submit_one.__code__}
HAND_UPDATE = SliceUpdates._hand_update.__code__


def _slice_of(frame: FrameType) -> int | None:
    """The slice whose update ``frame`` hands over, if it is ``_hand_update``'s."""
    return frame.f_locals["step"].index if frame.f_code is HAND_UPDATE else None


#: Per window: the twins' options, the frames traced, and where the window opens and closes (a call).
WINDOWS: dict[str, tuple[dict[str, Any], list[CodeType], Callable[[FrameType], bool], Callable[[FrameType], bool]]] = {
    "register": ({"tier": False}, HAND_OFF, lambda f: _slice_of(f) == 1, lambda f: _slice_of(f) not in (None, 1)),
    "backward": ({"tier": False, "update_in_backward": True}, HAND_OFF, lambda f: _slice_of(f) == 2,
                 lambda f: _slice_of(f) not in (None, 2)),
    "tier": ({"tier": True}, [*HAND_OFF, StateTier.submit.__code__], lambda f: _slice_of(f) == 1,
             lambda f: _slice_of(f) not in (None, 1)),
    "claim": ({"tier": False, "scale_in_update": True}, [*HAND_OFF, OwedSlice.submit.__code__],
              lambda f: _slice_of(f) == 1, lambda f: _slice_of(f) not in (None, 1)),
    "outside": ({}, [*HAND_OFF, SliceUpdates._hand_outside.__code__, stepping._outside_raised.__code__,
                 SliceUpdates.start_worker.__code__],
                lambda f: f.f_code is SliceUpdates._hand_outside.__code__, lambda f: _slice_of(f) is not None),
}


def window(name: str, at: int) -> SignalChecks:
    """The trace function that interrupts window ``name`` at its point ``at`` (``-1``: it only lists
    them): it closes at a call that ``closes`` picks, or as ``step()``'s or backward's hand-off
    (``submit`` or ``submit_one``) returns."""
    _, codes, opens, closes = WINDOWS[name]
    return SignalChecks(codes, opens, closes=closes, returns_from=OUTER, at=at)


def hold_update(index: int, seconds: float) -> Callable[[], None]:
    """Slow slice ``index``'s update down (``-1``: the parameters outside the model), so that one not
    waited for is still running when the caller reads; returns what puts ``SliceStep.run`` back."""
    real_run = SliceStep.run

    def held(self: SliceStep, *args: Any) -> None:
        if self.index == index:
            time.sleep(seconds)
        real_run(self, *args)

    SliceStep.run = held  # type: ignore[method-assign]
    return lambda: setattr(SliceStep, "run", real_run)


class Head(nn.Module):
    """An OffloadModel and a linear layer after it, outside it: the ``outside`` window's model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = OffloadModel(network(), device="cpu", num_slices=3)
        torch.manual_seed(1)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def head_twins() -> tuple[Head, torch.optim.Optimizer, Head, OffloadOptimizer]:
    """The plain AdamW on a :class:`Head`, and an OffloadOptimizer of the OffloadModel and the head
    on a twin, each stepped once."""
    plain_model, model = Head(), Head()
    plain = torch.optim.AdamW(plain_model.parameters(), **KWARGS)
    optimizer = OffloadOptimizer(model.body, torch.optim.AdamW, list(model.parameters()), **KWARGS)
    for m, opt in ((plain_model, plain), (model, optimizer)):
        m(batch(0)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return plain_model, plain, model, optimizer


def interrupted_outside(at: int) -> dict[str, Any]:
    """One step of :func:`head_twins`, interrupted at point ``at`` of the ``outside`` window."""
    plain_model, plain, model, optimizer = head_twins()
    for m in (plain_model, model):
        m(batch(1)).pow(2).mean().backward()
    optimizer.synchronize()
    before = [p.detach().clone() for p in model.head.parameters()]
    checks = window("outside", at)
    put_back = hold_update(-1, 0.05)
    try:
        with traced(checks), contextlib.suppress(KeyboardInterrupt):
            optimizer.step()
        seen = [p.detach().clone() for p in model.head.parameters()]  # as the caller reads them next
    finally:
        put_back()
    optimizer.synchronize()
    where = checks.fired
    ran = any(not torch.equal(p, q) for p, q in zip(model.head.parameters(), before))
    assert all(torch.equal(p, q) for p, q in zip(model.head.parameters(), seen)), \
        f"at {where}: step() raised before the update of the parameters outside the model, which it handed over, ran"
    refusal = _refusal(optimizer)
    mixed = ran and at >= 0  # interrupted once it was handed over, before any slice's update was
    assert (re.search(f"{MIXED}: the parameters outside the model updated", refusal) if mixed else not refusal), \
        f"at {where}: the head {'ran' if ran else 'did not run'}; {refusal or 'no refusal'}"
    for p in plain_model.body.parameters() if at >= 0 else ():
        p.grad = None  # interrupted: only the head's update ran, if any
    if not ran:
        for p in plain_model.head.parameters():
            p.grad = None
    plain.step()
    for step in (2, 3):
        _assert_equal(plain_model, model, f"at {where}, before step {step}")
        for m, opt in ((plain_model, plain), (model, optimizer)):
            opt.zero_grad()
            m(batch(step)).pow(2).mean().backward()
            opt.step()
    optimizer.synchronize()
    _assert_equal(plain_model, model, f"at {where}, at the end")
    return {"where": where, "points": checks.points, "ran": [-1] if ran else []}


def claim_twins(directory: Path) -> tuple[OffloadModel, torch.optim.Optimizer, OffloadModel, OffloadOptimizer]:
    """:func:`twins` of the ``claim`` window: the OffloadOptimizer scales in the update."""
    plain_model = OffloadModel(network(), device="cpu", num_slices=3)
    model = OffloadModel(network(), device="cpu", num_slices=3)
    plain = torch.optim.AdamW(plain_model.parameters(), **KWARGS)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, scale_in_update=True, **KWARGS)
    train_clipped(plain_model, plain, model, optimizer, [0])
    return plain_model, plain, model, optimizer


def train_clipped(plain_model: OffloadModel, plain: torch.optim.Optimizer, model: OffloadModel,
                  optimizer: OffloadOptimizer, steps: list[int]) -> None:
    """Each a step on each of ``steps``' batches, its gradients clipped to :data:`MAX_NORM`."""
    for step in steps:
        for m, opt, clip in ((plain_model, plain, torch.nn.utils.clip_grad_norm_),
                             (model, optimizer, offload.clip_grad_norm_)):
            opt.zero_grad()
            loss_of(m, step).backward()
            clip(m.parameters(), MAX_NORM)
            opt.step()


def interrupted_once(name: str, at: int) -> dict[str, Any]:
    """One step of the twins of window ``name``, interrupted at its point ``at``; checked against
    the plain optimizer stepping the slices that ran (their gradients clipped as PyTorch's clip
    scales them, for ``claim``)."""
    if name == "outside":
        return interrupted_outside(at)
    options = WINDOWS[name][0]
    in_backward, scale = bool(options.get("update_in_backward")), name == "claim"
    with tempfile.TemporaryDirectory() as directory:
        made = claim_twins(Path(directory)) if scale else twins(Path(directory), **options)
        plain_model, plain, model, optimizer = made
        loss_of(plain_model, 1).backward()
        if scale:
            torch.nn.utils.clip_grad_norm_(plain_model.parameters(), MAX_NORM)
        slices = engine_of(model).slices
        optimizer.synchronize()  # the step twins() took is done: what changes next is this one's
        before = [[e.tensor.clone() for e in s.storage.params] for s in slices]
        checks = window(name, at)
        put_back = hold_update(2 if in_backward else 1, 0.05)
        try:
            with traced(checks), contextlib.suppress(KeyboardInterrupt):
                loss_of(model, 1).backward()
                if scale:
                    offload.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
            # What the next load waits for (read as is: asking for an event submits work owed on the slice).
            registered = set(engine_of(model).updates._pending)
        finally:
            put_back()
        optimizer.synchronize()
        where = checks.fired
        ran = {s.index for s, then in zip(slices, before)
               if any(not torch.equal(e.tensor, q) for e, q in zip(s.storage.params, then))}
        assert registered == ran, f"at {where}: slices {sorted(ran)} ran, {sorted(registered)} registered"
        if scale:  # each gradient scaled once by the clip, whether its update ran or not
            for (n, a), b in zip(plain_model.named_parameters(), model.parameters()):
                torch.testing.assert_close(b.grad, a.grad, **EXACT, msg=lambda m: f"at {where}, {n}.grad: {m}")
        refusal = _refusal(optimizer)
        named = ", ".join(map(str, sorted(ran)))
        mixed = r"a backward \(update_in_backward\) raised KeyboardInterrupt" if in_backward else MIXED
        assert (not refusal if ran in (set(), {0, 1, 2}) else re.search(f"{mixed}.*: slice\\(s\\) {named} updated",
                                                                        refusal)), \
            f"at {where}: slices {sorted(ran)} ran; {refusal or 'no refusal'}"
        step_plain(plain_model, plain, ran)
        assert_parameters_equal(plain_model, plain, model, optimizer)
        if not in_backward:  # training on (after a backward that raised, the step is the user's to redo)
            (train_clipped if scale else train_on)(plain_model, plain, model, optimizer, [2, 3])
            assert_parameters_equal(plain_model, plain, model, optimizer)
        return {"where": where, "points": checks.points, "ran": sorted(ran)}


def train_on(plain_model: OffloadModel, plain: torch.optim.Optimizer, model: OffloadModel,
             optimizer: OffloadOptimizer, steps: list[int]) -> None:
    for step in steps:
        for m, opt in ((plain_model, plain), (model, optimizer)):
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()


def _refusal(optimizer: OffloadOptimizer) -> str:
    try:
        optimizer.state_dict()
    except RuntimeError as error:
        return str(error)
    return ""


def _assert_equal(plain_model: nn.Module, model: nn.Module, when: str) -> None:
    for (name, a), b in zip(plain_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, **EXACT, msg=lambda m: f"{when}, {name}: {m}")


def sweep(name: str) -> None:
    """Interrupt window ``name`` at each of its points in turn (run in a subprocess: prints the outcomes)."""
    torch.set_num_threads(1)
    print_sweep(functools.partial(interrupted_once, name))


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_an_interrupt_anywhere_from_queue_to_registration_leaves_the_update_waited_for_named_and_exact(name):
    # Before the fix: "register" and "backward", an interrupt as _register started left the queued
    # update unregistered (a load did not wait for it) and named as left; "tier", one after the
    # worker queued the update ordered the state's write after the read only (the file kept the
    # state before the update); "claim", one after claim's pop lost the clip's scaling of the
    # slice (its gradients never scaled); "outside", one after the worker queued the update of
    # the parameters outside the model withdrew it: step() returned before it ran, and named
    # those parameters as left as they were.
    outcomes = run_sweep("import sys; from tests.test_update_handoff_interrupts import sweep; sweep(sys.argv[1])",
                         name, timeout=TIMEOUT)
    ran = [tuple(r) for _, r in outcomes]
    assert len(set(ran)) > 1, ran  # the window holds points before and after the update was queued


FORK_WITH_TIER = """
import os, sys, tempfile
import torch
from offload import OffloadModel, OffloadOptimizer
from tests.test_worker_interrupts_and_fork import batch_loss, same, train_on
from tests.test_optimizer import network

torch.set_num_threads(1)  # libgomp's thread pool does not survive a fork (PyTorch's own limit)
directory = tempfile.mkdtemp()
plain_model = OffloadModel(network(), device="cpu", num_slices=3)
model = OffloadModel(network(), device="cpu", num_slices=3)
plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, fused=True)
optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=directory)
train_on(plain_model, plain, model, optimizer, [0, 1])
optimizer.synchronize()
files = sorted(os.listdir(optimizer._disk.tier.directory))
before = {f: open(os.path.join(optimizer._disk.tier.directory, f), "rb").read() for f in files}
pid = os.fork()
if pid == 0:
    optimizer.zero_grad()
    batch_loss(model, 2).backward()
    try:
        optimizer.step()
        told = False
    except RuntimeError as error:
        told = "child of os.fork()" in str(error) and "disk tier" in str(error) and "'spawn'" in str(error)
        print("child:", error, flush=True)
    os._exit(0 if told else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
after = {f: open(os.path.join(optimizer._disk.tier.directory, f), "rb").read() for f in files}
assert after == before, "the child wrote the parent's state files"
train_on(plain_model, plain, model, optimizer, [2, 3])
print("parent same:", same(plain_model, model, optimizer), flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX only")
def test_a_fork_child_with_a_disk_tier_is_refused_at_its_first_step_and_the_parents_files_are_untouched():
    # Before the fix the child's step read and wrote the parent's state files: its update wrote
    # its own step's moments into them, and the parent's next step read those.
    done = run_python(FORK_WITH_TIER, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.splitlines()[-1] == "parent same: True", done.stdout
