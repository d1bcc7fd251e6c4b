"""The host gradient pool's landing window, in bytes: how many buffers of each size the streamed
slices' gradients take at once as backward runs, for :func:`~offload.planning.planner.estimate_memory`
(Note: [Gradients added in place] in ``offload/autograd/accumulation.py``, Note: [A tied weight's
gradients summed in place] in ``offload/autograd/gradients.py``)."""

from __future__ import annotations

from collections.abc import Sequence


def landing_pool(landing: Sequence[int], tied: Sequence[bool]) -> int:
    """The pooled bytes the streamed slices' gradients land in, as backward takes them (the last
    slice first) onto ``.grad`` they are added into: a buffer of the largest slice's size each, in
    use while it lands and while it is added, the next slice landing meanwhile; a slice with a
    weight tied across slices lands in a buffer of its own size, held until backward ends (Note:
    [A tied weight's gradients summed in place]). Buffers of one size serve each other in turn."""
    largest = max(landing, default=0)
    held: dict[int, int] = {}  # tied slices' buffers landed so far, by size
    most: dict[int, int] = {}
    adding = 0  # the previous slice's buffer, still being added
    for nbytes, is_tied in zip(reversed(landing), reversed(tied)):
        if not nbytes:
            continue  # nothing lands: the buffer before is added when the next slice's gradients leave
        if is_tied:
            held[nbytes] = held.get(nbytes, 0) + 1
            in_use = {size: count + (adding if size == largest else 0) for size, count in held.items()}
            adding = 0
        else:
            in_use = {**held, largest: held.get(largest, 0) + adding + 1}
            adding = 1
        for size, count in in_use.items():
            most[size] = max(most.get(size, 0), count)
    return sum(size * count for size, count in most.items())
