"""Two ends of the hand-off under Ctrl-C and fork (Note: [A worker under interrupts and forks] in
offload/streams/workers.py):

1. A sharded ``step()`` (``shard=True``, a one-rank gloo group over a file store) interrupted at each
   point of one slice's hand-off, swept as ``tests/test_update_handoff_interrupts.py`` sweeps the
   unsharded one (``tests/interrupt_points.py``): this rank's update and the exchange that follows
   it are queued and registered as one, so the next forward waits for the exchange, which writes
   the slice's bfloat16 shadow, and masters on disk are written back after it.
2. A child of ``os.fork()`` that exits, closes or drops an optimizer with a disk tier leaves the
   parent's directory and files as they were (docs/disk-tier.md); the parent trains on, and its
   own close removes them.

Every run is a subprocess with a time limit.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of
from offload.optimizing import stepping
from offload.optimizing.partial_failure import PartialFailure
from offload.optimizing.sharding import Sharding
from offload.optimizing.stepping import SliceUpdates
from offload.optimizing.tier_plumbing import TierPlumbing
from offload.streams import updates as pending
from offload.streams.collectives import HostCollectives
from offload.streams.copies import CopyStreams
from offload.streams.host_storage import SliceStorage
from offload.streams.workers import HostWorker
from offload.tiers.master_files import MasterFiles
from offload.tiers.slice_update import SliceStep

from .interrupt_points import SignalChecks, print_sweep, run_python_each, run_sweep, traced
from .test_interrupted_step import KWARGS, MIXED, assert_parameters_equal, step_plain
from .test_optimizer import EXACT, batch, loss_of, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

TIMEOUT = 240  # seconds for one subprocess: a worker left waiting hangs it
SLOW_SHADOW = 0.1  # seconds slice 1's exchange sleeps before it writes the shadow: a load that does not wait reads the old

#: The frames of a sharded hand-off (this rank's update, then the exchange), traced at each place
#: CPython checks for signals.
SHARDED_HAND_OFF: list[CodeType] = [
    SliceUpdates.submit.__code__, stepping._hand_sharded.__code__, SliceUpdates._hand_update.__code__,
    stepping._exchange.__code__, SliceUpdates._register.__code__, SliceUpdates._submit.__code__,
    SliceUpdates._write_masters.__code__, stepping._hand_off_raised.__code__, stepping._exchange_raised.__code__,
    TierPlumbing.submit.__code__, PartialFailure.handing.__code__, pending.SliceUpdates.claim.__code__,
    pending.SliceUpdates.event.__code__, pending.SliceUpdates.submitted.__code__,
    pending.SliceUpdates._submit_owed.__code__, Sharding.stepped.__code__, Sharding.exchange.__code__,
    HostCollectives.broadcast.__code__, HostCollectives.submit.__code__, MasterFiles.read.__code__,
    MasterFiles.write.__code__, CopyStreams.submit.__code__, HostWorker.submit.__code__]
TRACED = set(SHARDED_HAND_OFF)


def _slice_of(frame: FrameType) -> int | None:
    """The slice a traced frame hands over (its ``step`` argument's), if any."""
    step = frame.f_locals.get("step") if frame.f_code in TRACED else None
    return step.index if isinstance(step, SliceStep) else None


def sharded_twins(directory: Path, masters: bool) -> tuple[OffloadModel, torch.optim.Optimizer, OffloadModel,
                                                           OffloadOptimizer]:
    """The plain AdamW on an OffloadModel computing in bfloat16, and a sharded OffloadOptimizer (its
    masters on disk, if asked) on a twin over the process group, each stepped once."""
    plain_model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16,
                         process_group=dist.group.WORLD, **({"masters": directory / "masters"} if masters else {}))
    plain = torch.optim.AdamW(plain_model.parameters(), **KWARGS)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, shard=True, **KWARGS)
    for m, opt in ((plain_model, plain), (model, optimizer)):
        loss_of(m, 0).backward()
        opt.step()
        opt.zero_grad()
    return plain_model, plain, model, optimizer


def slow_shadow(storage: SliceStorage) -> Callable[[], None]:
    """Make the cast of ``storage``'s shadow sleep :data:`SLOW_SHADOW` first; returns what puts it back."""
    real = SliceStorage.write_shadow

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(SLOW_SHADOW)
        real(storage, *args, **kwargs)

    storage.write_shadow = slow  # type: ignore[method-assign]
    return lambda: vars(storage).pop("write_shadow")


def watch_master_writes() -> tuple[list[tuple[int, Any]], Callable[[], None]]:
    """Record each ``MasterFiles.write`` (slice, the event it follows); returns them and what puts it back."""
    real, writes = MasterFiles.write, []

    def write(self: MasterFiles, index: int, file: Any, after: Any, *args: Any) -> None:
        writes.append((index, after))
        real(self, index, file, after, *args)

    MasterFiles.write = write  # type: ignore[method-assign]
    return writes, lambda: setattr(MasterFiles, "write", real)


