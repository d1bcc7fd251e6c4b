"""``SliceUpdates``: the updates of one ``step()``, each slice's handed to the host update worker
in slice order with the tiers around it (masters on disk read in before and written back after,
the disk tier's state read and written), sharded or not; and the parameters outside the model,
stepped before ``step()`` returns. What it does not hold: what one update does
(``offload/tiers/slice_update.py``), or how a load waits for it (``offload/streams/updates.py``).

Note: [Updates in the next forward's order]
    The next forward loads slice 0 first, then 1, 2, ..., each only once its update is done. So
    the update worker (``HostWorker(by_key=True)`` in ``offload/streams/workers.py``) runs, of the
    updates handed to it and not started, the one of the lowest slice index whose waits are over
    (its gradients' copy to the host, its masters or state read in from disk), not the oldest:

    1. ``step()`` hands them over in slice order; they run in that order.
    2. Backward (Note: [Update in backward] in ``in_backward.py``) hands them over as their
       gradients land, the last slice first. While the worker keeps up, each runs as it lands;
       once it is behind, it takes the lowest slice waiting, so the slices the next forward
       loads first are updated first, and the updates ``step()`` starts after backward (the
       slices it deferred) go before those backward left of higher slices.
    3. When none is ready, it takes the oldest and waits for it: that is what lands first
       (copies complete in issue order), and it cannot wait for an update handed over after it.

    Exact either way: each slice's update reads its own gradients and state and writes its own
    host copies, so their order changes no value; nothing orders one slice's update after
    another's, and each update's event says only that it ran. Every wait for an update (a load,
    ``synchronize()``, ``zero_grad(set_to_none=False)``) names its slice's event, never an earlier
    slice's as a stand-in; the stream-ordering checker runs each update on a lane of its own,
    in any order its waits allow, so a wait that relied on the worker's order is reported.

Note: [Parameters outside the model]
    The parameters a ``step()`` steps that are not the model's (a head applied after the
    OffloadModel) have no load that waits for their update: the caller reads them next, directly.
    So ``step()`` returns once they are updated, as a plain optimizer's does. Their update runs on
    the update worker, not in the caller's thread, so that it never runs beside a slice's (one
    that ``step()`` just handed over, or one a backward started with ``update_in_backward``):
    some classes' host kernels are not safe on two threads at once (bitsandbytes 0.50.2's 8-bit
    CPU kernels give wrong results now and then), and an OffloadOptimizer's host updates then run
    on that one thread, one at a time.

    1. It is handed over first, with the key ``-1``: of the updates not started, the worker runs it
       next, so ``step()`` waits for it and for the update the worker is in, if any, not for the
       slices queued before it. It is the "slice before slice 0" of Note: [An update that failed
       part way] (``partial_failure.py``): when it raises, the error is raised by that wait, from
       ``step()``, as it was in the caller's thread, and the slices' updates behind it are
       skipped, as those after any failed update are.
    2. A hand-off that raises part way (rule 6 there) still waits for it once it was handed over:
       nothing else would, and the caller may read or load those parameters next.
    3. When any of them is on a device, the update stays in the caller's thread, in its stream,
       queued after the backward that made their gradients: the worker's thread would queue it
       on another stream. Device kernels do not share the host kernels' hazard; those of its
       parameters in host memory then do (one inner optimizer steps them all), so a class such as
       bitsandbytes' wants them all in one place.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from ..kernels.scaling import OwedScaling
from ..streams import Event
from ..streams.mapped import MappedFile
from ..streams.workers import HostWorker, mark_of, queued_since
from ..tiers.slice_update import HostUpdateError, SliceStep
from ..walk.engine import Engine
from .partial_failure import Handed, PartialFailure
from .sharding import Sharding
from .tier_plumbing import TierPlumbing
from .whole_step import rehearse


class SliceUpdates:
    """Hands the updates of a step to the host update worker (Note: [Overlapped host update] in
    ``offload/optimizer.py``).

    Args:
        engine: the engine of the optimizer's model.
        disk: the optimizer's disk tier plumbing.
        sharding: the exchange of a sharded update, or ``None``.
        num_threads: CPU threads of the update worker (``None``: PyTorch's setting).
    """

    def __init__(self, engine: Engine, disk: TierPlumbing, sharding: Sharding | None,
                 num_threads: int | None) -> None:
        self.engine = engine
        self.disk = disk
        self.sharding = sharding
        self.num_threads = num_threads
        self.worker: HostWorker | None = None  # started by the first step
        #: Which updates are done, and the mix one that failed part way left (Note: [An update that
        #: failed part way] in partial_failure.py).
        self.failure = PartialFailure()
        self._steps = 0  # step() calls so far: another rank's failure is said once a step
        if sharding is not None:
            # A sharded slice's pending event is its exchange's: the update's own error, and other
            # ranks' failures, reach this thread after each wait (Note: [A failed part of a sharded
            # update] in offload/streams/collectives.py).
            engine.updates.raise_also(self.raise_late)

    def before_step(self, optimizer: Any, when: str) -> None:
        """Before ``optimizer``'s updates start (``when``: as ``_before_update`` in ``offload/optimizer.py``):
        in a ``step()`` that starts them all, a step refused as a whole is refused first (Note: [A step
        refused as a whole] in ``whole_step.py``); then a round of Note: [An update that failed part way] begins."""
        if when == "step":
            rehearse(optimizer)
        self.failure.before_step(self.engine, when != "stepped")

    def submit(self, steps: Sequence[SliceStep], rest: Sequence[SliceStep], hyper: list[dict[str, Any]],
               grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Queue the update of the parameters outside the model, then each slice's in slice order,
        with the gradients and hyperparameters ``hyper`` captured now; return once the parameters
        outside the model are updated (Note: [Parameters outside the model])."""
        self.start_worker()
        self._steps += 1
        outside = None
        try:
            outside = self._hand_outside(rest, hyper, grad_scale, found_inf)
            for step in steps:
                if self.sharding is None:
                    self._submit_update(step, hyper, grad_scale, found_inf)
                else:
                    _hand_sharded(self, step, hyper, grad_scale, found_inf)
        except BaseException as error:
            # Note: [An update that failed part way], rule 6: what was handed over runs, the rest does not.
            self.failure.interrupted(error, _left(steps, rest, self.failure.handed_this_step), "step()")
            self.engine.copies.wait_host(outside)  # Note: [Parameters outside the model], rule 2
            raise
        self.failure.step_handed()
        # The caller reads them next, with no wait of its own (Note: [Parameters outside the model]).
        self.engine.copies.wait_host(outside)

    def _hand_outside(self, rest: Sequence[SliceStep], hyper: list[dict[str, Any]], grad_scale: torch.Tensor | None,
                      found_inf: torch.Tensor | None) -> Event | None:
        """Hand the update of the parameters outside the model (``rest``: none or one step) to the
        update worker, ahead of every slice's; its event, or ``None`` when it ran here (one of them
        is on a device) or there is nothing to update (Note: [Parameters outside the model])."""
        for step in rest:
            assert step.whole is not None
            step.bind()  # its last update is done: the step() that queued it waited for it
            grads = [p.grad for p in step.whole.params]
            update = functools.partial(step.run, grads, hyper, grad_scale, found_inf)
            if any(p.device.type != "cpu" for p in step.whole.params):  # rule 3: in this thread's stream
                self.failure.run(self.failure.handing(-1, in_caller=True), update)
                continue
            if all(g is None for g in grads):
                continue
            worker = self.start_worker()
            mark, handed = mark_of(worker), None  # see _queued_since
            try:
                handed = self.failure.handing(-1)
                # Key -1: the worker runs it before any slice's update not started (rule 1).
                handed.event = self.engine.copies.submit(worker, functools.partial(self.failure.run, handed, update),
                                                         key=-1)
            except BaseException:
                _outside_raised(self, handed, _queued_since(worker, mark, self.disk, -1))
                raise
            return handed.event
        return None

    def run_now(self, steps: Sequence[SliceStep], hyper: list[dict[str, Any]], grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None, started: Collection[int] = ()) -> None:
        """Step resident slices here and now, on the device, in this thread's stream (Note:
        [Resident slices] in ``offload/streams/resident_storage.py``): queued after the backward
        that produced their gradients and before the next forward's loads of them, with no wait on
        the host. ``grad_scale`` and ``found_inf`` are GradScaler's, on the device; ``started``:
        the later slices whose update backward started already (their error note says so)."""
        self.failure.step_begins(started)
        try:
            for step in steps:
                self._run_resident(step, hyper, grad_scale, found_inf, started)
        except BaseException as error:
            # Note: [An update that failed part way], rule 6: the streamed slices follow, not handed over yet.
            self.failure.interrupted(error, None, "step()")
            raise

    def _run_resident(self, step: SliceStep, hyper: list[dict[str, Any]], grad_scale: torch.Tensor | None,
                      found_inf: torch.Tensor | None, started: Collection[int]) -> None:
        """Step one resident slice here and now (:meth:`run_now`)."""
        if step.whole is None:
            return
        grads = [p.grad for p in step.whole.params]
        if all(g is None for g in grads):
            return
        step.bind()
        try:
            self.failure.run(self.failure.handing(step.index, in_caller=True),
                             functools.partial(step.run, grads, hyper, grad_scale, found_inf))
        except HostUpdateError as error:
            if started:
                error.add_note(f"The update of slices {sorted(started)} ran in backward already (update_in_backward).")
            raise

    def submit_one(self, step: SliceStep, grads: list[torch.Tensor | None], hyper: list[dict[str, Any]],
                   after: Sequence[Event | None]) -> None:
        """Queue one slice's update with the gradients ``grads`` (aligned with its parameters), after
        the events ``after`` (the copy that brings them to the host): what backward starts (Note:
        [Update in backward] in ``in_backward.py``)."""
        self.start_worker()
        try:
            self._submit_update(step, hyper, None, None, grads, after)
        except BaseException as error:
            if self.failure.handed_this_step(step.index):
                # Queued, then interrupted: backward does not count it as started (Note: [An update
                # that failed part way], rule 6).
                self.failure.interrupted(error, None, "a backward (update_in_backward)")
            raise

    def raise_late(self) -> None:
        """Raise what a sharded step left for this thread (registered with the engine's waits): this
        rank's update error, held by the update worker, then other ranks' failures."""
        if self.worker is not None:
            try:
                self.worker.raise_pending()
            except HostUpdateError as error:
                if self.sharding is not None:
                    error.add_note(
                        "Sharded: what this says of slices is of this rank's part of them; the other ranks updated "
                        "theirs and took this rank's as it left them, so on every rank the parameters and the "
                        "optimizer state mix two steps: load the last checkpoint on every rank.")
                raise
        if self.sharding is not None:
            self.failure.raise_told(self.sharding.collectives.world_size)

    def backlog(self) -> int:
        """Updates handed to the worker and not finished yet."""
        return 0 if self.worker is None else self.worker.submitted - self.worker.finished

    def close(self) -> None:
        """Let the update worker, idle once every update is waited for, end (the optimizer follows
        its model to another engine: Note: [Moving an OffloadModel] in ``offload/modeling/placement.py``)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def start_worker(self) -> HostWorker:
        """The update worker, started if it was not."""
        if self.worker is None:
            # By key, the slice's index: Note: [Updates in the next forward's order].
            self.worker = self.engine.copies.new_worker("host update", self.num_threads, by_key=True)
            weakref.finalize(self, self.worker.close)
        return self.worker

    def _submit_update(self, step: SliceStep, hyper: list[dict[str, Any]], grad_scale: torch.Tensor | None,
                       found_inf: torch.Tensor | None, grads: list[torch.Tensor | None] | None = None,
                       after: Sequence[Event | None] = ()) -> Event | None:
        """Queue and register the update of the parameters ``step`` steps (:meth:`_hand_update`); its
        event, or ``None`` when none of them has a gradient."""
        handed = self._hand_update(step, hyper, grad_scale, found_inf, grads, after)
        return None if handed is None else handed.event

    def _hand_update(self, step: SliceStep, hyper: list[dict[str, Any]], grad_scale: torch.Tensor | None,
                     found_inf: torch.Tensor | None, grads: list[torch.Tensor | None] | None = None,
                     after: Sequence[Event | None] = (), exchanged: bool = False) -> Handed | None:
        """Queue the update of the parameters ``step`` steps on the host worker, with ``grads``
        (default: their ``.grad``) after the events ``after``, and register it with the waits;
        what was handed over (``None``: none of them has a gradient). ``exchanged``: this rank's
        part of a sharded update, followed by its exchange (:func:`_hand_sharded`).

        Queued, registered and the owed work claimed in one try: wherever an interrupt lands, the
        update is either queued and registered, the work owed on the slice done by it (and,
        ``exchanged``, its exchange queued after it and registered last, masters on disk written
        back after that), or not queued and that work still owed (Note: [A worker under interrupts
        and forks] in ``offload/streams/workers.py``)."""
        assert step.whole is not None
        if grads is None:
            grads = [p.grad for p in step.whole.params]
        if all(g is None for g in grads):
            return None
        if step.needs_bind():
            self.engine.updates.wait(step.index)  # the proxies may still be in use by its last update
            step.bind()
        worker = self.start_worker()
        exchanges = mark_of(self.sharding.collectives.worker) if exchanged and self.sharding is not None else None
        mark = mark_of(worker)  # see _queued_since
        owed = handed = None
        try:
            # A clip's scaling owed on the slice: done in the update's own pass (Note: [Scaling in
            # the update] in deferred_scaling.py), owed until the update is registered.
            owed = self.engine.updates.claim(step.index)
            scaling = getattr(owed, "scaling", None)  # an OwedSlice's (deferred_scaling.py, which imports this module)
            assert owed is None or isinstance(scaling, OwedScaling), "internal error: unknown work owed on a slice"
            handed = self.failure.handing(step.index)
            work = functools.partial(self.failure.run, handed,
                                     functools.partial(step.run, grads, hyper, grad_scale, found_inf, scaling))
            handed.event = self._submit(step.index, work, [*after, self.engine.updates.event(step.index, owed)])
            self._register(step.index, handed.event, owed, masters=not exchanged)
            if exchanged:
                self._register(step.index, _exchange(self, step, handed))
        except BaseException:
            queued = _queued_since(worker, mark, self.disk, step.index)
            _hand_off_raised(self, step.index, handed, queued, owed, masters=not exchanged)
            if exchanged and queued is not None:
                _exchange_raised(self, step, handed, exchanges)
            raise
        return handed

    def _register(self, index: int, updated: Event, claimed: Any = None, masters: bool = True) -> None:
        """Slice ``index``'s update (or a sharded one's exchange), ``updated``, was queued, doing the
        work ``claimed`` on the slice: the next load of the slice waits for it, and with masters on
        disk (``masters``) they are written back after it."""
        try:
            self.engine.updates.submitted(index, updated, claimed=claimed)
        finally:
            if masters:
                self._write_masters(index, updated)

    def _submit(self, index: int, work: Callable[[], None], waits: Sequence[Event | None] = ()) -> Event:
        """Run slice ``index``'s update on the update worker after the events ``waits`` (its masters
        read in first when they are on disk, its state read before and written after by the disk
        tier, if there is one); returns the update's event."""
        assert self.worker is not None
        files, mapped = self.engine.master_files, self.engine.slices[index].storage.masters_file
        after = list(waits)
        if files is not None and mapped is not None:
            after.append(files.read(index, mapped, self._gradients_file(index)))
            work = files.guard(index, work)
        return self.disk.submit(index, self.worker, work, after)

    def _write_masters(self, index: int, after: Event | None) -> None:
        """With masters on disk, write slice ``index``'s back and drop them after ``after``, the
        last work that writes them (Note: [Masters on disk] in ``offload/tiers/master_files.py``)."""
        files, mapped = self.engine.master_files, self.engine.slices[index].storage.masters_file
        if files is not None and mapped is not None:
            files.write(index, mapped, after, self._gradients_file(index))

    def _gradients_file(self, index: int) -> MappedFile | None:
        """Slice ``index``'s gradients' file when ``.grad`` is there (anything refers to it: Note:
        [Gradients on disk] in ``offload/streams/gradient_files.py``), to be read in and written
        back with its masters; ``None`` otherwise."""
        home = self.engine.slices[index].storage.gradient_home
        return home.file if home is not None and not home.is_idle() else None


