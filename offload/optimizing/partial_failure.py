"""``PartialFailure``: what an ``OffloadOptimizer`` remembers of an update that failed part way, so
that nothing saves that mix of two steps (Note: [An update that failed part way]). What it does not hold: the hand-off of the updates (``stepping.py``), the
waits that raise their errors (``offload/streams/updates.py``), or the checks of updates started
in backward (``in_backward.py``, which reports its own failures here).

Note: [An update that failed part way]
    A step updates its slices one at a time, with no backup (``docs/optimizer.md``, "Failures"):
    when one raises (a :class:`~offload.HostUpdateError`, at the next wait), the updates that ran
    before it keep their result, those the worker had not started are skipped, and it may be
    partly updated. Which ran first depends on the schedule, not on the index (from ``step()``
    the slices before it; from backward, ``update_in_backward``, as the gradients landed), so the
    error cannot name them (:func:`~offload.tiers.slice_update.other_slices`); this record can. A
    backward that raised after ``update_in_backward`` had started updates leaves those slices
    updated and the others not. The parameters and the optimizer state then mix two steps.
    The error says so once; this record keeps saying it, naming the slices:

    1. Each update handed over is recorded (:meth:`PartialFailure.handing`), and the update itself
       notes when it starts changing host memory (the optimizer is called: :meth:`run`) and when
       it is done. A round is a step's updates: it begins where they begin (:meth:`before_step`:
       in ``step()``, or in the backward that starts them with ``update_in_backward``, whose
       ``step()`` goes on with the same round), and forgets which slices the last one changed;
       while an update of the last round still runs, the new one joins it instead. Not "since
       every update was done": backward hands them over one at a time as the gradients land, a
       worker that keeps up finishes each before the next, and a slice updated early in the
       step would be forgotten, so that a later failure latched no mix, or named too few.
    2. An update that ended without being done (it raised, or the worker skipped it after another
       one raised) ends its round: once the round's updates have been waited for (which raises
       the error first, if no wait has yet), the mix is *latched* when any update of the round
       started changing host memory. When none did (a read of the first slice's state or masters
       failed before its update began), every slice is as it was, and nothing is latched.
    3. While latched, ``state_dict()``, ``state_by_slice()`` and ``save_checkpoint`` refuse
       (``RuntimeError``, as for a partly loaded disk tier), so no checkpoint holds the mix and
       ``latest`` keeps naming the last good one. Neither a forward nor ``step()`` is refused:
       the error said what the update left, and training on once its cause is gone is the
       caller's choice (``step()`` after a backward that raised with ``update_in_backward``
       refuses once, as it did before: ``in_backward.py``); no checkpoint holds it until a load.
    4. The mix is gone once loads replaced both the state and the model's parameters since the
       round began (a step between them mixes them again): ``load_checkpoint``, or the
       optimizer's ``load_state_dict()`` and the model's, in either order. The optimizer's load
       tells the record (:meth:`forget`), having waited for every update, so a failure no wait
       has latched yet is latched first; each layer's load hooks tell it which parameters a load
       wrote (:class:`_LoadWatch`, on the layers from the first round on: a load between the
       failure and its latch counts), of those that train (``requires_grad``: a frozen one gets
       no gradient, and no update changes it). The model's ``load_state_dict()`` counts a
       parameter whose tensor it replaced or wrote (its version counter or address moved: not
       one it left out, nor one whose shape did not fit); ``load_checkpoint``, which runs the
       post-hooks only, once it wrote every tensor it checked against the model, counts them
       all. The optimizer's load alone leaves the parameters mixing two steps, and the refusal
       says to load them.
    5. Sharded over ranks, each rank's record is of its own updates, and a rank whose part of a
       slice failed is the only one whose update raised; but every rank took that slice's
       parameters from it (Note: [A failed part of a sharded update] in
       ``offload/streams/collectives.py``). The others are :meth:`told` so by the exchange: they
       latch the mix too and raise a :class:`~offload.HostUpdateError` naming that rank at their
       next wait, once a step (:meth:`raise_told`), so every rank refuses the same saves.
    6. A hand-off that raises part way (Ctrl-C's ``KeyboardInterrupt`` between two slices, or
       any error there) withdraws nothing it queued: an update queued before the error runs, is
       registered with the waits like any other (its state written, its masters written back:
       ``stepping.py``, Note: [Disk tier failures] in ``offload/tiers/disk_tier.py``), and those
       not handed over do not run. Which is which the update worker says, wherever in the
       hand-off the error came: it queues an update in one step (Note: [A worker under
       interrupts and forks] in ``offload/streams/workers.py``). When a step's hand-off (from
       ``step()``'s first update, or ``update_in_backward``'s, to its last) raises after some
       update was handed over and before all were, the mix is latched at once
       (:meth:`interrupted`), naming the slices updated; when none was, nothing changed and
       nothing is latched. An update run in the caller's thread that raised inside (a resident
       slice's) is rule 2's.
    7. With the masters on disk, a write-back of a slice's masters or gradients that failed
       leaves values in RAM that the kernel may later replace with what the file held before
       (Note: [Masters on disk] in ``offload/tiers/master_files.py``): the parameters a step
       behind the state, or updated from older gradients. The flush that raises its
       :class:`~offload.DiskTierError` (in ``step()`` or a wait) latches it first
       (:meth:`unwritten`), as a mix that *may* be there: refused as rule 3 says, until loads as
       rule 4 says. Not ``step()`` (rule 3): training on is the caller's choice, and no checkpoint
       holds what it trains on. The error and the refusals name the checkpoint to reload when
       this optimizer was saved into one since its last load (:meth:`saved`): the last saved
       before the failure, as a save flushes first, and none is saved after it. A load forgets
       it: the last one saved before it may hold another line of steps than the one loaded.
       A write-back that the slice's storage did itself and that failed (a forward's cast of a
       stale shadow, a checkpoint's release of the masters: Note: [A write-back outside the
       masters' writer] in ``offload/streams/masters_io.py``) was raised to its caller at once,
       and is recorded on the storage: :meth:`check` and :meth:`before_step` latch it
       (:meth:`_latch_unwritten`) without raising it again, naming the slice. Loads before a
       write-back failed do not end its latch, wherever it is latched: the end of
       ``load_checkpoint`` writes back the masters it loaded, after its own load of the state.
       The model keeps every such failure too (``MasterFiles.failures``, its saves refused until
       a load of its slice's parameters): at its first look an optimizer built after one takes
       those the model latches still as its own, and names the model's last checkpoint saved
       with an optimizer's state when it was saved into none itself.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..streams import Event
from ..streams.masters_io import failed_write_backs, latched_text
from ..tiers.slice_update import HostUpdateError


@dataclass(eq=False)
class Handed:
    """One slice's update, handed over: its event once submitted to a worker."""

    index: int  # the slice's index; -1: the parameters outside the model
    event: Event | None = None
    in_caller: bool = False  # run in the caller's thread (resident slices, parameters outside the model)
    done: bool = False  # ran to its end (a sharded update's exchange reads it, on another thread)


