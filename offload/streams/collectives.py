"""Collective communication across processes, and how it is ordered with copies and host work.

A process group requires every rank to issue the same collectives in the same order. Collectives
on host memory (gloo) are therefore all issued by one host worker per group, in the order the
program submits them: the gradient averages of each backward, slice by slice, then the parameter
broadcasts of a sharded optimizer step. Each waits, in the worker, for the copy or the update that
produced its data (the ``after`` events), and the caller's thread goes on meanwhile, so the
averages overlap the backward of earlier slices. Collectives on device memory (NCCL) are issued by
the caller's thread on a communication stream; see Note: [Device collectives].

Note: [A private group for the worker]
    The worker issues its collectives while the caller's thread goes on, so they must not share a
    process group with anything the caller issues: a ``dist.all_reduce(loss)`` or a
    ``dist.barrier()`` after ``optimizer.step()``, or a second model's worker, would be matched
    with a queued broadcast of another size on another rank (a hang, or gloo's "Received data size
    doesn't match"). :class:`HostCollectives` therefore issues them on a group of its own over the
    same ranks (:func:`private_group`), made at construction, when every rank of the group is there
    and makes it in the same order: a gloo backend on a store prefix named after the user's group
    and a count, so that ranks which also belong to other groups agree on it. The user's group keeps its meaning: it says which ranks average
    together, and the structure check and the broadcast of rank 0's tensors at construction, which
    run in the caller's thread, use it.

A collective that fails (a timeout because another rank died, a broken connection) is raised, at
the next wait, as :class:`CollectiveError`, saying on which rank and what it was doing. So is one
that building a model or an optimizer issues (:func:`waiting_for_the_group`): there, a rank that
failed before it got as far (a bad argument on one rank) leaves the others waiting for the group's
timeout, and the error says what every rank must do and where to look first.

Note: [A failed part of a sharded update]
    In a sharded step each rank updates the parameters it owns and every rank then takes them from
    their owners (``offload/optimizing/sharding.py``). When one rank's update of a slice raises
    (or is skipped after an earlier one raised), that rank's error is its own to raise, but every
    other rank is about to take parameters the update left as they were, or half done. So before
    a slice's exchange the ranks agree, in one small all-reduce, on which of them did not finish
    their part, and each rank is told of the others (the optimizer records the mix of two steps
    and raises it at the next wait: ``PartialFailure.told``). The exchange itself goes on: every
    rank ends with the same parameters, and none waits for a broadcast another rank skipped. The
    worker raises nothing of it, because a worker that raised skips what was queued after
    (``workers.py``), and which exchanges those are would differ between ranks.

Note: [Device collectives]
    A slice's gradients are averaged on the device (NCCL) on ``communication_stream``, so the
    reduction runs while compute goes on with the backward of the slices before it. The orderings,
    each made in :meth:`DeviceCollectives.average`:

    1. The communication stream waits for all compute issued so far: the gradients were produced
       there (and the local sums of ``no_sync`` steps were added to them there).
    2. The collectives are issued with ``async_op=True`` while the communication stream is the
       current stream: NCCL runs them on its own stream, after the work queued on the current one;
       ``Work.wait()`` makes the current (communication) stream wait for them without blocking the
       CPU. The division by the world size is queued there after them.
    3. The returned event travels with the slice's gradients (``SliceGradients.reduced``); the
       offload that copies them to the host waits for it on the offload stream. Compute never waits
       for it: the next writer of a summation buffer waits for that buffer's offload, which comes
       after the reduction, and nothing else writes the gradients.
    4. Each gradient is marked as used by the communication stream: autograd's own gradient
       tensors are dropped once their offload is queued, and the allocator must not hand their
       memory out before the reduction is done with it. The ``Work`` handles are kept until the
       backward's gradients have landed on the host (so after every reduction completed), in case
       the process group keeps its tensors alive through them rather than by marking them.
    5. After an exception, the copy engine drains the communication stream with its own (rule 5
       of Note: [Copy ordering]).

    The stream-ordering checker does not run this path: it simulates one process whose "device"
    is host memory, and no process group reduces on its simulated streams. Modelling it would take
    a simulated collective (a deferred in-place operation on a side stream) and device work issued
    on a side stream, which the checker's dispatch attributes to the compute stream today. The
    orderings above are the copy engine's rules 1 to 3 applied to one more side stream.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any
import weakref

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from .backend import Event
from .copies import CopyStreams
from .flat_views import flat_alias


class CollectiveError(RuntimeError):
    """A collective operation failed, or timed out because another rank did not join it."""


class HostCollectives:
    """The host-memory collectives of one process group, issued in order by one host worker.

    Args:
        copies: the copy engine (its workers and waits).
        group: the process group (gloo, or any backend that reduces CPU tensors).
        building: what they are made for (``"data-parallel OffloadModel"``), named in the error
            when the other ranks do not join the private group (:func:`waiting_for_the_group`).

    Raises:
        CollectiveError: the other ranks of ``group`` did not make the private group with this one
            within the group's timeout.
    """

    def __init__(self, copies: CopyStreams, group: Any,
                 building: str = "sharded OffloadOptimizer (given its own process_group)") -> None:
        self.copies = copies
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Note: [A private group for the worker]: what the worker issues, the caller's thread never does.
        with waiting_for_the_group(building, self.rank, self.world_size, "making its private gloo group"):
            self.channel = private_group(group)
        self.worker = copies.new_worker("collectives")
        # The thread holds its worker, not this object: end it with the model that owns this.
        weakref.finalize(self, self.worker.close)

    def submit(self, what: str, work: Callable[[], None], after: Sequence[Event | None] = ()) -> Event:
        """Run ``work`` (collectives on host tensors) after the events ``after``, in order with
        everything submitted before; returns its event."""
        def guarded() -> None:
            try:
                work()
            except CollectiveError:
                raise  # it says what the ranks disagree on, on every rank
            except Exception as error:
                raise CollectiveError(
                    f"{what} failed on rank {self.rank} of {self.world_size}: {error}. If another rank raised or "
                    "stopped first, its own error says why; this rank cannot go on with the step."
                ) from error
        return self.copies.submit(self.worker, guarded, after)

    def average(self, spans: Sequence[torch.Tensor], prepare: Callable[[], None], header: torch.Tensor | None,
                after: Sequence[Event | None], what: str,
                agreed: Callable[[torch.Tensor], None] | None = None) -> Event:
        """Run ``prepare`` (which fills the memory of ``spans``: zeros where this rank has no
        gradient, local sums added), replace ``header`` (what each rank says of the spans, of one
        size on every rank) by its sum and ask ``agreed`` of it, which raises when the ranks'
        spans would not match; then replace each span by its mean over the group. Returns the
        event of the end. Every rank whose ``agreed`` passed passes spans of the same sizes in the
        same order (Note: [Ranks that disagree on requires_grad] in ``offload/data_parallel.py``)."""
        def work() -> None:
            with torch.no_grad():
                prepare()
                if header is not None:
                    # Waited for before the sums: spans that differ between ranks would sum unrelated
                    # memory, or make gloo abort the process on a size that does not match.
                    self.channel.allreduce([header]).wait()
                    if agreed is not None:
                        agreed(header)
                for span in spans:
                    self.channel.allreduce([span]).wait()
                    span.div_(self.world_size)
        return self.submit(what, work, after)

    def agree(self, headers: Sequence[tuple[torch.Tensor, Callable[[torch.Tensor], None]]], what: str) -> Event:
        """Replace each header by its sum and ask its ``agreed`` of it, as :meth:`average` does for
        spans that this rank does not have. The all-reduces are issued together and waited for in
        order, so that many of them cost about one round trip, not one each: nothing waits on them
        to decide what to send next, and each rank issues one header per slice in slice order
        whether or not it has spans, so they pair with the other ranks' headers all the same."""
        def work() -> None:
            issued = [(self.channel.allreduce([header]), header, agreed) for header, agreed in headers]
            for request, header, agreed in issued:
                request.wait()
                agreed(header)  # the first disagreement raises, as it would with the waits one by one
        return self.submit(what, work)

    def broadcast(self, tensors: Sequence[torch.Tensor], sources: Sequence[int], after: Sequence[Event | None],
                  what: str, then: Callable[[], None] | None = None, failed: Callable[[], bool] | None = None,
                  told: Callable[[list[int]], None] | None = None) -> Event:
        """Give every rank ``tensors[k]`` as rank ``sources[k]`` holds it (group ranks), then run
        ``then`` in the worker; returns the event of the end.

        With ``failed`` (whether this rank's part of what is shared was not produced, asked once
        ``after`` is done), the ranks first agree on which of them failed, and ``told`` gets the
        others' ranks when any did (Note: [A failed part of a sharded update]); the tensors are
        shared all the same, so every rank keeps the same values."""
        def work() -> None:
            if failed is not None:
                flags = torch.zeros(self.world_size, dtype=torch.int32)
                flags[self.rank] = int(failed())
                self.channel.allreduce([flags]).wait()
                others = [rank for rank in flags.nonzero().flatten().tolist() if rank != self.rank]
                if others and told is not None:
                    told(others)
            for tensor, source in zip(tensors, sources):
                # Its memory as one contiguous run: a channels_last or transposed parameter too.
                flat = flat_alias(tensor)
                self.channel.broadcast(tensor if flat is None else flat, source).wait()
            if then is not None:
                then()
        return self.submit(what, work, after)


