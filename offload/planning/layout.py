"""``SliceLayout``: a model cut into slices as :class:`~offload.OffloadModel` cuts it, in bytes per
slice, and what those bytes take on the host where weights are tied across slices: each slice's
landing buffer, the ``.grad`` that keep it, and with the masters on disk the RAM outside the
gradient files (Note: [A tied weight's gradients summed in place] in ``offload/autograd/gradients.py``).

It counts; it cuts nothing: :func:`~offload.planning.planner.slice_layout` builds one from a model,
and the memory estimate (``planner.py``) and the step time's (``timing.py``) read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SliceLayout:
    """A model cut into slices as :class:`~offload.OffloadModel` cuts it, in bytes per slice.

    Attributes:
        ranges: each slice's layers.
        host_bytes: each slice's host copy (masters and buffers, laid out as ``SliceStorage`` does).
        device_bytes: its device copy (floating-point parameters in ``compute_dtype``, but batch
            and instance norms', which keep their own): a slot, a load, a shadow.
        gradient_bytes: its trainable parameters' gradients, in their own dtype, aligned as the
            pool lays them out: what a backward offloads and the host adds.
        state_bytes: its optimizer state.
        tensor_bytes: its parameters and buffers in their own dtype, each on its own (as a
            resident slice holds them on the device).
        trainable_bytes: its trainable parameters' gradients, each on its own (as a resident
            slice's stay on the device).
        trainable_counts: elements of its parameters that require grad.
        parameters: elements of all parameters; trainable: of those that require grad.
        computed_gradient_bytes: its trainable parameters' gradients as autograd produces them
            on the device (in the compute dtype, under one): what leaves for the host where the
            host adds them into ``.grad`` itself (Note: [Gradients in the compute dtype]).
        state_file_bytes: its optimizer state as the disk tier lays out a slice's file (each
            tensor at 64 bytes, the file in whole pages).
        largest_gradient_bytes: its largest trainable parameter's gradient, in its own dtype: one
            thread reads it for its norm when the gradients are clipped (Note: [Norms on several
            threads] in ``offload/clipping.py``).
        load_bytes: what a load copies from its own host copy or shadow (``device_bytes`` less the
            parameters it borrows from an earlier slice, a weight tied across slices): its shadow.
        borrowed_gradients: per slice, for each trainable weight it borrows from an earlier
            slice, that slice's index and the gradient's bytes (aligned as the pool lays them
            out): the borrowing slice computes that gradient and sends it to the host too.
        borrowed_weights: per slice, beside each of its ``borrowed_gradients``, the number of the
            weight it borrows (the same in every slice that borrows it; a holder may lend several):
            each weight is summed in its own last borrowing slice's buffer.
        snapshot_bytes: per slice, its buffers' bytes laid out as a slot's buffer region, where one
            of its normalisation layers updates running statistics in training (0 elsewhere, and
            for a slice without buffers): each checkpointed run of the slice keeps a copy of the
            whole region in a pooled host buffer until backward, the buffers as the run found them
            for its recompute (rule 3 of Note: [Buffers] in ``offload/walk/slice_walk.py``).
        scalar_state_bytes: per slice, the optimizer state of its trainable 0-d parameters, which
            the disk tier keeps in RAM (``goes_to_disk`` in ``offload/tiers/state_slice.py``):
            ``state_file_bytes`` leaves it out.
        casts: whether a load casts: some tensor of its own computes in another dtype than it is
            kept in. Only such a slice has a shadow, or a file for its masters on disk
            (``SliceStorage``); one of buffers alone, or already in the compute dtype, keeps its
            host copy in RAM and loads from it.
        cast_gradient_bytes, cast_trainable_bytes: as ``gradient_bytes`` and ``trainable_bytes``, of
            the trainable parameters a load casts (none already in the compute dtype, nor a batch or
            instance norm's): those with a shadow, which the host update writes (``timing.py``).
        layer_gradient_bytes: per layer of the model, its trainable parameters' gradients as
            autograd produces them (a tied weight's in its first layer).
        lent_gradient_bytes: per slice, as ``gradient_bytes``, of the trainable weights it holds
            that a later slice borrows (a weight tied across slices).
        sparse_gradient_bytes: per slice, as ``gradient_bytes``, of those whose gradient comes
            sparse: no buffer has room for them (their ``.grad``, indices and values, is not counted).
    """

    ranges: list[range]
    host_bytes: list[int]
    device_bytes: list[int]
    gradient_bytes: list[int]
    state_bytes: list[int]
    tensor_bytes: list[int]
    trainable_bytes: list[int]
    trainable_counts: list[int]
    parameters: int
    trainable: int
    computed_gradient_bytes: list[int] = field(default_factory=list)
    state_file_bytes: list[int] = field(default_factory=list)
    largest_gradient_bytes: list[int] = field(default_factory=list)
    load_bytes: list[int] = field(default_factory=list)
    casts: list[bool] = field(default_factory=list)
    borrowed_gradients: list[list[tuple[int, int]]] = field(default_factory=list)
    cast_gradient_bytes: list[int] = field(default_factory=list)
    cast_trainable_bytes: list[int] = field(default_factory=list)
    layer_gradient_bytes: list[int] = field(default_factory=list)
    lent_gradient_bytes: list[int] = field(default_factory=list)
    sparse_gradient_bytes: list[int] = field(default_factory=list)
    borrowed_weights: list[list[int]] = field(default_factory=list)
    snapshot_bytes: list[int] = field(default_factory=list)
    scalar_state_bytes: list[int] = field(default_factory=list)

    @property
    def num_slices(self) -> int:
        return len(self.ranges)

    @property
    def _dense_gradient_bytes(self) -> list[int]:
        return [g - s for g, s in zip(self.gradient_bytes, self.sparse_gradient_bytes or [0] * self.num_slices)]

    @property
    def _borrowed(self) -> list[list[tuple[int, int]]]:
        # A layout made without them (by hand, in tests) borrows nothing.
        return self.borrowed_gradients or [[] for _ in self.ranges]

    def landing_bytes(self, resident: int = 0) -> list[int]:
        """Per streamed slice (after the first ``resident``), the bytes of the host buffer its
        gradients land in: its own, and a place for each trainable weight it borrows (a resident
        holder's gradient stays on the device, and its place in the buffer goes unused; a slice
        with nothing else to send takes no buffer)."""
        borrowed = self._borrowed
        return [g + sum(b for _, b in tied) if g or any(holder >= resident for holder, _ in tied) else 0
                for g, tied in zip(self._dense_gradient_bytes[resident:], borrowed[resident:])]

    def host_gradient_bytes(self, resident: int = 0) -> list[int]:
        """Per streamed slice, the host bytes its parameters' ``.grad`` keep: the gradients are
        views of the buffer they landed in, which a borrowing slice's own ``.grad`` keep whole, its
        borrowed weight's place included. That weight's ``.grad`` is the holder's, or, with the
        masters on disk, in its last borrowing slice's buffer (:meth:`tied_gradients_off_file`)."""
        return [landing if own else 0
                for own, landing in zip(self._dense_gradient_bytes[resident:], self.landing_bytes(resident))]

    def tied_gradients_off_file(self, resident: int = 0, sized: Callable[[int], int] | None = None) -> int:
        """With the masters on disk: the RAM that ``.grad`` keep outside the gradient files where
        weights are tied across streamed slices. A borrowing slice's file has no place for what it
        borrows, so its gradients land in RAM and its own ``.grad`` keep that buffer whole; a
        weight whose holder's gradients are in its file is summed in its last borrowing slice's
        buffer (each weight in its own: a holder may lend several to different slices), which that
        ``.grad`` keeps whole (Note: [A tied weight's gradients summed in place]). A holder without
        a file, or one that borrows from a streamed slice itself (a chain of ties: its gradients
        land in RAM), keeps the sum in its own buffer, counted with the others already. ``sized``:
        the bytes the pool allocates for a buffer of so many (pinned: its size class; default:
        exactly)."""
        sized = sized or exact_size
        borrowed = self._borrowed
        # A layout without the weights' numbers (made by hand) lends one weight per holder.
        weights = self.borrowed_weights or [[holder for holder, _ in tied] for tied in borrowed]
        borrowing = {k for k, tied in enumerate(borrowed) if any(holder >= resident for holder, _ in tied)}
        last: dict[int, int] = {}  # weight -> its last borrowing slice, where its sum is
        for k, (tied, numbers) in enumerate(zip(borrowed, weights)):
            for (holder, _), weight in zip(tied, numbers):
                if holder >= resident and self.casts[holder] and holder not in borrowing:
                    last[weight] = k
        sums = set(last.values())
        landing = self.landing_bytes(resident)
        own = self.host_gradient_bytes(resident)
        total = 0
        for k in range(resident, self.num_slices):
            if k in sums:
                total += sized(landing[k - resident]) - (0 if self.casts[k] else sized(own[k - resident]))
            elif self.casts[k] and k in borrowing:
                total += sized(own[k - resident])
        return total

    def tied_on_host(self, resident: int = 0, gradients_on_disk: bool = False) -> list[bool]:
        """Per streamed slice, whether its gradients include a trainable weight tied across
        streamed slices (it holds one a later slice borrows, or borrows one): its landing buffer
        is held until backward ends (Note: [A tied weight's gradients summed in place]). With the
        gradients on disk, a holder whose gradients are all lent (an embedding alone) keeps no
        buffer: its part stays in its gradient file, and the sum in the last borrower's buffer
        (:meth:`tied_gradients_off_file`)."""
        borrowed = self._borrowed
        lent = self.lent_gradient_bytes or [0] * self.num_slices
        # A file takes a backward's gradients only where nothing else refers to it or each lands
        # in its own .grad there (Note: [Gradients on disk]); the tied part has no .grad there, so
        # a holder whose other gradients' .grad are views of its file lands after the first step
        # as without one: in a buffer of its own size, held until the sum.
        holders = {holder for tied in borrowed for holder, _ in tied
                   if holder >= resident and not (gradients_on_disk and self.casts[holder]
                                                  and self.gradient_bytes[holder] == lent[holder])}
        return [k in holders or any(holder >= resident for holder, _ in tied)
                for k, tied in enumerate(borrowed) if k >= resident]


def exact_size(nbytes: int) -> int:
    """The bytes an unpinned pool allocates for a buffer of ``nbytes``: exactly those."""
    return nbytes
