"""A dropped OffloadModel and OffloadOptimizer go at ``del``, by reference counting alone, as a plain
model and ``torch.optim`` optimizer do: nothing they hold refers back to them (Note: [What an update
holds] in offload/tiers/slice_update.py), so their host copies, device slots, pinned buffers, worker
threads and a disk tier's files do not wait for Python's cycle collector (a sweep, or a notebook cell
run again, would pile dead models up until it ran).

Each test runs with the cycle collector off: what it frees is what a program gets at ``del``.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo  # noqa: F401 - see below


from offload import DiskTier, OffloadModel, OffloadOptimizer
from offload.optimizing.in_backward import BackwardUpdates

from .test_optimizer import EXACT, batch, loss_of, network

# The first OffloadModel of a process imports torch._dynamo (torch.compiler.disable), and torch.fx
# keeps the frames of that import, the model's among them, in a cycle: imported here, before any.

# The per-tensor warning is about the optimizer class, not about freeing.
pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

#: Per setup: the OffloadModel's and the OffloadOptimizer's keyword arguments (a ``tmp_path``
#: stands where a directory is wanted).
SETUPS = {
    "plain": ({}, {}),
    "update_in_backward": ({}, {"update_in_backward": True}),
    "disk_tier": ({}, {"disk_tier": "tmp"}),
    "masters_on_disk": ({"compute_dtype": torch.bfloat16, "masters": "tmp"}, {}),
    "resident_slices": ({"resident_slices": 1}, {}),
}


@contextlib.contextmanager
def reference_counting_only() -> Iterator[list[str]]:
    """The cycle collector off (on again after, if it was), and what the finalizers and threads that
    run meanwhile could not report (a finalizer that raised, a worker thread that did): yielded."""
    gc.collect()
    was_enabled = gc.isenabled()
    unraisable, thread_hook = sys.unraisablehook, threading.excepthook
    reported: list[str] = []
    sys.unraisablehook = lambda report: reported.append(f"{report.exc_type.__name__}: {report.exc_value}")
    threading.excepthook = lambda report: reported.append(f"{report.thread}: {report.exc_value!r}")
    gc.disable()
    try:
        yield reported
    finally:
        sys.unraisablehook, threading.excepthook = unraisable, thread_hook
        if was_enabled:
            gc.enable()


def settings(kwargs: dict, tmp_path) -> dict:
    return {k: DiskTier(tmp_path) if v == "tmp" else v for k, v in kwargs.items()}


def threads_end(threads: list[threading.Thread]) -> bool:
    for thread in threads:
        thread.join(timeout=30)
    return not any(thread.is_alive() for thread in threads)


def trained(setup: str, tmp_path) -> tuple[OffloadModel, OffloadOptimizer]:
    """A model and its optimizer in ``setup``, three steps trained, every update done."""
    model_kwargs, optimizer_kwargs = SETUPS[setup]
    model = OffloadModel(network(), device="cpu", num_slices=3, **settings(model_kwargs, tmp_path))
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, **settings(optimizer_kwargs, tmp_path))
    for step in range(3):  # update_in_backward starts updates from the second backward on
        loss_of(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    if setup == "update_in_backward":
        assert optimizer._in_backward.last_started, "backward started no update: the setup tests nothing"
    return model, optimizer


#: The worker threads an OffloadOptimizer starts: its update's, its disk tier's reader and writer.
OPTIMIZER_THREADS = ("offload host update", "offload disk read", "offload disk write")


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_trained_model_and_optimizer_are_freed_at_del(setup, tmp_path):
    before = set(threading.enumerate())
    with reference_counting_only() as reported:
        model, optimizer = trained(setup, tmp_path)
        alive = [weakref.ref(model), weakref.ref(optimizer), weakref.ref(model._engine)]
        started = [t for t in threading.enumerate() if t not in before and t.name in OPTIMIZER_THREADS]
        assert started, "no worker thread was started: the setup tests nothing"
        del model, optimizer
        assert [ref() is None for ref in alive] == [True] * 3, "model, optimizer, engine"
        assert threads_end(started), [t.name for t in started if t.is_alive()]
        assert list(tmp_path.iterdir()) == [], "a disk tier's or the masters' files were left"
        assert reported == []


def test_the_device_slots_and_the_masters_workers_are_freed_at_del(tmp_path):
    before = set(threading.enumerate())
    with reference_counting_only():
        model, optimizer = trained("masters_on_disk", tmp_path)
        slots = weakref.ref(model._engine.slots)
        started = [t for t in threading.enumerate() if t not in before]
        del model, optimizer
        assert slots() is None
        assert threads_end(started), [t.name for t in started if t.is_alive()]


@pytest.mark.parametrize("disk_tier", [False, True], ids=["ram", "disk_tier"])
def test_an_update_pending_when_the_optimizer_is_dropped_lands_exactly(disk_tier, tmp_path):
    """``step()``, then ``del optimizer`` while the update still waits for the worker: the optimizer
    goes at once (its finalizers run here, not on the worker, which cannot wait for itself), and the
    update runs to its end with the state it reads: the next forward waits for it, and the model is
    the one a run that synchronized has, bit for bit."""
    reference = OffloadModel(network(), device="cpu", num_slices=3)
    reference_optimizer = OffloadOptimizer(reference, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        loss_of(reference, step).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    reference_optimizer.synchronize()

    before = set(threading.enumerate())
    with reference_counting_only() as reported:
        model = OffloadModel(network(), device="cpu", num_slices=3)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2,
                                     disk_tier=DiskTier(tmp_path) if disk_tier else None)
        for step in range(3):
            loss_of(model, step).backward()
            if step == 2:  # the worker busy until released: the last step's updates wait behind it
                gate = threading.Event()
                busy = optimizer._updates.worker.submit(gate.wait, key=-float("inf"))
            optimizer.step()
            optimizer.zero_grad()
        assert busy.worker.submitted - busy.worker.finished > 1, "no update is pending"
        dropped = weakref.ref(optimizer)
        del optimizer, busy
        assert dropped() is None, "the pending update keeps the optimizer alive"
        started = [t for t in threading.enumerate() if t not in before]
        gate.set()
        out = model(batch(10))  # waits for the updates
        torch.testing.assert_close(out, reference(batch(10)), **EXACT)
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(b, a, **EXACT, msg=lambda m: f"{name}: {m}")
        del model, out
        assert threads_end(started), [t.name for t in started if t.is_alive()]
        assert list(tmp_path.iterdir()) == [], "the disk tier's files were left"
        assert reported == []


def test_a_dropped_update_in_backward_optimizer_leaves_the_model_training():
    """Its subscription to the model's walks (the hooks that start updates in backward) goes with
    it: the model, kept, trains on without it, and nothing keeps the optimizer alive."""
    with reference_counting_only() as reported:
        model = OffloadModel(network(), device="cpu", num_slices=3)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=True)
        for step in range(3):
            loss_of(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        dropped = weakref.ref(optimizer)
        del optimizer
        assert dropped() is None
        assert not any(isinstance(s, BackwardUpdates) for s in model._engine.milestones.subscribers)
        loss_of(model, 3).backward()
        assert all(p.grad is not None for p in model.parameters())
        assert reported == []