class PartialFailure:
    """The updates of the current round, and the mix a failed one left (Note: [An update that
    failed part way])."""

    def __init__(self) -> None:
        self._unfinished: set[Handed] = set()  # handed over, not done (the worker's thread discards)
        self._changing: set[int] = set()  # slices whose update of this round started changing host memory
        self._mixed: str | None = None  # what the mix is, once latched
        # Other ranks that did not finish their part of a sharded step (rule 5): the step, per rank
        # the slices, and whether this rank was told. Written by the exchange's worker.
        self._lock = threading.Lock()
        self._told: tuple[int, dict[int, set[int]], bool] = (-1, {}, False)
        # Slices whose update the step being handed over handed over (rule 6); -1: parameters outside the model.
        self._this_step: set[int] = set()
        # - What loads replaced since the round began (rule 4): the state, and the model's
        #   parameters (by id) no load wrote yet, None for all of them; the layers' hooks tell it.
        self._state_loaded = False
        self._unloaded: set[int] | None = None
        self._watches: list[_LoadWatch] = []
        # The checkpoint this optimizer was last saved into since its last load, to reload (rule 7).
        self._saved: Path | None = None
        # - The model's failed write-backs (rule 7), by their number: those latched (None: none
        #   looked at yet), and those before the last load of the state (failed_write_backs() then).
        self._unwritten_seen: int | None = None
        self._unwritten_at_load = 0
        self._files: Any = None  # the model's MasterFiles, once looked at: its checkpoints to reload

    # -- the updates ---------------------------------------------------------------------------------

    def handing(self, index: int, in_caller: bool = False) -> Handed:
        """Slice ``index``'s update is about to be handed over (``in_caller``: run here); a new
        round starts with the step (:meth:`before_step`)."""
        handed = Handed(index, in_caller=in_caller)
        self._unfinished.add(handed)
        self._this_step.add(index)
        return handed

    def withdrawn(self, handed: Handed) -> None:
        """The update was not handed over after all (its submission raised)."""
        self._unfinished.discard(handed)
        self._this_step.discard(handed.index)

    def withdrawn_part_way(self, index: int) -> None:
        """Slice ``index``'s hand-off raised inside :meth:`handing` (an interrupt), before its caller
        held what that recorded: withdraw what it got to record, if anything."""
        # A copy: the update worker discards what it finishes while this looks.
        for handed in list(self._unfinished):
            if handed.index == index and handed.event is None and not handed.in_caller:
                self._unfinished.discard(handed)
        self._this_step.discard(index)

    def step_begins(self, started: Collection[int]) -> None:
        """``step()`` starts handing its updates over; the slices ``started`` had theirs handed over
        in backward already (``update_in_backward``)."""
        self._this_step = set(started)

    def step_handed(self) -> None:
        """Every update of the step was handed over."""
        self._this_step = set()

    def handed_this_step(self, index: int) -> bool:
        """Whether slice ``index``'s update was handed over in the step being handed over."""
        return index in self._this_step

    def interrupted(self, error: BaseException, left: Collection[int] | None, during: str) -> None:
        """A step's hand-off raised ``error`` part way (rule 6), ``during`` what, leaving the updates
        of slices ``left`` (``None``: those it had not reached) not handed over: latch the mix when
        some update was handed over and some left."""
        if any(h.in_caller for h in self._unfinished):
            return  # an update in the caller raised inside it: rule 2 latches that, naming it
        updated, self._this_step = self._this_step, set()
        if updated and (left is None or left):
            left_text = (f"{_named(set(left))} left as they were" if left is not None else
                         "the slices it had not reached (and any parameters outside the model) left as they were")
            self.mixed(f"{during} raised {type(error).__name__} while it handed the updates over: "
                       f"{_named(updated)} updated (or being updated), {left_text}")

    def run(self, handed: Handed, update: Callable[[], None]) -> None:
        """Run ``update`` (one slice's optimizer call), noting that it changes host memory from
        now on, and that it is done once it returns. Runs on the update worker's thread."""
        self._changing.add(handed.index)
        update()
        handed.done = True
        self._unfinished.discard(handed)

    # -- the mix -------------------------------------------------------------------------------------

    def mixed(self, what: str) -> None:
        """Latch a mix of two steps (``what`` it is)."""
        if self._mixed is None:
            self._mixed = f"mix two steps: {what}"

    def unwritten(self, what: str, after_load: bool = True) -> str:
        """Latch that a write-back of masters or gradients failed (``what``: the slices, the files,
        why), a mix that may be there (rule 7); what the error should say to reload. ``after_load``:
        it failed after the loads so far, which do not end the latch (rule 4 counts the loads after it)."""
        if self._mixed is None:
            self._mixed = f"may mix two steps: {what}"
        if after_load:
            self._state_loaded, self._unloaded = False, None
        return f"reload the last checkpoint saved before this error ({self._load_call()})"

    def _latch_unwritten(self, engine: Any) -> None:
        """Latch the write-backs of ``engine``'s masters or gradients that failed since the last look
        (rule 7): nothing to look at while none failed in this process. At the first look, those
        the model latches still (no load replaced their slices' parameters since): an optimizer
        built after a failure inherits it."""
        self._files = files = engine.master_files
        latest = failed_write_backs()
        if files is None or latest == self._unwritten_seen:
            return
        seen, self._unwritten_seen = self._unwritten_seen, latest
        records = {index: r for index, r in files.failures(engine.slices, seen).items() if r.number <= latest}
        if records:
            self.unwritten(latched_text(records),
                           after_load=max(r.number for r in records.values()) > self._unwritten_at_load)

    def saved(self, path: Path) -> None:
        """A save of this optimizer into ``path`` succeeded: the checkpoint to reload (rule 7)."""
        self._saved = Path(os.path.abspath(path))

    def _load_call(self) -> str:
        """The call that loads the last checkpoint: the one saved since the last load (rule 7),
        while it is there, else whatever ``latest`` names."""
        if self._saved is not None and self._saved.is_dir():  # a refusal's cost, not a step's
            return f"load_checkpoint({str(self._saved)!r}, model, optimizer)"
        if self._files is not None:  # the model's, saved with another optimizer (one built before this)
            return self._files.load_call(optimizer=True)
        return "load_checkpoint(latest_checkpoint(directory), model, optimizer)"

    def check(self, doing: str, engine: Any) -> None:
        """Raise if the parameters and the optimizer state mix two steps: ``doing`` would save or
        hand out that mix. An update's error not raised yet is raised first (``engine``'s waits).

        Raises:
            HostUpdateError: an update raised, and no wait has said so yet.
            DiskTierError: a write-back of masters on disk failed, and no wait has said so yet.
            RuntimeError: an update failed part way, and loads have not replaced both the state and
                the model's parameters since (the message says which is still missing).
        """
        self._latch(engine)
        if engine.master_files is not None:  # a failed write not raised yet is raised here, as a wait would
            engine.master_files.flush(self.unwritten)
        self._latch_unwritten(engine)
        self._forget_replaced()
        if self._mixed is None:
            return
        mix = f"this OffloadOptimizer's parameters and state {self._mixed}."
        if self._state_loaded:
            raise RuntimeError(
                f"{mix} Its state was loaded since, but not the model's parameters, which still hold that mix: "
                f"{doing} would use them; load the model's parameters too (the model's load_state_dict() of the "
                "checkpoint the state came from, or load_checkpoint(latest_checkpoint(directory))).")
        if self._unloaded == set():
            raise RuntimeError(
                f"{mix} The model's parameters were loaded since, but not the optimizer's state: {doing} would use "
                "it; load it too (load_state_dict() of the checkpoint the parameters came from, or "
                f"{self._load_call()}).")
        raise RuntimeError(
            f"{mix} {doing} would use that mix; load the last checkpoint first ({self._load_call()}, or "
            "load_state_dict() and the model's load_state_dict() of it).")

    def before_step(self, engine: Any, new_round: bool = True) -> None:
        """In ``step()`` (or the backward that would start updates): latch what the last round left
        before a new one starts (rule 3: nothing is refused here); an update's error not raised
        yet is raised first. ``new_round``: the step's updates begin here, not in the backward
        before (rule 1)."""
        self._latch(engine)
        self._latch_unwritten(engine)
        self._forget_replaced()
        if not self._watches:  # from the first round on: a load after a failure counts (rule 4)
            self._watches = _watch(self, engine)
        # What this round's updates write is no load's (rule 4).
        self._state_loaded, self._unloaded = False, None
        if new_round and not self._unfinished:
            self._changing = set()

    def forget(self) -> None:
        """A load replaced the state, once every update had ended: latch what the round left (rule
        2), and forget the mix once the model's parameters were loaded too (rule 4)."""
        self._latch_ended()
        self._this_step, self._state_loaded, self._saved = set(), True, None
        self._unwritten_at_load = failed_write_backs()
        with self._lock:
            self._told = (-1, {}, False)
        self._forget_replaced()

    def parameters_loaded(self, tensors: Iterable[torch.Tensor]) -> None:
        """A load wrote ``tensors``, parameters of the model's layers as they were before it (rule 4)."""
        self.parameters_to_load()
        assert self._unloaded is not None
        self._unloaded.difference_update(map(id, tensors))

    def parameters_to_load(self) -> None:
        """Before a load writes anything: the parameters no load wrote yet, at its first every one an
        update may have changed (a frozen one, which gets no gradient, is never updated)."""
        if self._unloaded is None:
            self._unloaded = {id(p) for watch in self._watches for p in watch.parameters() if p.requires_grad}

    def _forget_replaced(self) -> None:
        """Forget the mix once loads replaced both the state and the parameters (rule 4)."""
        if self._state_loaded and self._unloaded == set():
            self._mixed = None

    def told(self, step: int, index: int, world_size: int, ranks: list[int]) -> None:
        """The ``ranks`` (of ``world_size``) did not finish their part of step ``step``'s update
        of slice ``index``, which this rank took from them as it was (rule 5). Runs on the
        exchange's worker."""
        with self._lock:
            told_step, slices, said = self._told
            if told_step != step:
                told_step, slices, said = step, {}, False
            for rank in ranks:
                slices.setdefault(rank, set()).add(index)
            self._told = (told_step, slices, said)
        self.mixed(f"rank(s) {', '.join(map(str, sorted(slices)))} of {world_size} did not finish their part of a "
                   "sharded update, whose parameters every rank took from them as they were")

    def raise_told(self, world_size: int) -> None:
        """Raise, once a step, that other ranks did not finish their part of it (rule 5).

        Raises:
            HostUpdateError: another rank's part of the last sharded step failed.
        """
        with self._lock:
            step, slices, said = self._told
            if said or not slices:
                return
            self._told = (step, slices, True)
            # Under the lock: the exchange's worker may add to these sets meanwhile.
            parts = "; ".join(f"rank {rank} of {world_size}: slice(s) {', '.join(map(str, sorted(indices)))}"
                              for rank, indices in sorted(slices.items()))
        raise HostUpdateError(
            f"another rank did not finish its part of the sharded update ({parts}); its own HostUpdateError says "
            "why. Every rank took those parameters from it as they were, so on every rank the parameters and the "
            "optimizer state now mix two steps: load the last checkpoint on every rank "
            "(load_checkpoint(latest_checkpoint(directory))) before training on or saving.")

    def _latch(self, engine: Any) -> None:
        """Once an update of the round ended without being done: wait for the round (raising the
        error, if no wait has), then latch the mix, if any update had started changing host memory."""
        # A copy: the update worker discards what it finishes while this looks.
        if not any(h.in_caller or engine.copies.has_completed(h.event) for h in list(self._unfinished)):
            return  # nothing failed, or it is still running
        engine.updates.wait_all()
        self._latch_ended()

    def _latch_ended(self) -> None:
        """Every update of the round has ended: latch the mix, if one that was not done failed
        after any had started changing host memory."""
        # Once every update has ended, those not done are the ones that failed; an update that
        # finished while _latch looked leaves nothing behind and latches nothing.
        failed, self._unfinished = {h.index for h in self._unfinished}, set()
        changing, self._changing = self._changing, set()
        if changing and failed:
            self.mixed(_what_mixed(changing - failed, changing & failed, failed - changing))


