"""Collective communication across processes, and how it is ordered with copies and host work.

A process group requires every rank to issue the same collectives in the same order. Collectives
on host memory (gloo) are therefore all issued by one host worker per group, in the order the
program submits them: the gradient averages of each backward, slice by slice, then the parameter
broadcasts of a sharded optimizer step. Each waits, in the worker, for the copy or the update that
produced its data (the ``after`` events), and the caller's thread goes on meanwhile, so the
averages overlap the backward of earlier slices. Collectives on device memory (NCCL) are issued by
the caller's thread on the compute stream, where the data is produced, and the offload that
follows is ordered after them like after any compute.

A collective that fails (a timeout because another rank died, a broken connection) is raised, at
the next wait, as :class:`CollectiveError`, saying on which rank and what it was doing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .backend import Event
from .copies import CopyStreams


class CollectiveError(RuntimeError):
    """A collective operation failed, or timed out because another rank did not join it."""


class HostCollectives:
    """The host-memory collectives of one process group, issued in order by one host worker.

    Args:
        copies: the copy engine (its workers and waits).
        group: the process group (gloo, or any backend that reduces CPU tensors).
    """

    def __init__(self, copies: CopyStreams, group: Any) -> None:
        self.copies = copies
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.worker = copies.new_worker("collectives")

    def submit(self, what: str, work: Callable[[], None], after: Sequence[Event | None] = ()) -> Event:
        """Run ``work`` (collectives on host tensors) after the events ``after``, in order with
        everything submitted before; returns its event."""
        def guarded() -> None:
            try:
                work()
            except Exception as error:
                raise CollectiveError(
                    f"{what} failed on rank {self.rank} of {self.world_size}: {error}. If another rank raised or "
                    "stopped first, its own error says why; this rank cannot go on with the step."
                ) from error
        return self.copies.submit(self.worker, guarded, after)

    def average(self, tensors: Sequence[torch.Tensor], add_first: Sequence[torch.Tensor | None],
                after: Sequence[Event | None], what: str) -> Event:
        """Replace each tensor by its mean over the group, after adding ``add_first`` (local values
        to include, or ``None``) to it; returns the event of the finished average."""
        def work() -> None:
            with torch.no_grad():
                for tensor, extra in zip(tensors, add_first):
                    if extra is not None:
                        tensor.add_(extra)
                for tensor in tensors:
                    dist.all_reduce(tensor, group=self.group)
                    tensor.div_(self.world_size)
        return self.submit(what, work, after)

    def broadcast(self, tensors: Sequence[torch.Tensor], sources: Sequence[int], after: Sequence[Event | None],
                  what: str, then: Callable[[], None] | None = None) -> Event:
        """Give every rank ``tensors[k]`` as rank ``sources[k]`` holds it (group ranks), then run
        ``then`` in the worker; returns the event of the end."""
        def work() -> None:
            for tensor, source in zip(tensors, sources):
                dist.broadcast(tensor, src=dist.get_global_rank(self.group, source), group=self.group)
            if then is not None:
                then()
        return self.submit(what, work, after)


def average_on_device(tensors: Sequence[torch.Tensor], group: Any, world_size: int) -> None:
    """Replace each device tensor by its mean over the group, queued on the compute stream."""
    with torch.no_grad():
        for tensor in tensors:
            dist.all_reduce(tensor, group=group)
            tensor.div_(world_size)
