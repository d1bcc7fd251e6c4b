"""Host work that rewrites slices' host copies (an optimizer's update), and what must wait for it.

An update of slice ``k`` runs on a host worker while the device works; it must finish before a
load reads slice ``k``'s host copy, and nothing that reads the host copies through the model
(``parameters()``, ``state_dict()``) may see it half done. :class:`SliceUpdates` keeps, per slice,
the event of the last update submitted and is the one place that waits for it: the device slots
before loading a slice, the model before handing out its parameters.

An update may also write the slice's half-precision *shadow* from the fresh masters (one pass
over host memory instead of a separate cast at the next forward); a slice whose update is pending
keeps its shadow as the update leaves it.

Work may also be *owed* on a slice: recorded, not yet submitted (a clip's scaling of its gradients,
which the slice's next update takes into its own pass: Note: [Scaling in the update] in
``offload/optimizing/deferred_scaling.py``). Anything that waits for the slice, or asks for its
event, submits what is owed first; only :meth:`SliceUpdates.claim` takes it unsubmitted.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

from .backend import Event
from .copies import CopyStreams
from .host_storage import SliceStorage


class Owed(Protocol):
    """Work recorded on a slice and submitted only when something needs it done."""

    def submit(self) -> None:
        """Submit the work now; it reports its event with :meth:`SliceUpdates.submitted`, naming
        itself ``claimed`` (owed until then)."""


class SliceUpdates:
    """Pending host updates, per slice.

    Args:
        copies: the copy engine (its waits).
        storages: the host copies of every slice.
    """

    def __init__(self, copies: CopyStreams, storages: Sequence[SliceStorage]) -> None:
        self.copies = copies
        self.storages = storages
        self._pending: dict[int, Event] = {}
        self._no_shadow: set[int] = set()  # slices whose pending work writes no shadow
        self._owed: dict[int, Owed] = {}
        self._also: list[weakref.WeakMethod[Callable[[], None]]] = []  # see raise_also

    def raise_also(self, check: Callable[[], None]) -> None:
        """After each wait for an update, call ``check`` (a bound method, held weakly) too: it
        raises what the work the waited-for events stand for left for the caller elsewhere. A
        sharded update's event is its exchange's, on another worker than the update's, whose error
        would otherwise never reach the caller (Note: [A failed part of a sharded update] in
        ``collectives.py``)."""
        self._also = [ref for ref in self._also if ref() is not None]
        if all(ref() != check for ref in self._also):
            self._also.append(weakref.WeakMethod(check))  # type: ignore[arg-type]

    def _raise_also(self) -> None:
        for ref in list(self._also):
            check = ref()
            if check is not None:
                check()

    def owe(self, index: int, owed: Owed) -> None:
        """Record work on slice ``index`` that runs after everything submitted for it so far, once
        something needs it: a wait, an event asked for, or the next update, which may
        :meth:`claim` it. Work already owed on the slice is submitted first."""
        self._submit_owed(index)
        self._owed[index] = owed

    def claim(self, index: int) -> Owed | None:
        """Slice ``index``'s owed work, for the update about to be submitted to do in its own pass
        (``None``: nothing owed). It stays owed until :meth:`submitted` says that update was
        queued (``claimed``): an interrupt between the two (Ctrl-C) leaves it owed, never lost,
        and never done twice (Note: [A worker under interrupts and forks] in ``workers.py``)."""
        return self._owed.get(index)

    def _submit_owed(self, index: int | None = None) -> None:
        """Submit what is owed on slice ``index`` (``None``: on every slice, in slice order); each
        stays owed until its submission says it was queued (:meth:`submitted`, as for :meth:`claim`)."""
        for k in sorted(self._owed) if index is None else [index]:
            owed = self._owed.get(k)
            if owed is not None:
                owed.submit()

    def submitted(self, index: int, event: Event, writes_shadow: bool = True, claimed: Owed | None = None) -> None:
        """Work that rewrites slice ``index``'s host memory was submitted: an update, or, not
        ``writes_shadow``, work that leaves the parameters and their shadow alone (a clip's
        scaling of its gradients: Note: [Scaling in the update] in
        ``offload/optimizing/deferred_scaling.py``); ``event`` completes when it is done, and it
        stands for everything submitted for the slice before. ``claimed``: the work owed on the
        slice that it does (:meth:`claim`), owed no more. Called again with the same event (a
        hand-off interrupted in here registers again), it changes nothing."""
        # No call from here to the store, so no check for signals: an interrupt cannot leave the
        # owed work dropped and the event unknown (Note: [A worker under interrupts and forks]).
        if claimed is not None and index in self._owed and self._owed[index] is claimed:
            del self._owed[index]
        assert index not in self._owed, "internal error: work submitted on a slice past what it owes"
        self._pending[index] = event
        if writes_shadow:
            self._no_shadow.discard(index)
        else:
            self._no_shadow.add(index)

    def keeps_shadow(self, index: int) -> bool:
        """Whether slice ``index`` has an update pending that will leave its shadow current."""
        self._submit_owed(index)
        return index in self._pending and index not in self._no_shadow

    def pending(self) -> bool:
        """Whether any update is pending (or work owed)."""
        return bool(self._pending or self._owed)

    def done(self, index: int) -> bool:
        """Whether slice ``index`` has no update pending or its update has run, without waiting: a
        hint (a load of it still calls :meth:`wait`)."""
        self._submit_owed(index)
        return self.copies.has_completed(self._pending.get(index))

    def event(self, index: int, claimed: Owed | None = None) -> Event | None:
        """The event of slice ``index``'s pending update (``None``: none pending), for work that
        waits for it off this thread (a cast ahead of the slice's load); ``claimed``: the owed
        work that the caller's submission does, not submitted here (:meth:`claim`)."""
        if claimed is None or self._owed.get(index) is not claimed:
            self._submit_owed(index)
        return self._pending.get(index)

    def wait(self, index: int) -> Event | None:
        """Block until slice ``index``'s host copy is final: before a load reads it. Returns the
        event of the update it waited for (``None``: none was pending)."""
        self._submit_owed(index)
        event = self._pending.pop(index, None)
        self._no_shadow.discard(index)
        try:
            # A load must not read a host copy the update is still writing.
            self.copies.wait_host(event)
            if event is not None:
                self._raise_also()
        except BaseException:
            self.storages[index].expire_shadow()
            self._failed()
            raise
        return event

    def finish_all(self) -> None:
        """Block until every pending update is done, leaving them pending: each slice keeps the
        shadow its update wrote (a forward casts it again only for a slice with none pending).
        For callers that only need the updates to have read what they read (the gradients)."""
        self._submit_owed()
        try:
            for index in sorted(self._pending):
                self.copies.wait_host(self._pending[index])
            if self._pending:
                self._raise_also()
        except BaseException:
            self._failed()
            raise

    def _failed(self) -> None:
        """An update failed. A worker raises its error at the first wait on it, which may be the
        wait for another slice's update, so which shadows are current is unknown: every pending
        slice's is cast again after its wait. The slices stay pending: work after the failed
        update on other workers (a sharded update's exchange) still writes their host copies."""
        for index in self._pending:
            self.storages[index].expire_shadow()

    def wait_all(self, shadows_stale: bool = False) -> None:
        """Block until every host copy is final, in slice order.

        Args:
            shadows_stale: the caller may write the host copies next (it asked for them through
                the model), so shadows the updates wrote are no longer to be trusted.
        """
        self._submit_owed()
        for index in sorted(self._pending):
            self.wait(index)
        if shadows_stale:
            for storage in self.storages:
                storage.expire_shadow()

    def adopt(self, storages: Sequence[SliceStorage]) -> None:
        """Serve re-laid-out storages; nothing may be pending."""
        assert not self._pending and not self._owed, "internal error: storages rebuilt while updates are pending"
        self.storages = storages
