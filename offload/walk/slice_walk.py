"""One walk of the slices through the device slots: the schedule every forward and backward shares.

A :class:`SliceWalk` decides when each slice is on the device and what happens to its slot when
the walk moves on; what runs on a slice (a graph kept, a checkpoint, a recompute, a forward
without autograd) is its caller's. The training forward and backward
(``offload/autograd/function.py``) and the forward without autograd (``offload/walk/streamed.py``) all
walk through it, so a new walk policy has one place to go.

Note: [The walk]
    A walk visits slices in one order: a forward from the first slice to the last, a backward
    from the last down to the lowest slice whose gradients it needs. For each slice:

    1. Acquire: the slice on the device, ready for compute (loaded, unless a slot still holds it
       current).
    2. The caller runs it on every microbatch. Once its first compute is queued, the next slice
       in the order is prefetched, so that the CPU work of that load (waiting for a pending host
       update, refreshing a shadow) overlaps compute already queued. A forward prefetches it
       already on acquiring the slice when that load is only a copy to issue (a slot free, its
       update done, its shadow current: ``DeviceSlots.can_load_now``): the copy then starts as
       soon as the free slot's last compute is done, not once the CPU has launched this slice's
       kernels. Backward does not: its boundary activations' loads, which this slice's compute
       needs, would queue behind it on the load stream. Each time the walk issues a slice's load,
       it starts the host work of the next slice's load: with the shadows on disk, the cast of
       that slice's masters, on a host worker (Note: [Shadows on disk] in
       ``offload/streams/shadow_staging.py``), which then overlaps the compute of the slice just
       loaded. Once that cast is done, a forward's load of it is only a copy to issue too.
    3. Leave: buffers a run changed are written back (Note: [Buffers]); a slot whose buffers were
       restored from a forward's snapshot is marked stale; the slot is released to the compute
       queued so far.

    A forward starts from fresh device copies (Note: [Device copies expire at the next forward]
    in ``offload/streams/device_slots.py``). After the last slice the walk lets a cast ahead that
    no load took run out (none is left in a walk that visits its order), then waits for its buffer
    write-backs (host state the caller may read as soon as the walk returns) and for every load
    to have read its host copy (the host copies may be overwritten right after it: an optimizer
    step on earlier gradients, ``load_state_dict``): rule 4 of [Copy ordering]. If anything
    raises, a forward first writes back the buffers of the slice that failed, so the host holds
    what the plain model's layers leave behind after the same failure (the layers before the
    failing one updated, the rest not; earlier slices were written back already, later ones never
    ran), but after a buffer moved in forward (rule 5 of [Buffers]); then every copy in flight is
    drained and the slots forget what they hold (rule 5). A backward ends the host pool's step,
    whether it succeeded or not.

Note: [Buffers]
    Buffers are the only device data a forward may change (running statistics, counters).

    1. A run counts as changing them if it wrote to a slot tensor in place (a version counter
       moved), reassigned a buffer, holds a normalisation layer that tracks running statistics
       in training mode (its kernel updates them without bumping any version counter), or runs
       in a mode in which a probe found the slice changing them unseen: ``Slice.run_on_device``
       in ``offload/walk/engine.py``.

       Counters miss more than those layers: a write through ``.data`` (an alias with a counter
       of its own: EMA statistics, VQ-VAE codebooks) and ``F.batch_norm(training=True)`` on a
       layer's own buffers. So the first run of a slice that holds buffers in each *mode* (grad
       mode and the ``training`` flags of the modules that hold a buffer or hold one that does:
       ``.train()``/``.eval()``, or one layer switched alone, makes another; ``BufferModes`` in
       ``engine.py``) is a probe: the buffers' bytes are copied on the device before it
       and, for each buffer whose counter did not move, compared after it, bit for bit (a NaN
       kept is no change, a sign of zero flipped is one). A difference makes that run count as
       changed, so rules 2 and 3 hold as for any change, from the first forward on; and every
       later run of the slice in that mode, without a probe, so a layer that changes them only
       sometimes is written back every run (buffers are small). A mode in which running
       statistics already count every run is not probed; a recompute runs in its forward's
       mode, probed already. Cost, per slice that holds buffers and mode, once: a device copy
       of its buffer bytes, kept during the run, and one blocking read of the comparison, which
       waits for the run's compute (about 60 microseconds of CPU time besides, on the CPU).
       Every run of a slice with buffers reads the mode: the flags of the modules that hold a
       buffer and those above them only (3 of a decoder layer's 13 with a rotary table), about
       2 microseconds of CPU time on a busy 2-core host. Not seen: a layer that writes a buffer
       unseen after the first run of a mode (after a warm-up, every k-th step) changes the
       device copy only.
    2. After a slice's microbatches ran, changed buffers are written back to the host copies;
       unchanged slices send nothing back (the walk, on leaving the slice).
    3. For exact recompute, once any run of a slice changed the buffers, every checkpointed run
       of the slice keeps them as they were before it: up to the first change that is the host
       copy (written back only after the last microbatch, so it is kept at the first change),
       after it the device copy the previous changing run left, offloaded right after that run
       (``offload/autograd/records.py``). A run that changed nothing still keeps them: a later
       microbatch's change must not reach its recompute.
    4. Backward restores them on the device before re-running; the recompute's own updates are
       discarded (the walk marks the slot stale on leaving it), so running statistics are updated
       once per forward, never by backward.
    5. A buffer's device copy keeps the place the layout gave it: its shape, beside the slice's
       other buffers in the slot, and its address. A layer that resizes it in place
       (``buf.resize_(...)``, as torch.ao's per-channel observers and ``FakeQuantize`` do on their
       first call) would grow it over the buffers after it, or move the slot's memory, and the
       write-back would cut it back to its old shape on the host; one pointed at other memory
       (``buf.set_(...)``, ``buf.data = ...``) would not be written back at all. So each run records
       every buffer's shape and address as it starts, and compares them after each layer (that
       layer's buffers: ``BufferPlaces`` in ``offload/walk/binding.py``) and after the last (every
       buffer): a difference raises ``BufferMovedError``, naming the buffer, before the next layer
       reads the buffers it overwrote. The moved tensor is laid out again in the slot, and the
       walk's failure path writes none of the slice's buffers back (their device bytes may be
       overwritten): the host copies are as before the forward. Cost: no tensor operation and
       nothing that waits for the device; three reads of each buffer's shape and address a run,
       about 0.7 microseconds of CPU time per buffer on a busy 2-core host (8 for a slice of four
       BatchNorms, 12 buffers).
       A buffer assigned anew (``self.count = self.count + 1``) is another tensor, which the
       binding lists and ``_check_reassigned`` checks, in ``offload/walk/engine.py``; its value is
       copied in after the run, or after the run failed, for the layers that ran: the failure path
       writes it back with their in-place updates.

Note: [Parameters written in forward]
    A layer may write a parameter in place in forward: ``nn.Embedding(max_norm=...)`` renormalises
    the rows it looks up (PyTorch documents it), a forward pre-hook may clamp a weight. In the
    plain model the parameter keeps the change; here it would reach the device copy only, and from
    the next step on every output and gradient would differ, silently. Writing it back exactly
    would take what buffers have and more: a write-back through a half-precision copy into the
    float32 master, a snapshot per run for the recompute (which in the plain model differentiates
    the changed weight), and the borrowing slices of a tied weight. So it is refused instead:

    1. Each parameter runs as an ``nn.Parameter`` over the slot's memory with a version counter
       of its own (``Slice.entry_tensors``: over ``view.data``), so a buffer's write does not move
       it. A run that moved one raises at once, naming the parameter and what to do
       (``Slice.run_on_device`` in ``offload/walk/engine.py``); the walk's failure path drops the
       device copy, and the host copy never changed. Its cost, per parameter and run: two reads
       of the counter and the ``.data`` alias, about 3 microseconds of CPU time together on a busy
       2-core host (against about 10 for wrapping the view as a parameter at all).
    2. A parametrization's original (``register_parametrization``, as PEFT's LoRA on fused experts
       uses) has its counter moved on every call without a write (``original.set_(original)``): it
       is not checked.
    3. Elsewhere a moved counter is checked against the host copy each time: a call that moved it
       without a change (``nn.Embedding(max_norm=...)`` calls its renormalisation on every
       forward, which may leave every row as it was) is let through, and the next that changes
       the parameter is refused all the same. Remembering a harmless move instead would let a
       later real write of the same size through.
    4. A write through ``.data`` moves no counter and is not seen.

Note: [One walk at a time]
    A walk holds its engine's device slots, copy streams and host pool from its first slice to
    its end, and the forward or backward around it writes per-model state besides (the
    milestones' subscribers, the gradients' sources, the buffers' write-backs). Two walks of one
    engine at once, from two threads (an evaluation thread beside training), would load into
    each other's slots: one fails with an internal error, the other trains on, silently wrong.
    So:

    1. Each forward (with autograd or without) and each backward claims its engine for the
       calling thread before it reads or writes anything of the engine's, and gives the claim up
       when it returns or raises (``WalkClaim`` in ``claims.py``). Every
       :class:`SliceWalk` claims from entering to leaving, which is all a forward without
       autograd does with the engine; ``OffloadFunction``'s forward and backward claim around
       their records and milestones too (the walk's claim inside theirs changes nothing: rule 4).
       ``Engine.refresh``, which every forward runs first, claims as well: while another thread
       walks, the layers hold that walk's device copies, which it would take for parameters the
       user replaced, and it would lay the slices out again under that walk. So does a move
       (``.to()``, ``.cuda()``, ``.cpu()``, ``.double()``: ``OffloadModel._apply``), before it
       waits for pending updates or builds the engine anew. A few claims per call, none per
       slice: each under a microsecond (a lock held for a few instructions, and a look down the
       stack, a few frames deep, at a claim inside the thread's own).
    2. A claim from another thread while one is held raises a ``RuntimeError`` at once, in the
       thread that asked, naming both threads; the walk that holds the claim goes on untouched.
       Refused, not waited for: the model is not safe to share between threads outside its walks
       either (``train()``/``eval()`` flags, ``.grad``, the optimizer's step between backward and
       the next forward), which no lock around the walks could order, so the rule is one thread
       at a time, said as soon as it is broken (``docs/api.md``). A copy per thread
       (``copy.deepcopy``) has an engine of its own.
    3. Autograd may run a backward on a thread of its own (a CUDA device's), not the caller's:
       its claim is that thread's, taken after the forward's was given up (or taken over, where an
       interrupt left the forward's behind: rule 5), so training from one
       thread, in the main thread or another, never meets a claim of its own. Several forwards
       before one backward claim one after the other. A checkpointed slice recomputes inside its
       backward's claim; the host workers that run updates in backward do not walk.
    4. The thread that holds the claim may claim again: a walk inside its forward's or backward's
       claim, or a non-reentrant checkpoint's recompute of the whole model, which runs before the
       backward's walk. That claim changes nothing, and only the outer one gives it up. But no
       claim comes inside a :class:`SliceWalk`: a layer or hook that calls the model inside the
       model's own walk (a forward hook running a "teacher" pass, a backward hook calling
       ``model(x)``) would load into slots the outer walk holds and lay the slices out again over
       the device copies its layers hold (a move would build them anew, or convert the host
       copies under it). Its first claim (the refresh's, a backward's, a move's) raises
       a ``RuntimeError`` at once, before it touches anything: "OffloadModel: the model was called
       inside its own forward walk, from a hook or a layer (...). ... Call the model after the walk
       returns ..., or call a separate copy made beforehand (copy.deepcopy(model) ...)". A hook
       that catches it lets the outer walk go on exactly; one that does not fails the outer
       forward or backward as any error of a layer does. The walk's claim marks it running
       (``Engine.walk_running``, set in the statement that takes the claim) and the frame running
       its ``with`` statement; one check per claim, none per slice. An interrupt as the walk's
       ``__exit__`` starts (where no code can guard) leaves the mark: a later claim finds that
       frame gone from its stack and forgets the mark.
    5. Every claim is recoverable. An interrupt (Ctrl-C, a signal handler's exception) that lands
       as a claim returns from taking the engine, or as it starts to give it up, leaves the
       engine held by a thread that will never give it up; every other thread, a CUDA device's
       autograd thread running the next backward included, would be refused from then on. So
       the claim that takes the engine records the frame that holds it (the frame running its
       ``with`` statement: the refresh's, the Function's ``forward`` or ``backward``, the move's,
       the one running the walk's), set with the thread in one statement. A claim that finds the
       engine held looks for that frame on the holder's stack (its own, or the other thread's,
       ``sys._current_frames()``): not there, or the holder ended, the claim was left behind, and
       the new one takes it over, the walk's mark with it, and gives it up as its own. From
       taking the engine to clearing the record, the holder runs inside that frame (its
       ``__exit__`` included), so a claim in use is never taken over: a claim is refused exactly
       while its holder is still inside it. The look costs nothing while the engine is free
       (the common case), a few frames at a claim inside the thread's own. A claim left behind
       keeps its frame, and what that frame's locals hold, alive until it is taken over
       (``tests/test_claim_interrupts.py`` interrupts every claim at each of its lines).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterator, Sequence
from types import FrameType, TracebackType
from typing import Any

import torch

from .binding import BufferMovedError
from .claims import MOVE, WalkClaim
from .engine import Engine
from ..streams import Event


#: What a claim inside its own thread's walk raises (rule 4 of Note: [One walk at a time]).
NESTED_CALL = (
    "OffloadModel: the model was called inside its own {walk} walk, from a hook or a layer ({what}, while the "
    "{walk} runs the model's slices through its device slots, which the inner call would load into). This call "
    "was refused before it touched anything; where the hook catches this error, the {walk} goes on as if it had not "
    "been made. Call the model after the walk returns (keep what the hook needs, such as a layer's input or output, "
    "and call the model with it then), or call a separate copy made beforehand (copy.deepcopy(model), a teacher or "
    "debugging copy with device slots of its own) (docs/api.md; Note: [One walk at a time] in "
    "offload/walk/slice_walk.py)")
#: What a move of the model (``.to()``) inside its own thread's walk raises (rule 4 of Note: [One walk at a time]).
NESTED_MOVE = (
    "OffloadModel: the model was moved inside its own {walk} walk, from a hook or a layer ({what}, while the {walk} "
    "runs the model's slices through its device slots, which a move would build anew and its host copies, which it "
    "would convert). This call was refused before it changed anything; where the hook catches this error, the {walk} "
    "goes on as if it had not been made. Move or convert the model before the forward or after the walk returns "
    "(docs/api.md; Note: [One walk at a time] in offload/walk/slice_walk.py)")


class Direction(enum.Enum):
    """Which way a walk goes, and what that adds to its start and end."""

    FORWARD = enum.auto()  # first slice to last; fresh device copies; buffers written back
    BACKWARD = enum.auto()  # last slice down to the lowest needed; ends the host pool's step


class WalkState(enum.Enum):
    """Where a walk is (see Note: [The walk])."""

    BETWEEN_SLICES = enum.auto()  # no slice held: before the first, between two, after the last
    ACQUIRED = enum.auto()  # the current slice is on the device; none of its compute is queued yet
    COMPUTING = enum.auto()  # its first compute is queued and the next slice's load issued
    FINISHED = enum.auto()  # the end-of-walk waits are done


class DeviceCopy(enum.Enum):
    """The current slice's device copy compared with its host copy: what leaving the slice does."""

    AS_LOADED = enum.auto()  # the same: the slot may serve the slice again as it is
    BUFFERS_UPDATED = enum.auto()  # a run changed its buffers: written back (rule 2 of Note: [Buffers])
    BUFFERS_RESTORED = enum.auto()  # a forward's snapshot was loaded over them: the slot is stale (rule 4)


