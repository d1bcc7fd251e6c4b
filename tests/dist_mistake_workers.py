"""What each rank runs in ``test_distributed_mistakes.py``: the mistakes of a data-parallel run,
each on a group of its own whose short timeout makes a rank that waits in vain fail fast, and the
ranks meet again on the default group between them (``dist_workers.py`` sets it up)."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from offload import CheckpointError, OffloadModel, OffloadOptimizer, load_checkpoint, save_checkpoint
from offload.streams.collectives import CollectiveError

from .dist_workers import data, join, network, save, share

#: Seconds a mistake's group waits for a rank that never joins: the test waits about this long per timeout.
SHORT_S = 2


def short_group() -> Any:
    """A gloo group over every rank that gives up on a missing rank after :data:`SHORT_S` seconds."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SHORT_S))


def _step(model: nn.Module, rank: int, world_size: int, step: int = 0) -> None:
    model(share(data(step, world_size), rank, world_size)).pow(2).mean().backward()


def _said(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def requires_grad_changed(rank: int, world_size: int, directory: str, results: dict[str, Any]) -> None:
    """After construction the ranks freeze different parameters: of equal sizes in one slice (their
    gradients would have been summed as each other's), and a whole slice on rank 1 (backward no
    longer reaches it there: slices of other sizes would have made gloo abort the process)."""
    for case, num_slices, frozen in (("same_slice", 1, ["2.bias" if rank == 0 else "4.bias"]),
                                     ("whole_slice", 3, ["0.weight", "0.bias"] if rank == 1 else [])):
        model = OffloadModel(network(seed=0), device="cpu", num_slices=num_slices, process_group=dist.group.WORLD)
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)
        try:
            _step(model, rank, world_size)
            results[case] = "trained"
        except CollectiveError as error:
            results[case] = _said(error)
        dist.barrier()


def forward_fails_on_one_rank(rank: int, world_size: int, directory: str, results: dict[str, Any]) -> None:
    """Rank 1's forward raises (an out-of-memory error, say) and its loop skips the batch."""
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=short_group())
    steps = []
    for step in range(2):
        try:
            if rank == 1 and step == 0:
                model(torch.ones(4, 5))  # the wrong width: the forward raises in the walk, as an OOM would
            else:
                _step(model, rank, world_size, step)
            steps.append("ok")
        except (RuntimeError, CollectiveError) as error:
            steps.append(_said(error))
    results["forward_fails"] = steps
    dist.barrier()


def forward_fails_on_every_rank(rank: int, world_size: int, directory: str, results: dict[str, Any]) -> None:
    """Every rank's forward raises alike (a bad input): the ranks are still in step and train on."""
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=short_group())
    steps = []
    for step in range(2):
        try:
            if step == 0:
                model(torch.ones(4, 5))
            else:
                _step(model, rank, world_size, step)
            steps.append("ok")
        except (RuntimeError, CollectiveError) as error:
            steps.append(_said(error))
    results["forward_fails_everywhere"] = steps
    dist.barrier()


def state_read_on_one_rank(rank: int, world_size: int, directory: str, results: dict[str, Any]) -> None:
    """Rank 0 alone reads its share of a sharded optimizer's state before the first step()."""
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=short_group())
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    try:
        if rank == 0:
            list(optimizer.state_by_slice())
        _step(model, rank, world_size)
        optimizer.step()
        results["state_read_alone"] = "stepped"
    except (CollectiveError, ValueError) as error:
        results["state_read_alone"] = _said(error)
    dist.barrier()


def optimizers_differ(rank: int, world_size: int, directory: str, results: dict[str, Any]) -> None:
    """Sharded OffloadOptimizers over other parameter groups; then a plain optimizer on rank 1."""
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    params = list(model.parameters())
    optimizer = OffloadOptimizer(model, torch.optim.SGD, params if rank == 0 else params[2:], lr=0.1)
    _step(model, rank, world_size)
    try:
        optimizer.step()
        results["other_groups"] = "stepped"
    except ValueError as error:
        results["other_groups"] = _said(error)
    dist.barrier()
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=short_group())
    optimizer = (OffloadOptimizer(model, torch.optim.SGD, lr=0.1) if rank == 0
                 else torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        _step(model, rank, world_size)
        optimizer.step()
        _step(model, rank, world_size, 1)
        results["plain_on_one_rank"] = "stepped"
    except (CollectiveError, ValueError) as error:
        results["plain_on_one_rank"] = _said(error)
    dist.barrier()


def checkpoint_on_one_rank(rank: int, world_size: int, directory: str, results: dict[str, Any]) -> None:
    """save_checkpoint, then load_checkpoint, called on rank 0 only (the DDP habit)."""
    model = nn.Linear(3, 2)
    path = f"{directory}/checkpoint"
    save_checkpoint(path, model, process_group=dist.group.WORLD)  # every rank: a checkpoint to load
    for name, call in (("save_alone", lambda group: save_checkpoint(f"{directory}/alone", model, process_group=group)),
                       ("load_alone", lambda group: load_checkpoint(path, model, process_group=group))):
        group = short_group()
        if rank == 0:
            try:
                call(group)
                results[name] = "returned"
            except CheckpointError as error:
                results[name] = _said(error)
        dist.barrier()


def mistakes(rank: int, world_size: int, directory: str) -> None:
    results: dict[str, Any] = {}
    for job in (requires_grad_changed, forward_fails_on_one_rank, forward_fails_on_every_rank, state_read_on_one_rank,
                optimizers_differ, checkpoint_on_one_rank):
        try:
            job(rank, world_size, directory, results)
        except Exception as error:  # saved for the test to show, instead of failing every test of the group
            results[job.__name__] = _said(error)
    save(directory, "mistakes", rank, results)


def run(rank: int, world_size: int, directory: str) -> None:
    join(rank, world_size, directory)
    try:
        mistakes(rank, world_size, directory)
    finally:
        dist.destroy_process_group()
