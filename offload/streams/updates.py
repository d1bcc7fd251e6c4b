"""Host work that rewrites slices' host copies (an optimizer's update), and what must wait for it.

An update of slice ``k`` runs on a host worker while the device works; it must finish before a
load reads slice ``k``'s host copy, and nothing that reads the host copies through the model
(``parameters()``, ``state_dict()``) may see it half done. :class:`SliceUpdates` keeps, per slice,
the event of the last update submitted and is the one place that waits for it: the device slots
before loading a slice, the model before handing out its parameters.

An update may also write the slice's half-precision *shadow* from the fresh masters (one pass
over host memory instead of a separate cast at the next forward); a slice whose update is pending
keeps its shadow as the update leaves it.
"""

from __future__ import annotations

from collections.abc import Sequence

from .backend import Event
from .copies import CopyStreams
from .host_storage import SliceStorage


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

    def submitted(self, index: int, event: Event, writes_shadow: bool = True) -> None:
        """Work that rewrites slice ``index``'s host memory was submitted: an update, or, not
        ``writes_shadow``, work that leaves the parameters and their shadow alone (a clip's
        scaling of its gradients: Note: [Scaling in the update] in
        ``offload/optimizing/deferred_scaling.py``); ``event`` completes when it is done, and it
        stands for everything submitted for the slice before."""
        self._pending[index] = event
        if writes_shadow:
            self._no_shadow.discard(index)
        else:
            self._no_shadow.add(index)

    def keeps_shadow(self, index: int) -> bool:
        """Whether slice ``index`` has an update pending that will leave its shadow current."""
        return index in self._pending and index not in self._no_shadow

    def pending(self) -> bool:
        """Whether any update is pending."""
        return bool(self._pending)

    def done(self, index: int) -> bool:
        """Whether slice ``index`` has no update pending or its update has run, without waiting: a
        hint (a load of it still calls :meth:`wait`)."""
        return self.copies.has_completed(self._pending.get(index))

    def event(self, index: int) -> Event | None:
        """The event of slice ``index``'s pending update (``None``: none pending), for work that
        waits for it off this thread (a cast ahead of the slice's load)."""
        return self._pending.get(index)

    def wait(self, index: int) -> Event | None:
        """Block until slice ``index``'s host copy is final: before a load reads it. Returns the
        event of the update it waited for (``None``: none was pending)."""
        event = self._pending.pop(index, None)
        self._no_shadow.discard(index)
        try:
            # A load must not read a host copy the update is still writing.
            self.copies.wait_host(event)
        except BaseException:
            self.storages[index].expire_shadow()
            self._failed()
            raise
        return event

    def finish_all(self) -> None:
        """Block until every pending update is done, leaving them pending: each slice keeps the
        shadow its update wrote (a forward casts it again only for a slice with none pending).
        For callers that only need the updates to have read what they read (the gradients)."""
        try:
            for index in sorted(self._pending):
                self.copies.wait_host(self._pending[index])
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
        for index in sorted(self._pending):
            self.wait(index)
        if shadows_stale:
            for storage in self.storages:
                storage.expire_shadow()

    def adopt(self, storages: Sequence[SliceStorage]) -> None:
        """Serve re-laid-out storages; nothing may be pending."""
        assert not self._pending, "internal error: storages rebuilt while updates are pending"
        self.storages = storages
