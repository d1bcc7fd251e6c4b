"""The host update worker under Ctrl-C and ``os.fork()`` (Note: [A worker under interrupts and
forks] in offload/streams/workers.py).

An interrupt lands at each point of one slice's hand-off in turn: each line and each return of the
hand-off's own frames, from ``_hand_update`` down to the worker's queue, and each call they make
into Python code (where CPython checks for signals), raised by a trace function
(``tests/interrupt_points.py``'s ``SignalChecks``), so the sweep is deterministic. Wherever it lands, the slices whose update ran are the ones registered with the
next load's waits and named as updated by the refusal to save (rule 6 of Note: [An update that
failed part way]), and training on is the plain optimizer's with those slices stepped, bit for
bit. A fork child trains on when nothing was left to the worker, is told to synchronize first
when something was, and a DataLoader's forked workers change nothing. Every run is a subprocess
with a time limit: a worker left locked used to hang the process (in the next wait, or at exit).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of
from offload.optimizing.partial_failure import PartialFailure
from offload.optimizing.stepping import SliceUpdates
from offload.optimizing.tier_plumbing import TierPlumbing
from offload.streams import updates as pending
from offload.streams.copies import CopyStreams
from offload.streams.workers import HostWorker
from offload.tiers.slice_update import SliceStep

from .interrupt_points import SignalChecks, print_sweep, run_python, run_sweep, traced
from .test_interrupted_step import MIXED, assert_parameters_equal, step_plain, twins
from .test_optimizer import loss_of

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

TIMEOUT = 300  # seconds for one subprocess: a worker left locked hangs it

#: The frames of a slice's hand-off, traced line by line: with the disk tier, its own pipeline
#: (``StateTier.submit``, which keeps its queued update in a local) is entered and left, not traced.
HAND_OFF: list[CodeType] = [SliceUpdates._hand_update.__code__, SliceUpdates._submit.__code__,
                            TierPlumbing.submit.__code__, PartialFailure.handing.__code__,
                            pending.SliceUpdates.claim.__code__, pending.SliceUpdates.event.__code__,
                            pending.SliceUpdates._submit_owed.__code__]
BELOW_THE_TIER: list[CodeType] = [CopyStreams.submit.__code__, HostWorker.submit.__code__]
SWEEPS = {"ram": ({"tier": False}, HAND_OFF + BELOW_THE_TIER), "tier": ({"tier": True}, HAND_OFF)}


def hands_slice_1(frame: FrameType) -> bool:
    """Whether ``frame`` is slice 1's ``_hand_update``: the window swept opens there, and closes as
    that frame returns."""
    return frame.f_code is SliceUpdates._hand_update.__code__ and frame.f_locals["step"].index == 1


def hold_slice_1() -> tuple[threading.Event, threading.Event, Callable[..., None]]:
    """Hold slice 1's update back, once it started, until the gate opens: (started, gate, the real
    ``SliceStep.run``, to put back)."""
    started, gate, real_run = threading.Event(), threading.Event(), SliceStep.run

    def held(self: SliceStep, *args: Any) -> None:
        if self.index == 1:
            started.set()
            assert gate.wait(60), "the test never let the update go"
        real_run(self, *args)

    SliceStep.run = held  # type: ignore[method-assign]
    return started, gate, real_run


def interrupted_once(options: dict[str, Any], codes: list[CodeType], at: int, real_signal: bool = False
                     ) -> dict[str, Any]:
    """One step of the twins (``options``) interrupted at point ``at`` of slice 1's hand-off, held
    back from running until what it registered was read; checked against the plain optimizer."""
    with tempfile.TemporaryDirectory() as directory:
        plain_model, plain, model, optimizer = twins(Path(directory), **options)
        for m in (plain_model, model):
            loss_of(m, 1).backward()
        before = [[e.tensor.clone() for e in s.storage.params] for s in engine_of(model).slices]
        started, gate, real_run = hold_slice_1()
        checks = SignalChecks(codes, hands_slice_1, at=at, real_signal=real_signal)
        try:
            with traced(checks), contextlib.suppress(KeyboardInterrupt):
                optimizer.step()
            updates = engine_of(model).updates
            registered = {i for i in range(3) if updates.event(i) is not None}
        finally:
            gate.set()
            SliceStep.run = real_run  # type: ignore[method-assign]
        optimizer.synchronize()
        ran = {s.index for s, then in zip(engine_of(model).slices, before)
               if any(not torch.equal(e.tensor, q) for e, q in zip(s.storage.params, then))}
        where = checks.fired
        assert registered == ran, f"at {where}: slices {sorted(ran)} ran, {sorted(registered)} registered"
        try:
            optimizer.state_dict()
            refusal = ""  # no mix: every slice was handed over
        except RuntimeError as error:
            refusal = str(error)
        named = ", ".join(map(str, sorted(ran)))
        assert (not refusal if ran == {0, 1, 2} else re.search(f"{MIXED}: slice\\(s\\) {named} updated", refusal)), \
            f"at {where}: slices {sorted(ran)} ran; {refusal or 'no refusal'}"
        step_plain(plain_model, plain, ran)
        assert_parameters_equal(plain_model, plain, model, optimizer)
        for step in (2, 3):
            for m, opt in ((plain_model, plain), (model, optimizer)):
                opt.zero_grad()
                loss_of(m, step).backward()
                opt.step()
        assert_parameters_equal(plain_model, plain, model, optimizer)
        return {"where": where, "points": checks.points, "ran": sorted(ran)}


def sweep(name: str, real_signal: bool = False) -> None:
    """Interrupt the hand-off at each of its points in turn (run in a subprocess: prints the outcomes)."""
    options, codes = SWEEPS[name]
    print_sweep(functools.partial(interrupted_once, options, codes, real_signal=real_signal))


def swept(name: str, real_signal: bool = False) -> list[tuple[str, list[int]]]:
    """:func:`sweep` in a subprocess: each point's name and the slices that ran, once it exited."""
    return run_sweep("import sys; from tests.test_worker_interrupts_and_fork import sweep; "
                     "sweep(sys.argv[1], sys.argv[2] == 'real')", name, "real" if real_signal else "raise",
                     timeout=TIMEOUT)


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_an_interrupt_anywhere_in_a_hand_off_leaves_what_ran_registered_named_and_exact(name):
    # Before the fix, an interrupt once the worker had queued the update (from its queue's append
    # to the end of HostWorker.submit) withdrew it: it ran unregistered (the next load did not wait
    # for it) and was named as left as it was; one as submit let its lock go left it held.
    outcomes = swept(name)
    assert any(ran == [0] for _, ran in outcomes)
    queued_at = [where for where, ran in outcomes if ran == [0, 1]]
    if name == "ram":  # with the tier, the update is queued inside StateTier.submit, which is not swept
        assert any("HostWorker.submit" in where for where in queued_at), outcomes