class _LoadWatch:
    """One layer's load hooks: which of its parameters a load wrote, for a :class:`PartialFailure`
    (rule 4), by id. Both are held weakly: the hooks stay on the layer, which may outlive the
    optimizer. A deep copy of the layer takes them along, and tells of its own parameters, which
    the record does not hold."""

    def __init__(self, failure: PartialFailure, layer: nn.Module) -> None:
        self._failure, self._layer = weakref.ref(failure), weakref.ref(layer)
        self._before: dict[str, tuple[torch.Tensor, int, int]] | None = None

    def parameters(self) -> list[torch.Tensor]:
        layer = self._layer()
        return [] if layer is None else list(layer.parameters())

    def before(self, module: nn.Module, *_: Any) -> None:
        """The load pre-hook (in ``load_state_dict()``, not ``load_checkpoint``): each parameter
        before the load copies into it, or replaces it (``assign=True``)."""
        failure = self._failure()
        if failure is not None:
            failure.parameters_to_load()
            self._before = {name: (p, p._version, p.data_ptr()) for name, p in module.named_parameters()}

    def after(self, module: nn.Module, _incompatible: Any) -> None:
        """The load post-hook: after ``load_state_dict()``, the parameters written since
        :meth:`before`; after ``load_checkpoint`` (no pre-hook ran), every one."""
        failure, before, self._before = self._failure(), self._before, None
        if failure is None:
            return
        now = dict(module.named_parameters())
        if before is None:
            failure.parameters_loaded(now.values())
            return
        failure.parameters_loaded(p for name, (p, version, address) in before.items()
                                  if now.get(name) is not p or p._version != version or p.data_ptr() != address)

    def __reduce__(self) -> tuple[Any, ...]:
        # A pickled layer takes its hooks along; unpickled, they watch nothing.
        return _unwatched, ()


