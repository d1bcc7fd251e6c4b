"""Which processes save or load a checkpoint together, and how they agree: the process group and
this rank in it, values gathered from every rank, a barrier, and work done on rank 0 whose failure
every rank raises.

What it does not hold: what a save writes (``saver.py``) or a load reads (``loader.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint_files import CheckpointError
from ..model import OffloadModel
from ..optimizer import OffloadOptimizer

T = TypeVar("T")

# DCP warns when it works without a process group; for a single process that is the plan, not an
# accident. One filter, added once at import, for the words DCP uses: a ``warnings.catch_warnings()``
# around each save would, on leaving, reset every module's once-registry, so every warning a user
# had already seen (a deprecation, say) would print again after each checkpoint.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized, "
                        r"assuming the intent is to (save|load) in a single process")


def _group(model: nn.Module, optimizer: torch.optim.Optimizer | None, process_group: Any) -> tuple[Any, int, int]:
    """The group that saves or loads together, this rank in it, and its size (None, 0, 1: one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    group = process_group
    if group is None and isinstance(optimizer, OffloadOptimizer) and optimizer._collectives is not None:
        group = optimizer._collectives.group  # the host (gloo) group, when the model's is NCCL
    if group is None and isinstance(model, OffloadModel):
        group = model.process_group
    if group is None:
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _barrier(group: Any) -> None:
    if group is not None:
        dist.barrier(group=group)


def _gathered_list(group: Any, value: Any) -> list[Any]:
    """``value`` of every rank of ``group``, in rank order (``[value]`` for one process)."""
    if group is None:
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def _on_rank_0(group: Any, rank: int, work: Any, failure: Any) -> None:
    """Run ``work`` on rank 0; on every rank, raise :class:`CheckpointError` with ``failure(error)``
    when it raised an ``Exception`` (so that no rank waits for one that gave up). A barrier too."""
    message, raised = None, None
    if rank == 0:
        try:
            work()
        except Exception as error:
            raised = error
            try:
                message = failure(error)
            except Exception as describing:
                # Rank 0 still reaches the gather below: raised here, the others would wait there.
                message = (f"{type(error).__name__}: {error} (describing it failed too: "
                           f"{type(describing).__name__}: {describing})")
    if group is not None:
        message = _gathered_list(group, message)[0]
    if message is not None:
        raise CheckpointError(message) from raised


def _agreed(group: Any, work: Callable[[], T], done: str = "saved", *, others: str | None = None,
            same: Callable[[T], tuple[Any, str]] | None = None, differ: Callable[[str], str] | None = None) -> T:
    """``work()`` on every rank of ``group``; when it raised an ``Exception`` on any rank, raise on
    every rank, so that none goes on into a collective that another left: the rank that raised
    its own exception, the others a :class:`CheckpointError` that names it and says why (nothing
    was ``done``, or what ``others`` says). A rank-local refusal before a save (this rank's
    optimizer mixes two steps) or a load (a path only this rank cannot read) is one; so is a
    hook that raises on one rank as a load ends.

    ``same(result)``, when given, is what the ranks must have in common (the path a save writes,
    the checkpoint a load reads), as a key and its description; when the keys differ, every rank
    raises a :class:`CheckpointError` of ``differ(listing)``, the listing naming each rank's. It
    travels with the refusals: no collective of its own. The gather it makes is a save's or a
    load's first collective: when it fails there (a rank that never called), a
    :class:`CheckpointError` says that every rank must call it."""
    try:
        result, error = work(), None
        mine = None if same is None else same(result)
    except Exception as raised:
        result, error, mine = None, raised, None
    try:
        said = _gathered_list(group, (None if error is None else f"{type(error).__name__}: {error}", mine))
    except RuntimeError as failed:  # a timeout, or a rank that left: DistBackendError is one
        if same is None:
            raise
        # The first collective of a save or a load: the DDP habit of saving on rank 0 alone waits here.
        called = "save_checkpoint" if done == "saved" else "load_checkpoint"
        raise CheckpointError(
            f"{called} is collective: every rank of the process group must call it (not only rank 0), with the "
            f"same path; the other ranks did not join within the group's timeout, or one of them stopped, and "
            f"nothing was {done} ({type(failed).__name__}: {failed})") from failed
    if error is not None:
        raise error
    refused = [f"rank {rank}: {message}" for rank, (message, _) in enumerate(said) if message is not None]
    if refused:
        raise CheckpointError((others or f"nothing was {done}, since another rank refused") + ": " + "; ".join(refused))
    if same is not None and len({key for _, (key, _) in said}) > 1:
        assert differ is not None, "same= needs differ="
        raise CheckpointError(differ("; ".join(f"rank {rank}: {description}"
                                               for rank, (_, (_, description)) in enumerate(said))))
    return result  # type: ignore[return-value]