#: Per user group (by name), how many private groups this process made of it: the k-th one that
#: the ranks of a group make has the same name on each (Note: [A private group for the worker]).
_private_made: collections.Counter[str] = collections.Counter()


def private_group(group: Any) -> Any:
    """A gloo group of its own over the ranks of ``group``, with its timeout (Note: [A private
    group for the worker]). Every rank of ``group`` calls it, in the same order; it is freed with
    its last reference.

    Not ``dist.new_group``: a group over some of the ranks names itself after how many groups this
    rank has joined, which differs between ranks that belong to other groups too, and they would
    wait for each other under different names. Here the name is the user group's (the same on
    every rank of it) and a count of the private groups made of it."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        timeout = dist.default_pg_timeout
    name = group.group_name
    made = _private_made[name]
    _private_made[name] += 1
    store = dist.PrefixStore(f"offload/private/{name}/{made}", distributed_c10d._get_default_store())
    return dist.ProcessGroupGloo(store, dist.get_rank(group), dist.get_world_size(group), timeout)


@contextlib.contextmanager
def waiting_for_the_group(building: str, rank: int, world_size: int, doing: str) -> Iterator[None]:
    """Around a collective that building a ``building`` (``"data-parallel OffloadModel"``) issues
    on the caller's thread: raise its failure as a :class:`CollectiveError` that says so. Such a
    collective waits, for the group's whole timeout, for every rank to build the same thing; most
    often one did not because it raised first (a bad argument on that rank alone, an error while
    loading its data), and the bare error (gloo's "Wait timeout") names neither.

    Raises:
        CollectiveError: the collective failed or timed out.
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:  # gloo's timeouts and broken connections; the store's (DistStoreError)
        raise CollectiveError(
            f"building the {building} waited for the other ranks of its process group and failed on rank {rank} of "
            f"{world_size}, {doing}: {error}. Every rank of the group must build the same {building} on it, in "
            "the same order (docs/distributed.md); another rank probably failed or stopped first: look at its "
            "error. How long a rank waits is the process group's timeout") from error


def runs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Flat tensors that cover ``tensors`` (one slice's gradients in the order of their places in
    one buffer) together: one from the first to the last of each run of neighbours of one dtype
    in one storage (what lies between, alignment padding, is summed too and read by no one); a
    tensor that is not dense stays on its own. The runs depend on the places, not on the values,
    so ranks with the same places reduce the same memory."""
    spans: list[torch.Tensor] = []
    run: list[torch.Tensor] = []

    def close() -> None:
        if run:
            start, stop = run[0].storage_offset(), run[-1].storage_offset() + run[-1].numel()
            span = torch.empty(0, dtype=run[0].dtype, device=run[0].device)
            span.set_(run[0].untyped_storage(), start, (stop - start,))
            spans.append(span)
            run.clear()

    for tensor in tensors:
        flat = flat_alias(tensor)
        if flat is None:
            close()
            spans.append(tensor)
            continue
        if run and (flat.dtype != run[-1].dtype or flat.untyped_storage().data_ptr() != run[-1].untyped_storage().data_ptr()
                    or flat.storage_offset() < run[-1].storage_offset() + run[-1].numel()):
            close()
        run.append(flat)
    close()
    return spans


def _spans(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Flat tensors that cover ``tensors`` together: per storage and dtype, one tensor from the
    first element of the first to the last element of the last (what lies between, alignment
    padding or places of gradients not produced, is summed too, and read by no one); a tensor that
    is not dense stays on its own."""
    groups: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    spans: list[torch.Tensor] = []
    for tensor in tensors:
        if flat_alias(tensor) is None:
            spans.append(tensor)
            continue
        groups.setdefault((tensor.untyped_storage().data_ptr(), tensor.dtype), []).append(tensor)
    for members in groups.values():
        start = min(t.storage_offset() for t in members)
        stop = max(t.storage_offset() + t.numel() for t in members)
        first = members[0]
        span = torch.empty(0, dtype=first.dtype, device=first.device)
        span.set_(first.untyped_storage(), start, (stop - start,))
        spans.append(span)
    return spans


class DeviceCollectives:
    """The device-memory collectives (NCCL) of one process group, on a communication stream; see
    Note: [Device collectives].

    Args:
        copies: the copy engine (its backend and streams). Without a backend (copies made
            synchronous) the collectives run on the compute stream and block it.
        group: the process group.
    """

    def __init__(self, copies: CopyStreams, group: Any) -> None:
        self.copies = copies
        self.group = group
        self.world_size = dist.get_world_size(group)
        # Reductions run here so that they overlap the backward of the slices before them.
        self.communication_stream = copies.new_side_stream("communication") if copies.backend is not None else None
        self._in_flight: list[Any] = []  # Work handles, until the reductions are known done

    def average(self, tensors: Sequence[torch.Tensor]) -> Event | None:
        """Replace each device tensor by its mean over the group; returns the event after which
        the means are there (``None`` when they are there on return)."""
        backend, stream = self.copies.backend, self.communication_stream
        with torch.no_grad():
            # One collective per run of memory, as on the host: the sums of several microbatches
            # lie side by side in one summation buffer, and each NCCL call costs a launch and a
            # round trip between the ranks. Each gradient's memory is one run (they are dense:
            # see _unshared in autograd/gradients.py), whatever its layout.
            flats = _spans(tensors)
            if backend is None or stream is None:
                for flat in flats:
                    dist.all_reduce(flat, group=self.group)
                    flat.div_(self.world_size)
                return None
            # Ordering 1: the gradients were produced by the compute issued so far.
            backend.wait_stream(stream, backend.current_stream())
            with backend.issuing_on(stream):
                for flat in flats:
                    work = dist.all_reduce(flat, group=self.group, async_op=True)
                    # Ordering 2: the division, and whatever waits for this stream, come after the sum.
                    work.wait()
                    flat.div_(self.world_size)
                    self._in_flight.append(work)
            reduced = backend.record(stream)
            for tensor in tensors:
                # Ordering 4: if the gradient is freed first, the reduction may still be using it.
                backend.mark_used(tensor, stream)
            return reduced

    def landed(self) -> None:
        """Every reduction issued so far is done (the offloads after them completed): let go of
        their handles."""
        self._in_flight.clear()