def _unwatched() -> _LoadWatch:
    """A :class:`_LoadWatch` whose record and layer are gone."""
    return _LoadWatch(PartialFailure(), nn.Module())


def _watch(failure: PartialFailure, engine: Any) -> list[_LoadWatch]:
    """Put load hooks on each of ``engine``'s layers, taken off again with ``failure``."""
    layers = {id(layer): layer for s in engine.slices for layer in s.layers}.values()
    watches = [_LoadWatch(failure, layer) for layer in layers]
    handles = [handle for layer, watch in zip(layers, watches) for handle in (
        # The public register_load_state_dict_pre_hook (newer torch) registers exactly this.
        layer._register_load_state_dict_pre_hook(watch.before, with_module=True),
        layer.register_load_state_dict_post_hook(watch.after))]
    weakref.finalize(failure, _remove, handles)
    return watches


def _remove(handles: list[Any]) -> None:
    """Take the hooks off (a function of its own: a finalizer that held the record would keep it alive)."""
    for handle in handles:
        handle.remove()


def _what_mixed(updated: set[int], partly: set[int], left: set[int]) -> str:
    """What a round that failed part way left: each part named, those that are empty left out."""
    parts = [f"{_named(updated)} updated" if updated else "",
             f"{_named(partly)} raised in its update and may be partly updated" if partly else "",
             f"{_named(left)} left as they were" if left else ""]
    return "an update failed part way: " + ", ".join(part for part in parts if part)


def _named(indices: Iterable[int]) -> str:
    """Slices by index, and the parameters outside the model (index -1)."""
    slices = sorted(i for i in indices if i >= 0)
    names = [f"slice(s) {', '.join(map(str, slices))}"] if slices else []
    if -1 in indices:
        names.append("the parameters outside the model")
    return " and ".join(names)
