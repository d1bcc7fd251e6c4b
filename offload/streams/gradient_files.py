"""A slice's parameter gradients in a file on a local disk: their home between backward and the
slice's update, when the model's masters are on disk (``OffloadModel(..., masters=DiskTier(path))``).

What this file holds: :class:`GradientHome` (where each gradient of one slice lies in its file,
and whether the file can take the next backward's gradients). What it does not: the mapping and
its page calls (``mapped.py``), when pages are written back and read in (``offload/tiers/master_files.py``),
or the landing of gradients (``gradients.py``).

Note: [Gradients on disk]
    With the masters on disk, RAM held the model's float32 gradients from backward to the next
    ``zero_grad()``: 4 bytes per parameter, the largest category left in RAM. Their home is now a
    file per slice, mapped as the masters are (Note: [Mapped masters] in ``mapped.py``), and
    ``.grad`` is a view of that mapping, so ``p.grad``, ``clip_grad_norm_``, ``GradScaler``'s
    checks and accumulation over backwards see ordinary tensors with the same values:

    1. landing: a slice's gradients land in the pooled window of host buffers, as they do in
       RAM, and are then copied (or, onto the zeros of ``zero_grad(set_to_none=False)`` or
       onto an earlier backward's gradients, added: Note: [Gradients added in place]) into the
       home; autograd adopts the home's views as ``.grad``;
    2. the masters' writer writes the home's pages back and drops them; a slice's landing first
       waits for the write of the slice that landed :data:`~offload.tiers.disk_tier.WINDOW`
       slices before, so RAM holds a few slices' gradients, not the model's;
    3. the slice's update reads the home in with its masters and drops it when it is done (it
       only reads it); the masters' write after it writes both back and drops them.

    Before the gradients are copied into an idle home, its file is discarded
    (``fallocate(FALLOC_FL_ZERO_RANGE)``): the copy then faults in zero pages instead of reading
    the previous step's gradients from the disk. ``zero_grad(set_to_none=False)`` of the model or
    of an ``OffloadOptimizer`` zeroes a home the same way, without touching its pages
    (:func:`zeroed_in_files`).

    A home takes a backward's gradients only when that cannot change a tensor someone holds:
    when nothing refers to its memory (``.grad`` set to ``None``, no view kept), or when every
    gradient that lands in it is added into its own ``.grad`` there. Otherwise (a ``.grad``
    replaced by hand, a view kept across ``zero_grad()``, a sparse gradient) the slice's
    gradients go to pooled RAM as without a home, with the same values; so do they under data
    parallelism that averages them on the host (it reads the landed buffers, after their copy's
    event, on its own worker). A weight tied across slices lands its holder's part in the home,
    and its ``.grad``, the sum of every slice's part, is gathered in a borrowing slice's pooled
    buffer (Note: [A tied weight's gradients summed in place] in ``offload/autograd/gradients.py``).

    A conversion of the model (``model.double()``, ``model.half().float()``) converts each
    ``.grad`` as ``nn.Module._apply`` does, into a new tensor in RAM, and lays the slice out anew
    with a new home. Left so, that ``.grad`` would read as one of the user's own, and every later
    backward would add into it in RAM. :func:`back_in_files` copies the converted values into the
    new home and makes its view the ``.grad``'s memory again (the same tensor object, as
    ``_apply`` keeps it), then has the home written back and dropped as after a landing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Protocol

import torch

from .gradient_places import GradientPlace, lay_out_gradients
from .host_buffers import _storage_use_count
from .mapped import MappedFile
from .slice_entries import Entry


class GradientPaging(Protocol):
    """What moves a home's pages: the masters' reader and writer (``tiers/master_files.py``)."""

    def before_landing(self, home: GradientHome) -> None:
        """Block until RAM has room for another slice's gradients."""

    def landed(self, home: GradientHome) -> None:
        """The home holds a backward's gradients: write them back and drop them."""

    def refuse_in_fork_child(self, doing: str) -> None:
        """Raise in a child of ``os.fork()``, which shares the files with its parent."""


