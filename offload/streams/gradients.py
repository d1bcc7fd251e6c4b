"""Parameter gradients: summed on the device over microbatches, then offloaded to the host.

Note: [Gradients in the compute dtype]
    Under a compute dtype, a slice's gradients come out of autograd in that dtype. Where autograd
    adopts the host views as ``.grad`` (``.grad`` was ``None``), they leave the device in their
    parameter's dtype: cast to float32 on the device, where the cast is nearly free, so that
    autograd takes the host views as they are. Handing autograd half-precision host views instead
    makes it cast them on the CPU, into a freshly allocated float32 tensor, at the end of every
    backward (run 3 in ``benchmarks/results/h100-2026-11-22/README.md`` measured that).

    Where the host copies them into their file as they land (Note: [Gradients on disk]), they
    leave as autograd produced them, half the bytes on the device-to-host direction, and the
    host's copy casts them: a half-precision value's float32 cast is exact, and a casting copy
    reads less than a float32 one (16 M elements on this CPU: 6.3 ms against 7.2). Where the host
    adds them into ``.grad`` (Note: [Gradients added in place]) they still leave in float32:
    PyTorch adds a bfloat16 tensor into a float32 one 5x slower than two float32 ones (42 ms
    against 8 for 16 M elements), and a cast first through a scratch buffer still costs 14 ms,
    more host memory traffic than the link saves. Microbatches summed on the device are summed
    in float32 and leave so.

Note: [One copy per slice]
    With one microbatch, a slice's gradients that are cast on the device anyway (float32
    parameters under a compute dtype, Note: [Gradients in the compute dtype]) are cast into one
    new device buffer laid out as the host buffer they land in, and leave in one copy instead of
    one per tensor (147 a step for the 0.886 B Llama at 18 slices). The cast writes the bytes it
    wrote into tensors of their own before, so the device does no more work (but for a gradient
    already in its parameter's dtype in such a slice, copied once more) and holds no more memory
    (the buffer is freed once the copy has read it, rule 3 of Note: [Copy ordering]); the link
    moves the alignment padding between tensors besides (under ALIGNMENT bytes each). Gradients that leave as autograd produced them (copied into a gradient
    file in the compute dtype, or float32 ones with no cast) keep a copy each: gathering them
    would be a device copy of its own, and the gradient file's layout puts half-precision values
    at the float32 offsets. So do gradients averaged across processes on the device, which the
    compute stream must not wait for. ``OFFLOAD_GRADIENT_GATHER=0`` turns the gathering off.

With one microbatch, the gradients autograd produced are offloaded as they are, or gathered (Note:
[One copy per slice]). With several, they are summed into one of two persistent device gradient
buffers and leave for the host in a single copy while the previous slice computes; the two
buffers alternate, and compute writes into one only after its previous offload has read it. The
host side is a pooled buffer whose views are handed to autograd as the parameters' gradients:
autograd adopts them as ``.grad`` when ``.grad`` is empty and adds them otherwise, so the buffer
is reused as soon as nobody holds it. A parameter whose gradient is added into its ``.grad`` on
the host as soon as it lands (Note: [Gradients added in place] in
``offload/autograd/accumulation.py``) needs its pooled buffer only until then.

A sparse gradient (``nn.Embedding(sparse=True)``) stays sparse: microbatches are summed as autograd
sums them (``a + b`` of sparse tensors concatenates their entries), and its indices and values
leave for the host in a pooled buffer of their own, so that autograd receives the sparse tensor
it would have received from the plain model. Its parameter takes no room in the slice's buffers
(Note: [Sparse gradients take no room] in ``gradient_places.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .backend import Event
from .copies import CopyStreams
from .flat_views import _align, empty_in_layout, typed_view
from .gradient_places import GradientPlace, SparseParameters, lay_out_gradients
from .host_buffers import HostBuffer, HostBufferPool
from .slice_entries import Entry

if TYPE_CHECKING:
    from .gradient_files import GradientHome

#: Set to 0 to send a slice's gradients one copy per tensor (Note: [One copy per slice]).
GATHER_ENV_VAR = "OFFLOAD_GRADIENT_GATHER"


@dataclass
class SliceGradients:
    """One slice's gradients while its microbatches run backward.

    Attributes:
        places: per parameter of the slice, where its gradient goes, or ``None`` where no
            gradient is needed.
        received: per parameter, whether any microbatch produced a gradient.
        held: the first microbatch's gradients, as autograd produced them (in the compute dtype,
            under one), until a second microbatch needs a device buffer to sum into; cast to the
            parameters' dtypes where they are read as such (:meth:`device_tensors`).
        apart: per parameter, its gradient that travels apart from the slice's buffer, summed over
            microbatches so far (out of place), or ``None``: a sparse one, or a dense one whose
            place takes no room (Note: [Sparse gradients take no room]); such a parameter is not
            :attr:`received` (that is the gradients in the buffer's).
        sums: once summing started, per parameter its view into the device buffer.
        nbytes: bytes of all needed gradients laid out by :attr:`places`.
        reduced: an event the offload waits for: a collective still rewriting the device
            gradients (Note: [Device collectives] in ``collectives.py``), or ``None``.
        into: per parameter, the host ``.grad`` its gradient is added into once it landed
            (Note: [Gradients added in place]), or ``None`` where autograd receives it.
        keep: per parameter, whether its gradient stays on the device: a resident slice's
            parameter's, or one tied to it (Note: [Resident slices] in ``resident_storage.py``);
            ``None``: none does.
        home: the slice's gradients' file, with the masters on disk (Note: [Gradients on
            disk] in ``gradient_files.py``), or ``None``.
    """

    places: list[GradientPlace | None]
    nbytes: int
    offloader: GradientOffloader
    received: list[bool] = field(init=False)
    held: list[torch.Tensor | None] = field(init=False)
    apart: list[torch.Tensor | None] = field(init=False)
    sums: list[torch.Tensor | None] | None = None
    buffer_index: int | None = None
    reduced: Event | None = None
    into: list[torch.Tensor | None] | None = None
    keep: list[bool] | None = None  # per parameter, whether its gradient stays on the device
    home: GradientHome | None = None

    def __post_init__(self) -> None:
        self.received = [False] * len(self.places)
        self.held = [None] * len(self.places)
        self.apart = [None] * len(self.places)

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one microbatch's gradients (aligned with :attr:`places`)."""
        incoming = [(j, g) for j, g in enumerate(grads) if g is not None and self.places[j] is not None]
        apart: set[int] = set()
        for j, g in incoming:
            earlier = self.apart[j]
            mixed = g.is_sparse != (earlier is not None and earlier.is_sparse)
            if mixed and (self.received[j] or earlier is not None):
                raise RuntimeError(
                    f"a parameter received a sparse gradient from one microbatch and a dense one from another "
                    f"(parameter {j} of its slice); OffloadModel sums a parameter's microbatch gradients in one "
                    "layout. Use num_microbatches=1, or the same sparse setting for every use of the parameter.")
            place = self.places[j]
            assert place is not None
            if g.is_sparse or place.sparse:
                apart.add(j)
                g = g.to(place.dtype)
                # Autograd's own sum (AccumulateGrad's `grad += new`): out of place, in the parameter's dtype.
                self.apart[j] = g if earlier is None else earlier + g
        incoming = [(j, g) for j, g in incoming if j not in apart]
        if self.sums is None and not any(self.received):
            for j, g in incoming:
                self.held[j] = g  # cast where it is read in the parameter's dtype (Note: [Gradients in the compute dtype])
                self.received[j] = True
            return
        if self.sums is None:
            self._start_summing()
        assert self.sums is not None
        copy_dst, copy_src, add_dst, add_src = [], [], [], []
        for j, g in incoming:
            (add_dst if self.received[j] else copy_dst).append(self.sums[j])
            (add_src if self.received[j] else copy_src).append(g)
            self.received[j] = True
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        if add_dst:
            torch._foreach_add_(add_dst, add_src)

    def device_tensors(self) -> list[torch.Tensor | None]:
        """Per parameter, its gradient on the device (summed over microbatches), or ``None``."""
        if self.sums is not None:
            dense = [s if got else None for s, got in zip(self.sums, self.received)]
        else:
            dense = self.held_as_placed()
        return [g if g is not None else d for g, d in zip(self.apart, dense)]

    def held_as_placed(self, copied_home: Sequence[bool] = ()) -> list[torch.Tensor | None]:
        """The held gradients in their parameters' dtypes, cast on the device (and kept so), but
        those ``copied_home`` marks, which stay as autograd produced them (Note: [Gradients in
        the compute dtype])."""
        for j, (held, place) in enumerate(zip(self.held, self.places)):
            if (held is not None and place is not None and held.dtype != place.dtype
                    and not (j < len(copied_home) and copied_home[j])):
                self.held[j] = held.to(place.dtype)
        return list(self.held)

    def _start_summing(self) -> None:
        self.buffer_index, flat = self.offloader._claim_buffer(self.nbytes)
        self.sums = [place.view(flat) if place is not None and not place.sparse else None for place in self.places]
        pairs = [(s, h) for s, h in zip(self.sums, self.held) if s is not None and h is not None]
        if pairs:
            torch._foreach_copy_([s for s, _ in pairs], [h for _, h in pairs])
        self.held = [None] * len(self.places)


@dataclass
class PendingGradients:
    """Gradients on their way to the host: valid once ``ready`` has completed.

    Attributes:
        host_views: per parameter, its gradient in a pooled host buffer, or ``None`` (none was
            produced, or it was added into ``.grad`` already).
        into: per parameter, the ``.grad`` it is to be added into (Note: [Gradients added in
            place]), or ``None``.
        added: the ``.grad`` tensors it was added into so far.
        home: the gradients' file they are copied into once landed (``host_views`` are its views
            then), or ``None``: Note: [Gradients on disk].
        landing: with a home, per parameter, the pooled host view its gradient lands in.
        discard: whether the home's file is discarded before the copy (nothing refers to it).
    """

    host_views: list[torch.Tensor | None]
    ready: Event | None
    into: list[torch.Tensor | None] | None = None
    added: list[torch.Tensor] = field(default_factory=list)
    home: GradientHome | None = None
    landing: list[torch.Tensor | None] | None = None
    discard: bool = False

    @property
    def settled(self) -> bool:
        """Whether the gradients are where ``.grad`` will hold them (added, or copied home)."""
        return self.into is None and self.home is None


def _nbytes(grad: torch.Tensor) -> int:
    if grad.is_sparse:
        return _nbytes(grad._indices()) + _nbytes(grad._values())
    return grad.numel() * grad.element_size()


class GradientOffloader:
    """Device summation buffers and the offload of finished slice gradients.

    Args:
        copies: the copy engine.
        pool: where host gradient buffers come from.
    """

    def __init__(self, copies: CopyStreams, pool: HostBufferPool) -> None:
        self.copies = copies
        self.pool = pool
        # Allocated on first use, with one microbatch never; each as large as the most gradient
        # bytes a slice has needed so far, so parameters that require no gradient (a frozen base
        # under adapters) take no room in them.
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._offloaded: list[Event | None] = [None, None]
        self._next = 0
        self.offloaded_bytes = 0
        # The most gradient bytes a slice has needed so far: the size of the host buffers that
        # gradients added into .grad on landing pass through (see offload()).
        self._max_nbytes = 0
        self._expected: Any = None  # the last key expect() sized the buffers for
        self._sparse = SparseParameters()  # which gradients come sparse, per slice
        #: Whether a slice's gradients cast on the device leave in one copy (Note: [One copy per
        #: slice]); ``OFFLOAD_GRADIENT_GATHER=0`` sends them one copy per tensor, for comparison.
        self.gather = os.environ.get(GATHER_ENV_VAR, "1") != "0"

    @property
    def device_nbytes(self) -> int:
        """Bytes of the device summation buffers allocated so far."""
        return sum(buffer.numel() for buffer in self._buffers if buffer is not None)

    def begin(self, entries: Sequence[Entry], needed: Sequence[bool],
              into: Sequence[torch.Tensor | None] | None = None,
              keep: Sequence[bool] | None = None, home: GradientHome | None = None,
              sparse_apart: bool = True) -> SliceGradients:
        """Start collecting one slice's gradients for the parameters in ``needed``; those with a
        tensor in ``into`` are added into it on the host once they landed (see :meth:`accumulate`);
        those ``keep`` marks stay on the device (:meth:`offload` keeps them there); the others go
        to ``home`` where it can take them (Note: [Gradients on disk]). With ``sparse_apart``, a
        parameter whose gradient comes sparse takes no room in the buffers (Note: [Sparse
        gradients take no room]); without, every one is laid out dense."""
        places, offset = lay_out_gradients(entries, needed, self._sparse.of(entries) if sparse_apart else ())
        self._note_size(offset, needed, keep)
        grads = SliceGradients(places, offset, self, keep=list(keep) if keep is not None and any(keep) else None,
                               home=home)
        if into is not None and any(t is not None for t in into):
            grads.into = list(into)
        return grads

    def expect(self, key: Any, slices: Callable[[], Iterable[tuple[Sequence[Entry], Sequence[bool],
                                                                   Sequence[bool] | None]]],
               sparse_apart: bool = True) -> None:
        """Size the host buffers for every slice a backward is about to send (each as ``entries``,
        ``needed`` and ``keep`` that :meth:`begin` takes) before the first of them lands. Buffers
        taken while the largest slice was still unseen would be smaller ones, held beside the
        largest's until the pool ages them out two steps later: more host memory in the first
        steps than in the others, and than the planner counts. ``key`` says which gradients the
        backward needs: the slices are laid out again only when it changes (the size only grows,
        and :meth:`begin` notes each slice's as well, so a key that misses a change costs memory
        in the first steps after it, never correctness). ``sparse_apart`` is :meth:`begin`'s."""
        if (key, sparse_apart) == self._expected:
            return
        self._expected = (key, sparse_apart)
        self._sparse.clear()  # those of slices laid out anew since go
        for entries, needed, keep in slices():
            if any(needed):
                sparse = self._sparse.of(entries) if sparse_apart else ()
                self._note_size(lay_out_gradients(entries, needed, sparse)[1], needed, keep)

    def _note_size(self, nbytes: int, needed: Sequence[bool], keep: Sequence[bool] | None) -> None:
        if keep is None or not all(k for k, want in zip(keep, needed) if want):
            # What passes through the host sizes the host buffers; a resident slice's never does.
            self._max_nbytes = max(self._max_nbytes, nbytes)

    def _claim_buffer(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A device buffer of at least ``nbytes`` for compute to sum into, alternating between the two."""
        index = self._next
        self._next = 1 - index
        # Rule 3 of [Copy ordering]: the previous offload from this buffer must have read it.
        self.copies.wait_ready(self._offloaded[index])
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < nbytes:
            # A smaller one left behind is freed safely: the offload that read it marked it as used.
            buffer = self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8, device=self.copies.device)
        return index, buffer

    def offload(self, grads: SliceGradients, label: str = "offload::offload gradients") -> PendingGradients:
        """Start copying a slice's finished gradients to a host buffer (a resident slice's stay
        on the device: :meth:`_keep`)."""
        kept = self._keep(grads) if grads.keep is not None else {}
        if not any(grads.received) and all(g is None for g in grads.apart):
            return PendingGradients([kept.get(j) for j in range(len(grads.places))], None, grads.into)
        host_views: list[torch.Tensor | None] = [None] * len(grads.places)
        ready: Event | None = None
        # Each copy below runs on the offload stream after the one before: the last one's ready
        # event says that all of them have landed.
        for j, (g, place) in enumerate(zip(grads.apart, grads.places)):
            if g is not None and place is not None:
                host_views[j], ready = self._offload_sparse(g, place, grads.reduced, label)
        grads.apart = [None] * len(grads.places)
        home, discard = _taking_home(grads)
        landing: list[torch.Tensor | None] | None = None
        if any(grads.received):
            host = self._landing_buffer(grads, home)
            # Note: [Gradients in the compute dtype]: what the host copies into a gradient file
            # leaves as autograd produced it; the rest in the parameter's dtype.
            copied_home = [home is not None and got and (grads.into is None or grads.into[j] is None)
                           for j, got in enumerate(grads.received)]
            gathered = grads.sums is None and self._gathers(grads, copied_home)
            held = grads.held_as_placed(copied_home) if grads.sums is None and not gathered else []
            for j, (place, got) in enumerate(zip(grads.places, grads.received)):
                if place is not None and got:
                    dtype = held[j].dtype if held and held[j] is not None else place.dtype
                    host_views[j] = typed_view(host.data, place.offset, dtype, place.shape, place.stride)
            if grads.sums is not None:
                assert grads.buffer_index is not None
                device = self._buffers[grads.buffer_index]
                assert device is not None
                ready = self.copies.offload(host.data[:grads.nbytes], device[:grads.nbytes],
                                            after=(host.read_event, grads.reduced), label=label)
                self._offloaded[grads.buffer_index] = ready
            elif gathered:
                ready = self._offload_gathered(grads, host.data[:grads.nbytes], host.read_event, label)
            else:
                pairs = [(h, g) for h, g in zip(host_views, held) if h is not None and g is not None]
                ready = self.copies.offload_many([h for h, _ in pairs], [g for _, g in pairs],
                                                 after=(host.read_event, grads.reduced), label=label)
                grads.held = [None] * len(grads.places)
            if home is not None:
                landing, host_views = host_views, [
                    home.view(j) if got and (grads.into is None or grads.into[j] is None) else view
                    for j, (view, got) in enumerate(zip(host_views, grads.received))]
        self.offloaded_bytes += sum(_nbytes(v) for v in (landing or host_views) if v is not None)
        for j, view in kept.items():
            host_views[j] = view
        return PendingGradients(host_views, ready, grads.into, home=home if landing is not None else None,
                                landing=landing, discard=discard)

    def _landing_buffer(self, grads: SliceGradients, home: GradientHome | None) -> HostBuffer:
        """The pooled host buffer a slice's dense gradients land in."""
        # Gradients added into .grad, or copied home, on landing need their buffer only briefly:
        # buffers of one size (the largest slice's) serve every slice in turn, so the window
        # stays two buffers.
        transient = home is not None or grads.into is not None and all(
            target is not None for target, place, got in zip(grads.into, grads.places, grads.received)
            if place is not None and got)
        return self.pool.take(self._max_nbytes if transient else grads.nbytes)

    def _gathers(self, grads: SliceGradients, copied_home: Sequence[bool]) -> bool:
        """Whether a slice's held gradients leave in one copy, cast into one device buffer (Note:
        [One copy per slice])."""
        dense = [(held, place) for held, place, home in zip(grads.held, grads.places, copied_home)
                 if held is not None and place is not None and not home]
        return (self.gather and grads.reduced is None and len(dense) > 1
                and len(dense) == sum(h is not None for h in grads.held)
                and any(held.dtype != place.dtype for held, place in dense))

    def _offload_gathered(self, grads: SliceGradients, host: torch.Tensor, host_read: Event | None,
                          label: str) -> Event | None:
        """Cast the slice's held gradients into one new device buffer laid out as ``host`` and
        start its copy there (Note: [One copy per slice]); lets go of the held ones."""
        flat = torch.empty(grads.nbytes, dtype=torch.uint8, device=self.copies.device)
        pairs = [(place.view(flat), held) for held, place in zip(grads.held, grads.places)
                 if held is not None and place is not None]
        with torch.no_grad():
            torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
        grads.held = [None] * len(grads.places)
        # The buffer is freed on return: the copy's mark keeps the allocator from reusing it early.
        return self.copies.offload(host, flat, after=(host_read,), label=label)

    def _keep(self, grads: SliceGradients) -> dict[int, torch.Tensor]:
        """The gradients ``grads.keep`` marks, each in device memory of its own and in its
        parameter's layout, as autograd would leave them, copied on the compute stream (Note:
        [Resident slices]); taken out of ``grads``, so that the offload sends only the others (a
        summed slice still sends its whole buffer in one copy: only a weight tied to a resident
        slice, in a streamed one, travels for nothing then)."""
        assert grads.keep is not None
        kept: dict[int, torch.Tensor] = {}
        dense = grads.device_tensors()
        pairs = [(j, place) for j, (place, g, keep) in enumerate(zip(grads.places, dense, grads.keep))
                 if place is not None and g is not None and not g.is_sparse and keep]
        for j, place in pairs:
            kept[j] = empty_in_layout(place.shape, place.stride, place.dtype, self.copies.device)
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([kept[j] for j, _ in pairs], [dense[j] for j, _ in pairs])
        for j, keep in enumerate(grads.keep):
            if not keep:
                continue
            apart = grads.apart[j]
            if apart is not None and apart.is_sparse:
                kept[j] = apart  # summed out of place: its own memory
            grads.received[j], grads.held[j], grads.apart[j] = False, None, None
        return kept

    def _offload_sparse(self, grad: torch.Tensor, place: GradientPlace, reduced: Event | None, label: str
                        ) -> tuple[torch.Tensor, Event | None]:
        """Start copying a gradient that travels apart from its slice's buffer into a pooled host
        buffer of its own: a sparse one's indices and values, or a dense one of a parameter laid
        out as sparse (Note: [Sparse gradients take no room]), in its parameter's layout; returns
        the host tensor (valid once the event completes)."""
        if not grad.is_sparse:
            host = self.pool.take(_nbytes(grad))
            view = typed_view(host.data, 0, grad.dtype, grad.shape, place.stride)
            return view, self.copies.offload_many([view], [grad], after=(host.read_event, reduced), label=label)
        indices, values = grad._indices(), grad._values()
        values_offset = _align(indices.numel() * indices.element_size())
        host = self.pool.take(values_offset + values.numel() * values.element_size())
        host_indices = typed_view(host.data, 0, indices.dtype, indices.shape)
        host_values = typed_view(host.data, values_offset, values.dtype, values.shape)
        # Built over the memory before the copy writes it (it reads nothing there: no invariant
        # checks), so that nothing touches the host memory before the copy has landed.
        sparse = torch.sparse_coo_tensor(host_indices, host_values, grad.shape, check_invariants=False,
                                         is_coalesced=grad.is_coalesced())
        ready = self.copies.offload_many([sparse._indices(), sparse._values()], [indices, values],
                                         after=(host.read_event, reduced), label=label)
        return sparse, ready

    def accumulate(self, pending: Sequence[PendingGradients], in_flight: int = 1) -> None:
        """Add the landed gradients of all but the last ``in_flight`` slices of ``pending`` into
        the ``.grad`` they go to, and let go of their pooled buffers.

        Called after each slice's offload with ``in_flight=1``, it keeps two slices' host buffers
        in use (the one landing, the one being added) and lets the device run one offload ahead of
        the host's wait.
        """
        for grads in pending[:max(len(pending) - in_flight, 0)]:
            if grads.settled:
                continue
            # Rule 4 of [Copy ordering]: the CPU reads the offload's destination.
            self.copies.wait_host(grads.ready)
            if grads.home is not None:
                grads.home.paging.before_landing(grads.home)
                if grads.discard:
                    grads.home.file.discard()
            landed = grads.landing if grads.landing is not None else grads.host_views
            with torch.no_grad():
                if grads.landing is not None:  # Note: [Gradients on disk]
                    pairs = [(home, new) for home, new, target in zip(
                        grads.host_views, grads.landing, grads.into or [None] * len(landed))
                        if new is not None and target is None and home is not new]  # a sparse one stays
                    if pairs:
                        torch._foreach_copy_([home for home, _ in pairs], [new for _, new in pairs])
                for j, (target, view) in enumerate(zip(grads.into or (), landed)):
                    if target is not None and view is not None:
                        target.add_(view)  # what autograd's accumulation does: .grad += new
                        grads.added.append(target)
                        grads.host_views[j] = None
            if grads.home is not None:
                grads.home.paging.landed(grads.home)
            grads.into = grads.home = grads.landing = None

    def finish(self, pending: Sequence[PendingGradients]) -> None:
        """Block until every pending gradient is on the host, added where it goes: the optimizer
        reads them next."""
        self.accumulate(pending, in_flight=0)
        self.copies.wait_host_all(p.ready for p in pending)


def _taking_home(grads: SliceGradients) -> tuple[GradientHome | None, bool]:
    """The home that takes a slice's dense gradients (Note: [Gradients on disk]), or ``None``;
    and whether its file may be discarded first (nothing refers to it)."""
    home = grads.home
    if home is None or not any(grads.received) or not home.covers(grads.places, grads.received):
        return None, False
    if home.is_idle():
        return home, True
    received = [j for j, (place, got) in enumerate(zip(grads.places, grads.received)) if place is not None and got]
    if grads.into is not None and all(home.holds(j, grads.into[j]) for j in received):
        return home, False  # each adds into its own .grad there
    return None, False