def _internal_assert(condition: bool, what: str) -> None:
    if not condition:
        raise RuntimeError(f"internal error in the slice walk: {what}")


class SliceWalk:
    """One pass of the slices through the device slots, in :attr:`order`.

    Use it as a context (its failure path runs when the block raises) and iterate over it for
    each slice, acquired::

        with SliceWalk.forward(engine) as walk:
            for index, views in walk:   # the previous slice is left when the loop comes back
                ...                     # run slice `index` on `views`
                walk.compute_queued()
            walk.finish()

    Args:
        engine: the slices, their slots and copy streams.
        order: the slice indices to visit, in order.
        direction: forward or backward (see :class:`Direction`).
    """

    def __init__(self, engine: Engine, order: Sequence[int], direction: Direction) -> None:
        # - What the walk visits, and with what
        self.engine = engine
        self.order = tuple(order)
        self.direction = direction
        # - The slice held now, and the one to load next
        self.state = WalkState.BETWEEN_SLICES
        self.current: int | None = None
        self.device_copy = DeviceCopy.AS_LOADED
        self._next: int | None = None
        self._position = 0  # the current slice's, in the order
        # - What the end of the walk waits for: buffer write-backs the host reads next
        self._written_back: list[Event | None] = []
        # - Its thread's claim on the engine, from entering to leaving, and the frame running its
        #   ``with`` statement: while it runs, no claim comes inside the walk (Note: [One walk at a time])
        self._claim = WalkClaim(engine, "a forward" if direction is Direction.FORWARD else "a backward", self)
        self._held_by: FrameType | None = None

    @classmethod
    def forward(cls, engine: Engine) -> SliceWalk:
        return cls(engine, range(engine.num_slices), Direction.FORWARD)

    @classmethod
    def backward(cls, engine: Engine, lowest: int) -> SliceWalk:
        """From the last slice down to slice ``lowest`` (none if ``lowest`` is the number of slices)."""
        return cls(engine, range(engine.num_slices - 1, lowest - 1, -1), Direction.BACKWARD)

    # -- the walk's moments ----------------------------------------------------------------------

    def __enter__(self) -> SliceWalk:
        self._held_by = sys._getframe(1)  # before the claim: a claim inside the walk reads it (rule 4)
        try:
            self._claim.take(self._held_by)  # within the caller's claim, where it took one: marks the walk running
            if self.direction is Direction.FORWARD:
                self.engine.slots.forget_contents()
        except BaseException:
            # __exit__ will not run: an interrupt here, in the claim too, must not leave it held
            # or the walk marked running (rules 1 and 4).
            self._claim.__exit__(None, None, None)
            raise
        return self

    def refuse_inside(self, what: str) -> None:
        """Refuse ``what``, a claim of this walk's thread while the walk runs (rule 4 of Note: [One
        walk at a time]), before it touches anything. But where the frame running the walk's ``with``
        statement has returned, an interrupt stopped the walk's ``__exit__`` as it started, leaving
        it marked running inside a claim still held: forgotten then (where the walk's own claim
        took the engine, the caller's claim took that over before asking: rule 5).

        Raises:
            RuntimeError: the walk runs: the model was called from a hook or layer inside it.
        """
        frame = sys._getframe(1)
        while frame is not None and frame is not self._held_by:
            frame = frame.f_back
        if frame is None:
            self.engine.walk_running, self._held_by = None, None
            return
        walk = self.direction.name.lower()
        raise RuntimeError((NESTED_MOVE if what == MOVE else NESTED_CALL).format(walk=walk, what=what))

    def __iter__(self) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Each slice in order, acquired: its index and device views (one per storage entry)."""
        for position, index in enumerate(self.order):
            self._position = position
            self._next = self.order[position + 1] if position + 1 < len(self.order) else None
            views = self.engine.slots.acquire(index)
            self.current, self.state, self.device_copy = index, WalkState.ACQUIRED, DeviceCopy.AS_LOADED
            self._stage_after(position)
            ahead = self._next if self.direction is Direction.FORWARD else None
            if ahead is not None and self.engine.slots.can_load_now(ahead):
                self.engine.slots.prefetch(ahead)  # step 2 of Note: [The walk]: only a copy to issue
                self._stage_after(position + 1)
            yield index, views
            self._leave(index)

    def load_inputs(self, leaves: Sequence[Any]) -> list[Any]:
        """The walk's input leaves with every tensor on the compute device, ready for compute."""
        moved: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device != self.engine.device:
                tensor, ready = self.engine.activations.load_host(leaf)
                self.engine.copies.wait_ready(ready)
                moved.append(tensor)
            else:
                moved.append(leaf)
        return moved

    def compute_queued(self) -> None:
        """The current slice's compute so far is queued; the first call prefetches the next slice."""
        if self.state is WalkState.ACQUIRED:
            self.state = WalkState.COMPUTING
            if self._next is not None:
                self.engine.slots.prefetch(self._next)
                self._stage_after(self._position + 1)

    def _stage_after(self, position: int) -> None:
        """The load of the slice at ``position`` in the order is issued: start the host work of
        the next one's load (step 2 of Note: [The walk])."""
        if position + 1 < len(self.order):
            self.engine.slots.stage_ahead(self.order[position + 1])

    def buffers_changed(self) -> None:
        """A run changed the current slice's buffers: leaving it writes them back."""
        self.device_copy = DeviceCopy.BUFFERS_UPDATED

    def buffers_restored(self) -> None:
        """A forward's buffer snapshot was loaded over the current slice's: leaving it marks the slot stale."""
        self.device_copy = DeviceCopy.BUFFERS_RESTORED

    def _leave(self, index: int) -> None:
        slots = self.engine.slots
        if self.device_copy is DeviceCopy.BUFFERS_UPDATED:
            self._written_back.append(slots.buffers.write_back_buffers(index))
        elif self.device_copy is DeviceCopy.BUFFERS_RESTORED:
            slots.mark_stale(index)
        slots.release(index)
        self.current, self.state = None, WalkState.BETWEEN_SLICES

    def finish(self) -> None:
        """The end-of-walk waits (Note: [The walk]); call after the last slice was left."""
        _internal_assert(self.state is WalkState.BETWEEN_SLICES, f"finished while {self.state.name}")
        # The caller may write the host copies that a cast ahead reads as soon as this returns.
        self.engine.slots.staging.drop_ahead(self.engine.copies)
        # Rule 4 of [Copy ordering]: the host reads the written-back buffers next, and may
        # overwrite the host copies that loads read.
        self.engine.copies.wait_host_all(self._written_back)
        self.engine.slots.buffers.land_write_backs()
        self.engine.copies.wait_loads_done()
        self.state = WalkState.FINISHED

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            if exc_type is not None:
                self._fail(exc)
            else:
                _internal_assert(self.state is WalkState.FINISHED, "left without finish()")
        finally:
            try:
                if self.direction is Direction.BACKWARD:
                    self.engine.pool.end_step()
                else:
                    self.engine.pool.end_forward()
            finally:
                self._held_by = None  # the walk and its frame need not keep each other
                self._claim.__exit__(exc_type, exc, traceback)

    def _fail(self, error: BaseException | None) -> None:
        """The failure path of Note: [The walk]; the exception, ``error``, goes on to the caller."""
        held = self.current if self.state in (WalkState.ACQUIRED, WalkState.COMPUTING) else None
        # Rule 5 of Note: [Buffers]: a moved buffer may have overwritten the others in the slot.
        if (self.direction is Direction.FORWARD and held is not None and self.engine.slices[held].storage.buffers
                and not isinstance(error, BufferMovedError)):
            # Issued only: the drain below (rule 5 of [Copy ordering]) completes it.
            self.engine.slots.buffers.write_back_buffers(held)
        self.engine.slots.invalidate()
        # A cast ahead that no load will take: the caller may write the host copies it reads next.
        self.engine.slots.staging.drop_ahead(self.engine.copies)
