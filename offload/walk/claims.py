"""Who holds an engine: the claim a forward, backward, refresh or move of a model takes on its
engine for the calling thread (Note: [One walk at a time] in ``offload/walk/slice_walk.py``).

What it does not hold: the engine (``engine.py``), of which it reads and sets only ``walking``,
``claimed_at`` and ``walk_running``, nor the walk (``slice_walk.py``), which refuses a claim that
comes inside it.
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import Any

#: What a move of the model (``nn.Module._apply``) is called in a claim's messages.
MOVE = "a move (.to(), .cuda(), .cpu(), .double(), ...)"


class WalkClaim:
    """The calling thread's claim on ``engine`` for one forward, backward, refresh or move, as a
    context around all it does with the engine (Note: [One walk at a time] in ``slice_walk.py``).

    The claim that takes the engine records the frame that holds it: the frame running its
    ``with`` statement (:meth:`take` is given it where another function enters the claim). A claim
    that finds the engine held by a frame no longer on its thread's stack, or by a thread that
    ended, takes it over (rule 5): an interrupt left it, and nothing would give it up.

    Args:
        engine: the model's slices and their machinery.
        what: what the call is, for the message ("a forward").
        walk: the ``SliceWalk`` the claim is for, if any: no claim may come inside it (rule 4).

    Raises:
        RuntimeError: on entering, while another thread holds a claim on ``engine`` or this one walks it.
    """

    #: Held while a claim reads and sets an engine's ``walking``: a few instructions, every engine's
    #: (and a look at the holder's stack where the engine is held).
    _claiming = threading.Lock()

    def __init__(self, engine: Any, what: str, walk: Any = None) -> None:
        self.engine, self.what = engine, what
        # Weakly: the walk holds its claim, and a cycle would keep the walk (and what it holds) for
        # the garbage collector instead of freeing it as its walk ends.
        self._walk = weakref.ref(walk) if walk is not None else None
        self._took = False  # rule 4: a claim inside the thread's own gives nothing up
        self._opened = False  # ... but a walk's ends the walk it marked running

    @property
    def walk(self) -> Any:
        """The ``SliceWalk`` the claim is for, if any (alive while it runs)."""
        return self._walk() if self._walk is not None else None

    def __enter__(self) -> None:
        self.take(sys._getframe(1))

    def take(self, frame: FrameType) -> None:
        """Claim the engine for the calling thread, held by ``frame`` until :meth:`__exit__`: a
        frame that stays on the thread's stack until then and calls ``__exit__`` (itself, or
        through a function it calls)."""
        me = threading.current_thread()
        engine = self.engine
        with WalkClaim._claiming:
            holder = engine.walking
            if holder is None or _left_behind(holder, engine.claimed_at):
                # One statement: no interrupt between the claim and its record.
                engine.walking, engine.claimed_at, engine.walk_running, self._took = me, frame, self.walk, True
                return
        if holder is not me:
            raise RuntimeError(
                f"OffloadModel: {self.what} from another thread (thread {me.name!r}) while thread {holder.name!r} "
                "runs a walk of this model (a forward or backward, which holds its device slots and the records of "
                "its step). This call was refused before it touched anything, and that walk goes on. Use the model "
                "from one thread at a time, or a copy (copy.deepcopy) per thread (docs/api.md; Note: [One walk at a "
                "time] in offload/walk/slice_walk.py)")
        if engine.walk_running is not None:  # rule 4: refused, unless an interrupt left it behind
            engine.walk_running.refuse_inside(self.what)
        if self.walk is not None:
            engine.walk_running, self._opened = self.walk, True

    def __exit__(self, *exc_info: object) -> None:
        if self._took:
            with WalkClaim._claiming:  # a claim reading the record sees all of it or none
                self.engine.walking, self.engine.claimed_at, self.engine.walk_running = None, None, None
        elif self._opened:
            self.engine.walk_running = None


def _left_behind(holder: threading.Thread, frame: FrameType | None) -> bool:
    """Whether the claim ``holder`` took in ``frame`` is one an interrupt left behind (rule 5 of
    Note: [One walk at a time]): ``frame`` is not on ``holder``'s stack, or ``holder`` ended.

    From the claim to its record's clearing, ``frame`` is on the holder's stack (its ``with``
    statement's ``__exit__`` runs from it, between any two instructions too), so a claim in use is
    never taken over. The holder may run on while its stack is read from the top down: a frame it
    returns from keeps its link to the frame below, and it cannot clear the record meanwhile (that
    takes the lock the caller holds), so ``frame`` is found where it was at the first look.
    """
    if holder is threading.current_thread():
        top: FrameType | None = sys._getframe(1)
    else:
        top = sys._current_frames().get(holder.ident)  # type: ignore[arg-type]  # None: it ended
    while top is not None and top is not frame:
        top = top.f_back
    return top is None