def test_a_real_ctrl_c_anywhere_in_submit_leaves_the_worker_usable_and_the_exit_quick():
    # A SIGINT as submit left its ``with self._condition:`` (threading.Condition.__exit__, Python
    # code where CPython checks for signals) left the worker's lock held: the worker waited
    # forever, and so did the interpreter's exit, for it.
    outcomes = swept("ram", real_signal=True)
    assert any(ran == [0, 1] for _, ran in outcomes) and any(ran == [0] for _, ran in outcomes)


FORKS = """
import os, sys, threading
import torch
from torch import nn
from offload import OffloadModel, OffloadOptimizer
from offload.tiers.slice_update import SliceStep
from tests.test_worker_interrupts_and_fork import batch_loss, fork_twins, hold_slice_1, same, train_on

torch.set_num_threads(1)  # libgomp's thread pool does not survive a fork (PyTorch's own limit)
scenario = sys.argv[1]
plain_model, plain, model, optimizer = fork_twins()
train_on(plain_model, plain, model, optimizer, [0, 1])

if scenario == "synchronized":  # the child trains on, as the plain optimizer does
    optimizer.synchronize()
    pid = os.fork()
    if pid == 0:
        train_on(plain_model, plain, model, optimizer, [2, 3])
        sys.exit(0 if same(plain_model, model, optimizer) else 3)  # the exit, with a worker started again
elif scenario == "pending":  # slice 1's update runs in the parent as the child is forked
    started, gate, real_run = hold_slice_1()
    optimizer.zero_grad()
    batch_loss(model, 2).backward()
    optimizer.step()
    assert started.wait(60)
    pid = os.fork()
    if pid == 0:
        messages = []
        for attempt in (lambda: batch_loss(model, 3), optimizer.step):
            try:
                attempt()
            except RuntimeError as error:
                messages.append(str(error))
        told = len(messages) == 2 and all("optimizer.synchronize() before forking" in m and "'spawn'" in m
                                           for m in messages)
        print("child:", messages[:1], flush=True)
        sys.exit(0 if told else 3)
    SliceStep.run = real_run
    gate.set()
    plain.zero_grad()
    batch_loss(plain_model, 2).backward()
    plain.step()
elif scenario == "dataloader":  # forked workers of a DataLoader, as an update runs
    started, gate, real_run = hold_slice_1()
    train_on(plain_model, plain, model, optimizer, [2])
    assert started.wait(60)
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="fork")
    steps = [int(b.sum()) for (b,) in loader]
    SliceStep.run = real_run
    gate.set()
    train_on(plain_model, plain, model, optimizer, steps)
    pid = None
if pid is not None:
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
train_on(plain_model, plain, model, optimizer, [4, 5])
print("parent same:", same(plain_model, model, optimizer), flush=True)
"""


def fork_twins() -> tuple[nn.Module, torch.optim.Optimizer, OffloadModel, OffloadOptimizer]:
    """The plain AdamW on an OffloadModel, and an OffloadOptimizer on a twin (no LayerNorm: its
    kernel is not safe in a fork child whatever steps it, a libgomp limit)."""
    def network() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    plain_model = OffloadModel(network(), device="cpu", num_slices=3)
    model = OffloadModel(network(), device="cpu", num_slices=3)
    return (plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-2, fused=True), model,
            OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True))


def batch_loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
    return model(x).pow(2).mean()


def train_on(plain_model: nn.Module, plain: torch.optim.Optimizer, model: OffloadModel, optimizer: OffloadOptimizer,
             steps: list[int]) -> None:
    for step in steps:
        for m, opt in ((plain_model, plain), (model, optimizer)):
            opt.zero_grad()
            batch_loss(m, step).backward()
            opt.step()


def same(plain_model: nn.Module, model: OffloadModel, optimizer: OffloadOptimizer) -> bool:
    optimizer.synchronize()
    return all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters()))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX only")
@pytest.mark.parametrize("scenario", ["synchronized", "pending", "dataloader"])
def test_a_fork_child_trains_on_or_is_told_to_synchronize_first_and_the_parent_is_unchanged(scenario):
    # Before the fix the child hung in its next wait for the worker, whose thread it does not have:
    # forever, after synchronize() too (its next step's update was never run).
    done = run_python(FORKS, scenario, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.splitlines()[-1] == "parent same: True", done.stdout
