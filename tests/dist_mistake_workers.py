"""What each rank runs in ``test_distributed_mistakes.py``: the mistakes of a data-parallel run,
each on a group of its own whose short timeout makes a rank that waits in vain fail fast, and the
ranks meet again on the default group between them (``dist_workers.py`` sets it up)."""

from __future__ import annotations

import contextlib
import datetime
import time
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

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


def construction_fails_on_one_rank(rank: int, world_size: int, directory: str, results: dict[str, Any]) -> None:
    """Rank 1 fails while building its data-parallel OffloadModel, before each of the collectives
    that building issues: a bad argument (before the private group), then, simulated, a failure
    before the structure check and one before the broadcast of rank 0's tensors."""
    failure = ValueError("rank 1 failed here")
    for case, failing in (("bad_argument", None),
                          ("structure", mock.patch("offload.data_parallel._check_structure", side_effect=failure)),
                          ("broadcast", mock.patch("offload.data_parallel._take_rank_zeros", side_effect=failure))):
        group = short_group()
        started = time.monotonic()
        try:
            with failing if failing is not None and rank == 1 else contextlib.nullcontext():
                OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=group,
                             compute_dtype=torch.int8 if case == "bad_argument" and rank == 1 else None)
            results[f"construction_{case}"] = "built"
        except (RuntimeError, ValueError) as error:
            results[f"construction_{case}"] = _said(error)
        results[f"construction_{case}_s"] = time.monotonic() - started
        dist.barrier()


def _hook_warnings(step: Callable[[], None]) -> list[str]:
    """The warnings about gradient hooks that ``step`` raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    return [str(w.message) for w in caught if "gradient hooks of" in str(w.message)]


def hooks_see_the_average(rank: int, world_size: int, directory: str, results: dict[str, Any]) -> None:
    """A clamping hook on a parameter: under process_group= it sees the average (and a synced
    backward warns of it); under DistributedDataParallel around an OffloadModel it sees this rank's
    own gradient, as under DDP over the plain layers."""
    batch = share(data(0, world_size), rank, world_size)
    plain = network(seed=0)
    plain(batch).pow(2).mean().backward()
    results["hooks_local"] = plain[2].weight.grad.clone()

    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    said = [_hook_warnings(lambda: _step(model, rank, world_size))]  # no hooks: nothing to say
    seen: list[torch.Tensor] = []
    model[2].weight.register_hook(lambda g: (seen.append(g.clone()), g.clamp(-0.01, 0.01))[1])
    model[4].bias.register_post_accumulate_grad_hook(lambda p: None)
    with model.no_sync():  # local gradients: the hooks see what DDP's would
        said.append(_hook_warnings(lambda: _step(model, rank, world_size)))
    said += [_hook_warnings(lambda: _step(model, rank, world_size)) for _ in range(2)]  # told once
    results["hooks_warned"] = said
    results["hooks_seen_synced"] = seen[-1]

    for name, layers in (("ddp", network(seed=0)),
                         ("ddp_offload", OffloadModel(network(seed=0), device="cpu", num_slices=3))):
        wrapped = nn.parallel.DistributedDataParallel(layers)
        seen = []
        wrapped.module[2].weight.register_hook(lambda g: (seen.append(g.clone()), g.clamp(-0.01, 0.01))[1])
        said = _hook_warnings(lambda: wrapped(batch).pow(2).mean().backward())
        results[f"hooks_{name}"] = (seen, said, [p.grad.clone() for p in wrapped.parameters()])
    dist.barrier()


def buffers_gloo_cannot_send(rank: int, world_size: int, directory: str, results: dict[str, Any]) -> None:
    """Buffers of dtypes gloo sends no collective in (int16, uint16, uint32, float8), and others, each
    rank's own: building takes rank 0's, bit for bit (they go as bytes)."""
    layers = network(seed=0)
    dtypes = [torch.int16, torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.bool, torch.complex64,
              torch.bfloat16]
    for k, dtype in enumerate(dtypes):
        values = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1) + k
        layers[k % 3 * 2].register_buffer(f"odd{k}", (values > 6) if dtype is torch.bool else values.to(dtype))
    layers[0].register_buffer("scalar", torch.tensor(rank + 5, dtype=torch.int16))
    model = OffloadModel(layers, device="cpu", num_slices=3, process_group=dist.group.WORLD)
    results["odd_buffers"] = {name: b.clone() for name, b in model.named_buffers() if "odd" in name or "scalar" in name}


def mistakes(rank: int, world_size: int, directory: str) -> None:
    results: dict[str, Any] = {}
    for job in (requires_grad_changed, forward_fails_on_one_rank, forward_fails_on_every_rank, state_read_on_one_rank,
                optimizers_differ, checkpoint_on_one_rank, construction_fails_on_one_rank, hooks_see_the_average,
                buffers_gloo_cannot_send):
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