def _queued_since(worker: Any, mark: object, disk: TierPlumbing, index: int) -> Event | None:
    """Slice ``index``'s update event if ``worker`` queued it since ``mark`` (what its ``mark()``
    said before the hand-off), wherever in the hand-off an interrupt came (Note: [A worker under
    interrupts and forks] in ``offload/streams/workers.py``); ``None`` if it did not. The
    stream-ordering checker's workers, never interrupted, cannot say: its disk tier can."""
    if isinstance(worker, HostWorker):
        return queued_since(worker, mark)
    # Kept until flush(): maybe an earlier step's, which only a checker's (never interrupted) run reads.
    return disk.tier.queued_updates.get(index) if disk.tier is not None else None


def _hand_sharded(updates: SliceUpdates, step: SliceStep, hyper: list[dict[str, Any]],
                  grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
    """Slice ``step``'s sharded update: this rank updates the parameters of it that it owns
    (``SliceUpdates._hand_update``), then every rank takes each updated parameter from its owner
    (the exchange, :meth:`Sharding.exchange`), whose event the next load of the slice waits for
    (it writes the slice's shadow); with masters on disk, they are written back after it.

    As one hand-off: wherever an interrupt lands, the exchange of an update queued is queued
    and registered too (asked of the collectives worker, queued once), as the disk tier's write
    follows its update; an exchange alone (this rank owns nothing of the slice with a gradient)
    is registered if it was queued."""
    assert updates.sharding is not None
    if not updates.sharding.stepped(step):
        return  # no parameter of the slice has a gradient, on any rank
    handed = None if step.whole is None else updates._hand_update(step, hyper, grad_scale, found_inf,
                                                                  exchanged=True)
    if handed is not None:
        return
    mark = mark_of(updates.sharding.collectives.worker)
    try:
        updates._register(step.index, _exchange(updates, step, None))
    except BaseException:
        _exchange_raised(updates, step, None, mark)
        raise


def _exchange(updates: SliceUpdates, step: SliceStep, handed: Handed | None) -> Event:
    """Queue slice ``step``'s exchange after this rank's part of its update, ``handed``
    (:meth:`Sharding.exchange`); its event."""
    assert updates.sharding is not None
    told = functools.partial(updates.failure.told, updates._steps, step.index, updates.sharding.collectives.world_size)
    return updates.sharding.exchange(step, handed, told)


def _hand_off_raised(updates: SliceUpdates, index: int, handed: Handed | None, queued: Event | None,
                     owed: Any, masters: bool = True) -> None:
    """Slice ``index``'s hand-off raised (an interrupt: Note: [An update that failed part way],
    rule 6). An update ``queued`` (its event) runs whatever follows: it is registered with the
    waits (again, if it was: that changes nothing), as any update, and does the work ``owed`` on
    the slice; its masters on disk are written back after it (``masters``; a sharded update's
    after its exchange: :func:`_exchange_raised`). One not queued is withdrawn, the work owed on
    the slice left owed, and its masters on disk written back and dropped, as for an update that
    is skipped (they may have been read in for it)."""
    if queued is not None:
        assert handed is not None, "internal error: an update queued before it was recorded"
        handed.event = queued  # its work holds it: handing() had returned
        updates._register(index, queued, owed, masters)
        return
    if handed is not None:
        updates.failure.withdrawn(handed)
    else:
        updates.failure.withdrawn_part_way(index)  # raised inside handing()
    updates._write_masters(index, None)


def _exchange_raised(updates: SliceUpdates, step: SliceStep, handed: Handed | None, mark: object) -> None:
    """Slice ``step``'s sharded hand-off raised (an interrupt) once this rank's part of the update,
    ``handed``, was queued and registered (``None``: it has none). Its exchange, if the collectives
    worker queued it since ``mark``, is registered (again, if it was: that changes nothing), or
    else queued now after that update (none: nothing of the slice was queued, so nothing is): the
    next load waits for it, not for the update alone, and the masters on disk are written back
    after it (Note: [A worker under interrupts and forks], rule 2, in ``offload/streams/workers.py``)."""
    assert updates.sharding is not None
    exchanged = queued_since(updates.sharding.collectives.worker, mark)
    if exchanged is None and handed is not None:
        exchanged = _exchange(updates, step, handed)
    if exchanged is not None:
        updates._register(step.index, exchanged)


def _outside_raised(updates: SliceUpdates, handed: Handed | None, queued: Event | None) -> None:
    """The hand-off of the parameters outside the model raised (an interrupt). Queued all the same
    (its event ``queued``), it runs: ``step()`` waits for it before it raises, as for any update
    of those (Note: [Parameters outside the model], rule 2). Not queued, it is withdrawn."""
    if queued is None:
        if handed is not None:
            updates.failure.withdrawn(handed)
        else:
            updates.failure.withdrawn_part_way(-1)  # raised inside handing()
        return
    assert handed is not None, "internal error: an update queued before it was recorded"
    handed.event = queued
    updates.engine.copies.wait_host(queued)


def _left(steps: Sequence[SliceStep], rest: Sequence[SliceStep], handed: Callable[[int], bool]) -> list[int]:
    """The slices of ``steps`` (and ``-1``, the parameters outside the model, for ``rest``) with a
    gradient whose update was not ``handed`` over: those a step's hand-off that raised left."""
    left = [s.index for s in steps if s.whole is not None and not handed(s.index)
            and any(p.grad is not None for p in s.whole.params)]
    if rest and not handed(-1) and any(p.grad is not None for s in rest if s.whole is not None for p in s.whole.params):
        left.append(-1)
    return left