def interrupted_sharded(masters: bool, at: int) -> dict[str, Any]:
    """One sharded step of :func:`sharded_twins`, interrupted at point ``at`` of slice 1's hand-off
    (``-1``: not at all); checked against the plain optimizer stepping the slices that ran."""
    with tempfile.TemporaryDirectory() as directory:
        plain_model, plain, model, optimizer = sharded_twins(Path(directory), masters)
        for m in (plain_model, model):
            loss_of(m, 1).backward()
        engine = engine_of(model)
        optimizer.synchronize()  # the step sharded_twins() took is done: what changes next is this one's
        before = [[e.tensor.clone() for e in s.storage.params] for s in engine.slices]
        checks = SignalChecks(SHARDED_HAND_OFF, lambda f: _slice_of(f) == 1, closes=lambda f: _slice_of(f) == 2,
                              returns_from={SliceUpdates.submit.__code__}, at=at)
        writes, put_writes_back = watch_master_writes()
        put_shadow_back = slow_shadow(engine.slices[1].storage)
        try:
            with traced(checks):
                try:
                    optimizer.step()
                except KeyboardInterrupt:
                    pass
            registered = dict(engine.updates._pending)  # what the next load waits for (read as is)
            with torch.no_grad():
                seen = model(batch(7))  # the next forward, right after the interrupted step
        finally:
            put_shadow_back()
            put_writes_back()
        optimizer.synchronize()
        where = checks.fired
        ran = {s.index for s, then in zip(engine.slices, before)
               if any(not torch.equal(e.tensor, q) for e, q in zip(s.storage.params, then))}
        exchanges = optimizer._collectives.worker
        assert set(registered) == ran, f"at {where}: slices {sorted(ran)} ran, {sorted(registered)} registered"
        for index in sorted(ran):
            assert registered[index].worker is exchanges, \
                f"at {where}: the next load of slice {index} waits for its update, not for its exchange"
            if masters:  # written back after the last work that writes them (Note: [Masters on disk])
                assert [after for i, after in writes if i == index][-1] == registered[index], \
                    f"at {where}: slice {index}'s masters were written back before its exchange"
        refusal = _refusal(optimizer)
        assert (not refusal if ran in (set(), {0, 1, 2}) else
                re.search(f"{MIXED}: slice\\(s\\) {', '.join(map(str, sorted(ran)))} updated", refusal)), \
            f"at {where}: slices {sorted(ran)} ran; {refusal or 'no refusal'}"
        step_plain(plain_model, plain, ran)
        with torch.no_grad():
            torch.testing.assert_close(seen, plain_model(batch(7)), **EXACT,
                                       msg=lambda m: f"at {where}, the forward after the step: {m}")
        assert_parameters_equal(plain_model, plain, model, optimizer)
        for step in (2, 3):  # training on
            for m, opt in ((plain_model, plain), (model, optimizer)):
                opt.zero_grad()
                loss_of(m, step).backward()
                opt.step()
        assert_parameters_equal(plain_model, plain, model, optimizer)
        return {"where": where, "points": checks.points, "ran": sorted(ran)}


def _refusal(optimizer: OffloadOptimizer) -> str:
    try:
        optimizer.state_dict()
    except RuntimeError as error:
        return str(error)
    return ""


def sharded_sweep(where: str) -> None:
    """Interrupt slice 1's sharded hand-off at each of its points in turn (``where`` the masters
    are: ``ram`` or ``disk``), on a one-rank gloo group; prints the outcomes (run in a subprocess)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            print_sweep(functools.partial(interrupted_sharded, where == "disk"))
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("masters", ["ram", "disk"])
def test_an_interrupt_anywhere_in_a_sharded_hand_off_leaves_the_exchange_waited_for_and_exact(masters):
    # Before the fix, an interrupt after the exchange was queued and before step() registered it
    # left the update's event registered: the next forward waited for the update only and read
    # the bfloat16 shadow the exchange had not written yet. One after the update was queued and
    # before the exchange was left the exchange never queued (the shadow never written), and the
    # masters on disk written back after the update.
    code = ("import sys; from tests.test_handoff_sharded_and_fork_exit import sharded_sweep; "
            "sharded_sweep(sys.argv[1])")
    outcomes = run_sweep(code, masters, timeout=TIMEOUT)
    ran = [tuple(r) for _, r in outcomes]
    assert len(set(ran)) > 1, ran  # the window holds points before and after the update was queued


FORK_EXIT = """
import gc, os, sys, tempfile
import torch
from offload import OffloadModel, OffloadOptimizer
from tests.test_worker_interrupts_and_fork import same, train_on
from tests.test_optimizer import network