class GradientHome:
    """One slice's gradients in a file mapping, each at a fixed place (Note: [Gradients on disk]).

    Args:
        index: the slice's index.
        file: the mapping, at least as large as the places need.
        places: per parameter of the slice (indexed as its ``params``), its gradient's place, or
            ``None`` for a parameter that has no home (frozen when the model was built, or borrowed).
        paging: what writes the home back after a landing.
    """

    def __init__(self, index: int, file: MappedFile, places: Sequence[GradientPlace | None], paging: GradientPaging) -> None:
        self.index = index
        self.file = file
        self.places = list(places)
        self.paging = paging
        self._idle_use_count = _storage_use_count(file.tensor)

    @classmethod
    def for_entries(cls, index: int, entries: Sequence[Entry], allocate: Callable[[int], MappedFile], paging: GradientPaging
                    ) -> GradientHome | None:
        """A home for the gradients of ``entries`` (a slice's parameters) that require one now:
        own floating-point parameters with ``requires_grad``; ``None`` when none does.
        ``allocate(nbytes)`` makes the file (and raises when the disk has no room)."""
        wanted = [not e.borrowed and e.dtype.is_floating_point and e.tensor.requires_grad for e in entries]
        places, nbytes = lay_out_gradients(entries, wanted)
        if nbytes == 0:
            return None
        return cls(index, allocate(nbytes), places, paging)

    def is_idle(self) -> bool:
        """Whether nothing outside this home refers to its memory (no ``.grad``, no kept view)."""
        return self.referred_to_by(0)

    def referred_to_by(self, tensors: int) -> bool:
        """Whether exactly ``tensors`` tensors outside this home refer to its memory (``False``
        where references cannot be counted)."""
        count = _storage_use_count(self.file.tensor)
        return count is not None and self._idle_use_count is not None and count == self._idle_use_count + tensors

    def view(self, j: int) -> torch.Tensor:
        """Parameter ``j``'s gradient in the home."""
        place = self.places[j]
        assert place is not None
        return place.view(self.file.tensor)

    def holds(self, j: int, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` is parameter ``j``'s gradient in this home."""
        place = self.places[j]
        return (place is not None and grad is not None and grad.layout == torch.strided
                and grad.data_ptr() == self.file.address + place.offset and grad.dtype == place.dtype
                and grad.shape == place.shape)

    def covers(self, places: Sequence[GradientPlace | None], received: Sequence[bool]) -> bool:
        """Whether every gradient a backward produced (``received``, laid out as ``places``) has a
        place here of the same dtype and shape."""
        for mine, theirs, got in zip(self.places, places, received):
            if theirs is None or not got:
                continue
            if mine is None or mine.dtype != theirs.dtype or mine.shape != theirs.shape or mine.stride != theirs.stride:
                return False
        return True

    def zero(self) -> None:
        """Make every gradient here zero without holding its pages (the file discarded), or, where
        the filesystem cannot discard, zero it in RAM and write it back."""
        self.paging.refuse_in_fork_child("zero_grad(set_to_none=False), which zeroes the gradients in their file,")
        if not self.file.discard():
            self.file.tensor.zero_()
            self.file.write_back()


@contextlib.contextmanager
def zeroed_in_files(storages: Iterable[object], params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Around a ``zero_grad(set_to_none=False)`` of ``params``: the gradients that fill a home by
    themselves (nothing else refers to its memory) are zeroed by discarding its file instead of
    writing zeros into its pages, which would bring them all into RAM (Note: [Gradients on disk]);
    they are hidden from the body (``.grad`` set to ``None`` while it runs) and put back after."""
    wanted = {id(p) for p in params}
    hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
    for storage in storages:
        home: GradientHome | None = storage.gradient_home  # type: ignore[attr-defined]
        if home is None:
            continue
        grads = [(e.tensor, e.tensor.grad) for j, e in enumerate(storage.params)  # type: ignore[attr-defined]
                 if home.holds(j, e.tensor.grad)]
        if not grads or any(id(p) not in wanted for p, _ in grads) or not home.referred_to_by(len(grads)):
            continue  # something else refers to it (or a gradient not zeroed here): zero in place
        home.zero()
        for p, grad in grads:
            p.grad = None
            hidden.append((p, grad))
    try:
        yield
    finally:
        for p, grad in hidden:
            p.grad = grad


def gradients_in_files(storages: Iterable[object]) -> set[int]:
    """The ids of the parameters of ``storages`` whose ``.grad`` is their gradient in their
    slice's home: taken before a conversion, for :func:`back_in_files` after it."""
    at_home: set[int] = set()
    for storage in storages:
        home: GradientHome | None = storage.gradient_home  # type: ignore[attr-defined]
        if home is not None:
            at_home.update(id(e.tensor) for j, e in enumerate(storage.params)  # type: ignore[attr-defined]
                           if home.holds(j, e.tensor.grad))
    return at_home


def back_in_files(storages: Iterable[object], at_home: Collection[int]) -> None:
    """Put the ``.grad`` of the parameters ``at_home`` (from :func:`gradients_in_files`), which a
    conversion moved into RAM, back into their slices' homes, with the same values (Note:
    [Gradients on disk]). A home something refers to already, or a gradient whose dtype, shape or
    strides are not its place's, is left as it is: its gradients stay in RAM, as before."""
    for storage in storages:
        home: GradientHome | None = storage.gradient_home  # type: ignore[attr-defined]
        if home is None or not home.is_idle():
            continue
        moving = [(home.view(j), e.tensor.grad) for j, e in enumerate(storage.params)  # type: ignore[attr-defined]
                  if id(e.tensor) in at_home and _fits(home, j, e.tensor.grad)]
        if not moving:
            continue
        home.paging.before_landing(home)  # RAM holds a few slices' gradients at a time, as in backward
        with torch.no_grad():
            for view, grad in moving:
                view.copy_(grad)
                grad.data = view  # the same .grad tensor: a reference kept to it still is p.grad
        home.paging.landed(home)


def _fits(home: GradientHome, j: int, grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` can become parameter ``j``'s gradient in ``home`` as it is (dtype, shape
    and strides), and is not there already."""
    if home.places[j] is None or grad is None or grad.layout != torch.strided or grad.device != home.file.tensor.device:
        return False
    view = home.view(j)
    return (not home.holds(j, grad) and grad.dtype == view.dtype and grad.shape == view.shape
            and grad.stride() == view.stride())