torch.set_num_threads(1)  # libgomp's thread pool does not survive a fork (PyTorch's own limit)
how = sys.argv[1]
plain_model = OffloadModel(network(), device="cpu", num_slices=3)
model = OffloadModel(network(), device="cpu", num_slices=3)
plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, fused=True)
optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tempfile.mkdtemp())
train_on(plain_model, plain, model, optimizer, [0, 1])
optimizer.synchronize()
directory = optimizer._disk.tier.directory
files = sorted(os.listdir(directory))
before = {f: open(os.path.join(directory, f), "rb").read() for f in files}
pid = os.fork()
if pid == 0:
    if how == "close":
        optimizer.close()
    elif how == "drop":
        del optimizer
        gc.collect()
    sys.exit(0)  # a normal exit: the interpreter's finalizers run
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert os.path.isdir(directory), "the child removed the parent's directory"
after = {f: open(os.path.join(directory, f), "rb").read() for f in files}
assert after == before, "the child changed the parent's state files"
train_on(plain_model, plain, model, optimizer, [2, 3])
print("parent same:", same(plain_model, model, optimizer), flush=True)
optimizer.close()
print("removed by the parent:", not os.path.exists(directory), flush=True)
"""


@pytest.fixture(scope="module")
def forks_that_exit() -> dict[str, subprocess.CompletedProcess[str]]:
    """:data:`FORK_EXIT` run with each way out, each as if in a fresh interpreter of its own."""
    return run_python_each(FORK_EXIT, ["exit", "close", "drop"], timeout=3 * TIMEOUT)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX only")
@pytest.mark.parametrize("how", ["exit", "close", "drop"])
def test_a_fork_child_that_exits_closes_or_drops_the_optimizer_leaves_the_parents_disk_tier(how, forks_that_exit):
    # Before the fix the child's exit (the finalizer of the tier's files), close() or the drop of
    # its copy of the optimizer removed the parent's directory: the parent's next step failed to
    # read its state.
    done = forks_that_exit[how]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.splitlines()[-2:] == ["parent same: True", "removed by the parent: True"], done.stdout


FORK_MASTERS = """
import os, sys, tempfile
import torch
from offload import DiskTier, OffloadModel, OffloadOptimizer
from tests.test_worker_interrupts_and_fork import batch_loss, same, train_on
from tests.test_optimizer import network

torch.set_num_threads(1)  # libgomp's thread pool does not survive a fork (PyTorch's own limit)
how = sys.argv[1]
twin = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16,
                     masters=DiskTier(tempfile.mkdtemp()))
plain = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
train_on(twin, plain, model, optimizer, [0, 1])
for m in (twin, model):
    batch_loss(m, 2).backward()  # gradients in their files, for the child's step and zero_grad
optimizer.synchronize()
before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
with torch.no_grad():
    seen = model(torch.ones(2, 6))
pid = os.fork()
if pid == 0:
    try:
        if how == "backward":
            optimizer.zero_grad()
            batch_loss(model, 7).backward()
        elif how == "step":
            optimizer.step()
        elif how == "zero_grad":
            optimizer.zero_grad(set_to_none=False)
        else:  # evaluation reads the masters only
            with torch.no_grad():
                os._exit(0 if torch.equal(model(torch.ones(2, 6)), seen) else 4)
        told = False
    except RuntimeError as error:
        told = "child of os.fork()" in str(error) and "masters" in str(error) and "'spawn'" in str(error)
        print("child:", error, flush=True)
    os._exit(0 if told else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
after = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
assert all(torch.equal(a, b) and torch.equal(g, h) for (a, g), (b, h) in zip(before, after)), \\
    "the child changed the parent's parameters or gradients"
for m, opt in ((twin, plain), (model, optimizer)):
    opt.step()
train_on(twin, plain, model, optimizer, [3, 4])
print("parent same:", same(twin, model, optimizer), flush=True)
"""


@pytest.fixture(scope="module")
def forks_of_masters() -> dict[str, subprocess.CompletedProcess[str]]:
    """:data:`FORK_MASTERS` run with each thing the child does, each as if in a fresh interpreter of its own."""
    return run_python_each(FORK_MASTERS, ["backward", "step", "zero_grad", "evaluation"], timeout=4 * TIMEOUT)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX only")
@pytest.mark.parametrize("how", ["backward", "step", "zero_grad", "evaluation"])
def test_a_fork_child_is_refused_what_would_write_the_masters_on_disk_that_it_shares_with_the_parent(how,
                                                                                                   forks_of_masters):
    # Before the fix the child's backward wrote its gradients into the parent's (the files are
    # mapped shared), its step the parent's masters, and its zero_grad(set_to_none=False)
    # discarded the parent's gradients: the parent trained on with the child's values.
    done = forks_of_masters[how]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.splitlines()[-1] == "parent same: True", done.stdout
